"""GGUF checkpoints: parse the header, build the model config from its metadata, and yield its tensors
in HF layout, one at a time: dequantized to float32, or (inside ``keep_quantized()``, which the
``gguf`` quantization method opens while the model loads) the quantized weights of the decoder's
linear layers as their raw blocks (uint8 [rows, row bytes], tagged with ``gguf_qtype``).

The header parser is ours rather than ``gguf.GGUFReader`` because that reader builds a numpy view
per token string (~5-10 s for a 49k-token vocabulary here, against ~0.2 s for this one) and fails on
damaged files with obscure numpy errors; every damage we can detect is a ``ValueError`` naming the
file. Dequantization is ember's torch block decoder (ember.quantization.gguf_blocks) for the types
it knows and ``gguf.quants.dequantize`` for the rest; the two are bit-identical (tested), so the
numbers are what transformers produces from the same file.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ember.models.loader.gguf_config import GGUFModelConfig

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long gone
_MAX_DIMS = 4  # GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# GGUF metadata value types -> (struct format, numpy dtype)
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}  # fmt: skip


class _Corrupt(Exception):
    """Internal: raised while parsing, turned into a ValueError naming the file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: ggml lists dimensions fastest-moving first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]  # in file order

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(
                f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes)"
            )

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} is not valid UTF-8") from e

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: string()'s checks in one loop (a vocabulary holds ~10^5
        of them; calling string() per entry was most of the header's parse time)."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        length = _U64.unpack_from
        try:
            for _ in range(count):
                if pos + 8 > size:
                    raise _Corrupt(f"{what} at byte {pos} runs past the end of the file ({size} "
                                   "bytes)")
                (n,) = length(buf, pos)
                pos += 8
                if pos + n > size:
                    raise _Corrupt(f"{what} at byte {pos} runs past the end of the file ({size} "
                                   "bytes)")
                out.append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as e:
            raise _Corrupt(f"{what} is not valid UTF-8") from e
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], what)
        if vtype != _ARRAY:
            raise _Corrupt(f"{what} has unknown value type {vtype}")
        itype, count = self.scalar("<I", what), self.scalar("<Q", what)
        if itype == _STRING:
            self.need(count * 8, what)  # each string takes at least its 8-byte length
            return self.strings(count, what)
        if itype not in _SCALARS:
            raise _Corrupt(f"{what} is an array of unknown type {itype}")
        dtype = np.dtype(_SCALARS[itype][1])
        self.need(count * dtype.itemsize, what)
        # Copy out of the mmap (slicing gives bytes) so nothing keeps the mapping alive.
        arr = np.frombuffer(self.buf[self.pos : self.pos + count * dtype.itemsize], dtype=dtype)
        self.pos += count * dtype.itemsize
        return arr


