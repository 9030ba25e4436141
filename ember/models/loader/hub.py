"""Models by Hugging Face Hub name (``LLM("org/name")``): what to fetch, through huggingface_hub.

Two fetches, as vLLM splits them: ``fetch_metadata`` (config, tokenizer files,
generation_config, the safetensors index: small files) wherever the config is resolved (the front
end and the engine core), and ``fetch_weights`` (only the safetensors shards the index names, or
every top-level ``*.safetensors`` without an index) where the weights are loaded, pinned to the
commit the metadata came from. ``dummy`` weights fetch no shard. Checkpoints with only PyTorch
``.bin`` weights are refused: ember reads safetensors.

huggingface_hub does every transfer, cache write, lock and revision lookup: its cache
(``HF_HUB_CACHE``, or ``download_dir``) is where files land, ``HF_HUB_OFFLINE=1`` serves the
cache without any network call, and a commit, branch or tag is a ``revision``. The progress bar is
huggingface_hub's tqdm, off when ember's progress bars are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# Small files a model needs besides its weights (fnmatch: "*" also matches "/", so the
# sentence-transformers module configs of pooling models come too).
METADATA_PATTERNS = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HubModel:
    """A resolved hub checkpoint: the repo, the commit its snapshot holds, the cache used."""

    repo_id: str
    commit: str
    cache_dir: str | None  # None: huggingface_hub's default cache
    snapshot: str  # the local snapshot folder (what ModelConfig.path points at)


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub repo id ("org/name" or "name")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.endswith(".gguf") or name.startswith((".", "/", "~")) or os.sep + os.sep in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _progress_class(progress: bool | None) -> Any:
    from ember import envs

    if progress is None:
        progress = not envs.disable_progress_bars()
    if progress:
        return None  # huggingface_hub's own bar
    from tqdm.auto import tqdm

    class _Silent(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return _Silent


def _snapshot(repo_id: str, revision: str | None, cache_dir: str | None, patterns: list[str],
              progress: bool | None, what: str, kind: str = "model") -> str:  # fmt: skip
    """snapshot_download, its failures turned into one clear ValueError."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=patterns, tqdm_class=_progress_class(progress))
    except RevisionNotFoundError as e:
        raise ValueError(f"{kind} {repo_id!r}: the hub has no revision {revision!r}") from e
    except GatedRepoError as e:
        raise ValueError(f"{kind} {repo_id!r} is gated on the hub: accept its terms and log in "
                         "(HF_TOKEN or `hf auth login`)") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"{kind} {repo_id!r} is not a local path and not a model on the hub "
                         "(or it is private: log in with HF_TOKEN)") from e
    except LocalEntryNotFoundError as e:
        cache = cache_dir or constants.HF_HUB_CACHE
        why = ("HF_HUB_OFFLINE is set" if constants.is_offline_mode()
               else "the hub could not be reached")
        raise ValueError(f"{kind} {repo_id!r}{at} is not a local path, and its {what} are not in "
                         f"the hub cache {cache!r} ({why})") from e
    except HfHubHTTPError as e:
        raise ValueError(f"{kind} {repo_id!r}{at}: the hub refused the download ({e})") from e
    except OSError as e:  # e.g. IncompleteSnapshotError, disk errors
        raise ValueError(f"{kind} {repo_id!r}{at}: cannot fetch its {what} ({e})") from e


def fetch_metadata(repo_id: str, revision: str | None = None, cache_dir: str | None = None,
                   progress: bool | None = None) -> HubModel:  # fmt: skip
    """Config, tokenizer and generation-config files of a hub model, in the local cache."""
    cache_dir = os.path.expanduser(cache_dir) if cache_dir else None
    folder = _snapshot(repo_id, revision, cache_dir, METADATA_PATTERNS, progress,
                       "config and tokenizer files")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"hub repo {repo_id!r} has no config.json: not a transformers model")
    return HubModel(repo_id, os.path.basename(os.path.normpath(folder)), cache_dir, folder)


def fetch_tokenizer(repo_id: str, revision: str | None = None, cache_dir: str | None = None,
                    progress: bool | None = None) -> str:  # fmt: skip
    """The local folder of a hub tokenizer's files."""
    cache_dir = os.path.expanduser(cache_dir) if cache_dir else None
    return _snapshot(repo_id, revision, cache_dir, METADATA_PATTERNS, progress, "tokenizer files",
                     "tokenizer")


def weight_patterns(snapshot: str) -> list[str]:
    """The shard names of the safetensors index when there is one, else every top-level
    ``*.safetensors`` file (never .bin, .pt, .gguf, nor the consolidated copy some repos keep
    beside their shards)."""
    index = os.path.join(snapshot, WEIGHTS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: unreadable safetensors index ({e})") from e
    return ["*.safetensors"]


def fetch_weights(hub: HubModel, progress: bool | None = None) -> str:
    """The safetensors shards of ``hub``'s commit, in the cache; returns the snapshot folder."""
    folder = _snapshot(hub.repo_id, hub.commit, hub.cache_dir, weight_patterns(hub.snapshot),
                       progress, "safetensors weights")
    if not any(n.endswith(".safetensors") for n in os.listdir(folder)):
        raise ValueError(f"hub model {hub.repo_id!r} (commit {hub.commit}) has no safetensors "
                         "weights; ember reads safetensors, not PyTorch .bin files")
    return folder
