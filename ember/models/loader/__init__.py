"""Build a model and fill its weights: from an HF directory (safetensors, sharded or not), from
random "dummy" values (config alone), or from any iterator of (HF name, tensor) pairs (GGUF).

Which of these reads a given checkpoint is decided once, by its format, in ``formats.py``.

The model is built on the meta device and materialised with ``to_empty``, so building costs no
time on random initialisation that loading overwrites anyway. torch, transformers and safetensors
are imported inside the functions: importing this package (e.g. for ``loader.gguf``) stays cheap.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from ember.attention_backends.base import AttentionBackend

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_INDEX = "model.safetensors.index.json"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3  # vLLM's dummy range: small enough to keep activations sane


def load_config(model_dir: str | os.PathLike) -> PretrainedConfig:
    """The HF config of a model directory; ValueError when it is not one."""
    from transformers import AutoConfig

    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"model path {model_dir!r} is not a directory")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"model directory {model_dir!r} has no config.json")
    return AutoConfig.from_pretrained(model_dir)


def safetensors_files(model_dir: str | os.PathLike) -> list[str]:
    """The checkpoint's *.safetensors files: the shards named by the index when there is one."""
    model_dir = os.fspath(model_dir)
    index = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: unreadable safetensors index ({e})") from e
        files = [os.path.join(model_dir, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(
        os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors")
    )
    if not files:
        others = [n for n in os.listdir(model_dir) if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
        found = ", ".join(sorted(others))
        hint = f" (found {found}; only safetensors is read here)" if others else ""
        raise ValueError(f"model directory {model_dir!r} has no *.safetensors weights{hint}")
    return files


def _corrupt(path: str, err: BaseException) -> ValueError:
    return ValueError(f"{path}: corrupt or truncated safetensors file ({err})")


def check_safetensors(files: Iterable[str]) -> None:
    """Parse every header up front (cheap: a few KB each) so that a damaged last shard fails
    before minutes of loading the others."""
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                f.keys()
        except Exception as e:  # SafetensorError, OSError: the header is unreadable
            raise _corrupt(path, e) from e


def beyond_num_layers(config: Any) -> Callable[[str], bool]:
    """A predicate on HF weight names: True for a decoder layer the config does not build.

    A checkpoint holds more layers than its config when `hf_overrides` lowers
    num_hidden_layers (vLLM's way to try a model on fewer layers): those are never read."""
    num_layers = getattr(config, "num_hidden_layers", None)

    def skip(name: str) -> bool:
        match = _LAYER_INDEX.search(name)
        return num_layers is not None and match is not None and int(match.group(1)) >= num_layers

    return skip


def iter_safetensors(
    files: list[str], progress: bool | None = None, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, lazily (one tensor in memory at a time).
    `progress`: show a tqdm bar; None follows EMBER_DISABLE_PROGRESS. Names for which `skip`
    is true are not read."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    from ember import envs

    bar = tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard",
               disable=envs.disable_progress_bars() if progress is None else not progress)
    for path in bar:
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:
            raise _corrupt(path, e) from e
        with handle as f:
            for name in f.keys():
                if skip is not None and skip(name):
                    continue
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise _corrupt(path, e) from e
                yield name, tensor


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every floating-point parameter with uniform(DUMMY_LOW, DUMMY_HIGH), reproducibly."""
    import torch

    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for _, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            gen = generators.get(p.device)
            if gen is None:
                gen = generators[p.device] = torch.Generator(p.device).manual_seed(seed)
            if p.element_size() < 2:  # fp8 etc. have no uniform_: draw in float32, cast
                p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(
                    DUMMY_LOW, DUMMY_HIGH, generator=gen))  # fmt: skip
            else:
                p.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=gen)


def load_model(
    model_dir_or_config: str | os.PathLike | PretrainedConfig,
    arch_cls: type[nn.Module],
    attn_backend: type[AttentionBackend],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> nn.Module:
    """Build ``arch_cls(config, attn_backend, dtype)`` on ``device`` and fill its weights.

    ``weights``, when given (e.g. the GGUF loader's iterator), is used instead of the files;
    ``load_format="dummy"`` needs only a config (or a directory holding config.json).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    config, model_dir = _config_and_dir(model_dir_or_config)
    if load_format != "dummy" and weights is None:
        if model_dir is None:
            raise ValueError("loading real weights needs a model directory or a weights iterator")
        files = safetensors_files(model_dir)
        check_safetensors(files)
        weights = iter_safetensors(files, progress, beyond_num_layers(config))
    elif weights is not None:
        skip = beyond_num_layers(config)
        weights = ((name, w) for name, w in weights if not skip(name))
    model = build_empty(config, arch_cls, attn_backend, dtype, device)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.load_weights(weights)
    return model.eval().requires_grad_(False)


def build_empty(config: Any, arch_cls: type[nn.Module], attn_backend: type[AttentionBackend],
                dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """``arch_cls(config, attn_backend, dtype)`` built on the meta device, then given storage on
    ``device`` that nothing has written yet: what a loader fills."""
    import torch

    with torch.device("meta"):
        model = arch_cls(config, attn_backend, dtype)
    return materialize(model, torch.device(device))


def materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model.to_empty(device=device)`` without its cost: torch.empty_like of a meta tensor runs
    torch's Python reference, which imports sympy (~0.45 s of a small model's start on a CPU);
    empty_strided is the same allocation, with the same strides, straight from ATen."""
    import torch

    return model._apply(
        lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device))


def _config_and_dir(src: Any) -> tuple[Any, str | None]:
    if isinstance(src, (str, os.PathLike)):
        return load_config(src), os.fspath(src)
    if not hasattr(src, "to_dict"):
        raise ValueError(f"expected a model directory or a transformers config, got {type(src)}")
    return src, None