def _parse(buf: mmap.mmap, size: int, path: str) -> GGUFHeader:
    cur = _Cursor(buf, size)
    cur.need(24, "the file header")
    if buf[:4] != _MAGIC:
        raise _Corrupt(f"bad magic bytes {bytes(buf[:4])!r}, not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I", "version")
    if version not in _VERSIONS:
        endian = (
            " (a big-endian file?)"
            if int.from_bytes(version.to_bytes(4, "little"), "big") in _VERSIONS
            else ""
        )
        raise _Corrupt(f"unsupported GGUF version {version}{endian}; this reader handles v2 and v3")
    n_tensors, n_kv = cur.scalar("<Q", "tensor count"), cur.scalar("<Q", "metadata count")
    # Each entry takes well over 8 bytes: absurd counts mean garbage, not a huge model.
    if n_tensors * 8 > size or n_kv * 8 > size:
        raise _Corrupt(f"impossible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        metadata[key] = cur.value(cur.scalar("<I", f"the type of {key!r}"), f"metadata {key!r}")

    infos = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name")
        n_dims = cur.scalar("<I", f"tensor {name!r}")
        if not 0 < n_dims <= _MAX_DIMS:
            raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims)]
        raw_type, rel_offset = cur.scalar("<I", f"tensor {name!r}"), cur.scalar("<Q", name)
        infos.append((name, dims, raw_type, rel_offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, dims, raw_type, rel_offset in infos:
        if name in tensors:
            raise _Corrupt(f"tensor {name!r} appears twice")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as e:
            raise _Corrupt(f"tensor {name!r} has unknown type {raw_type}") from e
        if dims[0] % block_size:
            raise _Corrupt(f"tensor {name!r}: row of {dims[0]} is not whole {qtype.name} blocks")
        nbytes = int(np.prod(dims, dtype=object)) // block_size * type_size
        start = data_start + rel_offset
        if start + nbytes > size:
            raise _Corrupt(
                f"tensor {name!r} needs bytes {start}..{start + nbytes} but the file has {size}"
            )
        tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)
    return GGUFHeader(path, version, metadata, tensors)


def _corrupt_error(path: str, detail: str) -> ValueError:
    return ValueError(f"GGUF file {path!r} is corrupt or truncated: {detail}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse and validate metadata and the tensor table (no tensor data is read).

    Cached per (path, size, mtime): the config, the weights and the tokenizer all start here."""
    path = os.fspath(path)
    st = os.stat(path)  # FileNotFoundError is already clear
    return _read_header_cached(os.path.realpath(path), st.st_size, st.st_mtime_ns, path)


@functools.lru_cache(maxsize=4)
def _read_header_cached(real: str, size: int, _mtime: int, path: str) -> GGUFHeader:
    if size < 24:
        raise _corrupt_error(path, f"only {size} bytes, smaller than a GGUF header")
    with open(real, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(buf, size, path)
        except _Corrupt as e:
            raise _corrupt_error(path, str(e)) from None
        except (struct.error, OverflowError, MemoryError) as e:  # belt and braces
            raise _corrupt_error(path, f"{type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Config

# GGUF architecture -> (HF model_type, HF architecture class, metadata key holding head_dim)
_ARCHS: dict[str, tuple[str, str, str | None]] = {
    "llama": ("llama", "LlamaForCausalLM", "rope.dimension_count"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", None),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "attention.key_length"),
}
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = ("bos", "eos", "padding", "unknown")


def hf_model_type(gguf_architecture: str) -> str | None:
    """The HF model_type ember maps a GGUF architecture to, or None if it has no mapping."""
    spec = _ARCHS.get(gguf_architecture)
    return spec[0] if spec else None


def gguf_hf_config(path: str) -> PretrainedConfig:
    """The transformers config described by the GGUF metadata (what transformers builds too)."""
    return gguf_model_config(path).to_transformers()


def gguf_model_config(path: str) -> GGUFModelConfig:
    """The config the engine runs a GGUF file with: gguf_hf_config's values without importing
    transformers' config classes (ember.models.loader.gguf_config)."""
    header = read_gguf_header(path)
    arch, meta = header.architecture, header.metadata
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF file {path!r} has architecture {arch!r}, which ember cannot load "
            f"(supported: {', '.join(sorted(_ARCHS))})"
        )
    model_type, hf_arch, head_dim_key = _ARCHS[arch]
    kwargs: dict[str, Any] = {"architectures": [hf_arch]}
    for gguf_key, hf_key in _CONFIG_KEYS.items():
        if f"{arch}.{gguf_key}" in meta:
            kwargs[hf_key] = meta[f"{arch}.{gguf_key}"]
    if head_dim_key and f"{arch}.{head_dim_key}" in meta:
        kwargs["head_dim"] = meta[f"{arch}.{head_dim_key}"]
    if "vocab_size" not in kwargs and "tokenizer.ggml.tokens" in meta:
        kwargs["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    for name in _TOKEN_IDS:
        if f"tokenizer.ggml.{name}_token_id" in meta:
            hf_name = {"padding": "pad", "unknown": "unk"}.get(name, name)
            kwargs[f"{hf_name}_token_id"] = meta[f"tokenizer.ggml.{name}_token_id"]
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in header.tensors:
        # transformers ignores these too; short contexts are unaffected.
        logger.warning(
            "GGUF file %s: its rope scaling (%s) is not applied; outputs past the original "
            "context length may differ from llama.cpp's",
            path,
            "rope_freqs tensor" if scaling == "none" else scaling,
        )
    # llama.cpp drops output.weight when the head shares the embedding matrix.
    kwargs["tie_word_embeddings"] = "output.weight" not in header.tensors
    missing = [
        k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in kwargs
    ]
    if missing:
        raise ValueError(f"GGUF file {path!r} lacks metadata for {missing} ({arch}.* keys)")
    return GGUFModelConfig(model_type, **kwargs)


# ---------------------------------------------------------------------------------------------
# Weights

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_param_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors HF models have no slot for."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute_rope(w: np.ndarray, n_head: int, path: str, name: str) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF's rotary embedding pairs dimension i with i + d/2 inside each head; llama.cpp's converter
    reorders each head's rows so the pairs sit side by side (its rope is GPT-J style). Putting
    the rows back gives exactly the matrix HF loads, so HF's rotary code applies unchanged."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(
            f"GGUF file {path!r}: {name} has {rows} rows, not a multiple of 2 x {n_head} heads"
        )
    # llama.cpp did reshape(n_head, 2, half, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF names of the decoder's linear weights: the ones the gguf method keeps quantized.
_LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
_FLOAT_QTYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_KEEP_QUANTIZED: list[bool] = []


@contextlib.contextmanager
def keep_quantized() -> Iterator[None]:
    """Within the block, ``iter_gguf_weights`` yields quantized linear weights as raw blocks."""
    _KEEP_QUANTIZED.append(True)
    try:
        yield
    finally:
        _KEEP_QUANTIZED.pop()


def _raw_blocks(path: str, f: Any, info: GGUFTensorInfo) -> np.ndarray:
    """uint8 [rows, row bytes]: the tensor's blocks as stored (rows stay whole blocks)."""
    f.seek(info.offset)
    raw = f.read(info.nbytes)
    if len(raw) != info.nbytes:  # the file shrank since the header was validated
        raise _corrupt_error(path, f"tensor {info.name!r} is cut short")
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    return np.frombuffer(raw, dtype=np.uint8).reshape(rows, -1)


def _dequantize(path: str, f: Any, info: GGUFTensorInfo) -> np.ndarray:
    import torch
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    from ember.quantization import gguf_blocks

    if info.qtype in gguf_blocks.SUPPORTED and info.qtype not in _FLOAT_QTYPES and (
            len(info.shape) == 2):
        # ember's torch decoder: bit-identical to the gguf package's (tests check every type)
        # and several times faster than its numpy (1.5 s for the default model's embedding).
        raw = torch.from_numpy(_raw_blocks(path, f, info).copy())
        return gguf_blocks.dequantize(raw, info.qtype, tuple(info.shape)).numpy()
    f.seek(info.offset)
    raw = f.read(info.nbytes)
    if len(raw) != info.nbytes:  # the file shrank since the header was validated
        raise _corrupt_error(path, f"tensor {info.name!r} is cut short")
    data = np.frombuffer(raw, dtype=np.uint8).reshape(
        quant_shape_to_byte_shape(info.shape, info.qtype)
    )
    try:
        out = dequantize(data, info.qtype)
    except NotImplementedError as e:
        raise NotImplementedError(
            f"GGUF file {path!r}: tensor {info.name!r} has type {info.qtype.name}, "
            "which the gguf package cannot dequantize"
        ) from e
    return out.reshape(info.shape).astype(np.float32, copy=False)


def iter_gguf_weights(
    path: str, config: PretrainedConfig, *, progress: bool | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor in HF layout) for every tensor, one at a time.

    Only one tensor is dequantized at a time, so peak memory is the largest tensor, not the model.
    Tensors with no HF parameter (e.g. llama.cpp's ``rope_freqs``) are skipped with a warning.
    `progress`: show a tqdm bar; None follows EMBER_DISABLE_PROGRESS. HF names for which `skip`
    is true are not dequantized (layers that hf_overrides cut off)."""
    import torch
    from tqdm.auto import tqdm

    from ember import envs

    if progress is None:
        progress = not envs.disable_progress_bars()
    header = read_gguf_header(path)
    permute = header.architecture == "llama"  # qwen GGUFs keep HF's (NeoX) rope layout
    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    skipped = []
    with open(path, "rb") as f:
        bar = tqdm(
            header.tensors.values(),
            desc="Loading GGUF tensors",
            unit="tensor",
            disable=not progress,
        )
        for info in bar:
            hf_name = hf_param_name(info.name)
            if hf_name is None:
                skipped.append(info.name)
                continue
            if skip is not None and skip(hf_name):
                continue
            raw = (bool(_KEEP_QUANTIZED) and info.qtype not in _FLOAT_QTYPES
                   and _LINEAR_WEIGHT.match(hf_name) is not None)
            w = _raw_blocks(path, f, info) if raw else _dequantize(path, f, info)
            if permute and ".attn_q." in info.name:
                w = _unpermute_rope(w, n_head, path, info.name)
            elif permute and ".attn_k." in info.name:
                w = _unpermute_rope(w, n_kv_head, path, info.name)
            if raw:
                tensor = torch.from_numpy(np.ascontiguousarray(w).copy())
                tensor.gguf_qtype = info.qtype  # type: ignore[attr-defined]
                tensor.gguf_shape = info.shape  # type: ignore[attr-defined]
                yield hf_name, tensor
                continue
            # F32/F16 come back as read-only views of the read buffer: copy only those.
            yield hf_name, torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    if skipped:
        logger.warning("GGUF file %s: skipped tensors with no HF parameter: %s", path, skipped)
