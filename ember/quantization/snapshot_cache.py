"""A disk cache of a quantized model as its method's post-load work left it.

On the CPU, most of the default model's weight loading is the gguf method's post-load work:
decoding the Q4_1 blocks, packing each layer for torch's int4 matmul and building the int8
logits head (~1 s of a ~3 s start). A method that can describe what that work built
(``QuantizationMethod.snapshot_recipe``) and rebuild it around saved tensors
(``restore_snapshot``) gets it saved the first time a single-file checkpoint loads: every tensor
of the finished model in one safetensors file, plus the recipe, under ``EMBER_CACHE_DIR``
(ember.envs.cache_dir). Later loads, in any process, build the model empty and take its tensors
from that file (~0.1-0.3 s).

An entry is keyed by everything that decides what the work produces: the file (path, size,
mtime), the model class and its resolved config (``hf_overrides`` included), the method, dtype
and device type, and the torch and ember versions with the CPU's instruction set (torch's int4
packing is ISA-specific) and the method's ``snapshot_variant`` (gguf: whether the native kernel
runs here). An entry that cannot be written or read is skipped and the checkpoint
loads as before: the cache never raises an error. The entries together stay under
``MAX_BYTES``: a save removes the least recently used ones beyond it (a load marks its entry
used).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING

from ember import envs
from ember.disk_cache import write_entry

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ember.attention_backends.base import AttentionBackend
    from ember.config import ModelConfig
    from ember.quantization.base import QuantizationMethod

logger = logging.getLogger("ember")
FORMAT = 2  # raise when what an entry holds changes meaning (2: native 4-bit CPU layers)
_RECIPE = "recipe.json"  # written last: a directory without it is incomplete
_TENSORS = "tensors.safetensors"
MAX_BYTES = 4 * 2**30  # all entries together; the default model's is ~200 MB


def entry_dir(cfg: ModelConfig, method: QuantizationMethod, model_cls: type,
              dtype: torch.dtype, device: torch.device) -> str | None:
    """The cache directory of this load (which may not exist yet), or None when caching is off,
    the checkpoint is not one file or the load is not of its weights (load_format="dummy").
    ValueError, as the loaders give it, when an explicit load_format does not match the file."""
    import torch

    import ember
    from ember.models.loader.formats import weight_format

    root = envs.cache_dir()
    if weight_format(cfg) == "dummy" or root is None or not os.path.isfile(cfg.path):
        return None
    st = os.stat(cfg.path)
    # The context limit the engine noted on the config shapes no weight (rotary tables are
    # computed, not saved): loads with another max_model_len share the entry.
    config = json.dumps({k: v for k, v in vars(cfg.hf_config).items()
                         if k != "ember_max_model_len"}, sort_keys=True, default=str)
    key = "|".join(map(str, (
        FORMAT, os.path.realpath(cfg.path), st.st_size, st.st_mtime_ns,
        f"{model_cls.__module__}.{model_cls.__qualname__}", config, method.name, dtype,
        # ember's own version, not the installed distribution's: a source tree on PYTHONPATH
        # has no distribution metadata (importlib.metadata would raise PackageNotFoundError).
        device.type, torch.__version__, ember.__version__,
        torch.backends.cpu.get_cpu_capability(), method.snapshot_variant(device),
    )))
    return os.path.join(root, "quantized-models", hashlib.sha256(key.encode()).hexdigest()[:32])


def load(cfg: ModelConfig, method: QuantizationMethod | None, model_cls: type[nn.Module],
         attn_backend: type[AttentionBackend], dtype: torch.dtype,
         device: torch.device) -> nn.Module | None:  # fmt: skip
    """The model restored from its cache entry, or None (no method, no entry, or an entry that
    does not fit). Call it where the model would be built (the method's linear layers)."""
    if method is None or not method.offers_snapshots:
        return None
    directory = entry_dir(cfg, method, model_cls, dtype, device)
    if directory is None or not os.path.isfile(os.path.join(directory, _RECIPE)):
        return None
    try:
        from safetensors.torch import load_file

        from ember.models.loader import build_empty

        with open(os.path.join(directory, _RECIPE)) as f:
            recipe = json.load(f)
        tensors = load_file(os.path.join(directory, _TENSORS), device=str(device))
        # A tensor sits in the file where the ones before it end, but torch's CPU kernels may
        # assume their allocator's 64-byte alignment (the int8 weight-only matmul faults on an
        # int8 head 8 bytes off): a misaligned tensor is copied.
        tensors = {name: t.clone() if t.data_ptr() % 64 else t for name, t in tensors.items()}
        for alias, name in recipe["aliases"].items():  # tied weights: one tensor, two names
            tensors[alias] = tensors[name]
        model = build_empty(cfg.hf_config, model_cls, attn_backend, dtype, device)
        method.restore_snapshot(model, recipe["method"], tensors)
        model.load_state_dict(tensors, strict=True, assign=True)
    except Exception as e:  # a damaged or stale entry: load the checkpoint (and overwrite it)
        logger.debug("quantized model cache entry %s unusable (%s)", directory, e)
        return None
    try:
        os.utime(os.path.join(directory, _RECIPE))  # used: the last to be evicted
    except OSError:
        pass
    logger.info("model weights from the cache (%s)", directory)
    return model.eval().requires_grad_(False)


def save(cfg: ModelConfig, method: QuantizationMethod | None, model: nn.Module,
         model_cls: type, dtype: torch.dtype, device: torch.device) -> None:
    """Save a freshly loaded and processed model for later loads (best effort)."""
    if method is None:
        return
    recipe = method.snapshot_recipe(model)
    directory = entry_dir(cfg, method, model_cls, dtype, device) if recipe is not None else None
    if directory is None:
        return
    tensors, aliases = _unique_tensors(model.state_dict())

    def fill(staging: str) -> None:
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(staging, _TENSORS))
        with open(os.path.join(staging, _RECIPE), "w") as f:  # last: the entry is complete
            json.dump({"method": recipe, "aliases": aliases,
                       "checkpoint": os.path.realpath(cfg.path)}, f)

    if write_entry(directory, fill, "quantized model cache"):
        evict(os.path.dirname(directory), keep=directory)


def evict(parent: str, keep: str, max_bytes: int | None = None) -> None:
    """Remove the least recently used entries under ``parent`` (not ``keep``) until all of
    them together take at most ``max_bytes`` (MAX_BYTES)."""
    limit = MAX_BYTES if max_bytes is None else max_bytes
    entries = []
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        try:
            used = os.stat(os.path.join(path, _RECIPE)).st_mtime
            size = sum(os.stat(os.path.join(path, f)).st_size for f in os.listdir(path))
        except OSError:  # a staging directory being written, or one half removed
            continue
        entries.append((used, size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
            total -= size


def _unique_tensors(state: dict[str, torch.Tensor],
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state's tensors once each (safetensors refuses two names for one memory), and the
    names that are another's view of the same values."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        identity = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                    tuple(t.stride()), t.dtype)
        if t.numel() and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen.setdefault(identity, name)
        tensors[name] = t.detach().contiguous()
    return tensors, aliases
