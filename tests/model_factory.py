"""Test helpers: tiny random HF checkpoints, and a minimal "model runner" that turns request
chunks into one flat step (input ids, positions, AttentionMetadata) over a paged KV cache.

    path = make_tiny_model("qwen3", tmp_path)
    model = load_model(path, Qwen3ForCausalLM, SdpaBackend, torch.float32)
    cache = PagedCache(model, num_blocks=64, block_size=4, seed=0)
    hidden = cache.step(model, [Chunk(req_id=0, tokens=[1, 2, 3])])
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.attention_backends.base import AttentionBackend, AttentionMetadata
from ember.attention_backends.sdpa import SdpaBackend
from ember.layers.attention import ForwardContext

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256,
    rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    pad_token_id=0,
)  # fmt: skip


def make_tiny_config(arch: str, **overrides):
    """A tiny GQA config of ``arch``; each arch exercises one of the family's variations."""
    import transformers

    kw = dict(_COMMON)
    if arch == "llama":
        # llama3 rope scaling with a short original context so all three bands are used.
        kw.update(tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})  # fmt: skip
        cls = transformers.LlamaConfig
    elif arch == "mistral":
        kw.update(tie_word_embeddings=False, sliding_window=None)
        cls = transformers.MistralConfig
    elif arch == "qwen2":
        kw.update(tie_word_embeddings=True)
        cls = transformers.Qwen2Config
    elif arch == "qwen3":
        kw.update(tie_word_embeddings=True, head_dim=32)  # head_dim != hidden / heads
        cls = transformers.Qwen3Config
    else:
        raise ValueError(f"unknown arch {arch!r}; valid: {ARCHS}")
    kw.update(overrides)
    return cls(**kw)


def make_tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A float32 HF model with every parameter random (norm weights and biases too, which HF
    initialises to ones and zeros and would hide loading mistakes)."""
    import transformers

    torch.manual_seed(seed)
    config = make_tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def make_tiny_model(arch: str, tmp_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random HF model of ``arch`` (safetensors) under tmp_dir; returns its path."""
    path = Path(tmp_dir) / f"tiny-{arch}"
    make_tiny_hf_model(arch, seed, **overrides).save_pretrained(path, safe_serialization=True)
    return path


@dataclass
class Chunk:
    """This step's tokens of one request; their positions continue the request's context."""

    req_id: int
    tokens: list[int]


class PagedCache:
    """KV caches for every layer plus per-request block tables, with blocks handed out in a
    shuffled order so that no request's blocks are contiguous."""

    def __init__(self, model, num_blocks: int, block_size: int, seed: int = 0,
                 backend: type[AttentionBackend] = SdpaBackend,
                 dtype: torch.dtype | None = None, junk: bool = True) -> None:  # fmt: skip
        self.block_size = block_size
        shape = backend.kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_size)
        gen = torch.Generator().manual_seed(seed)
        dtype = dtype or next(model.parameters()).dtype
        # Finite junk in unwritten slots: masking mistakes show up, but no NaN (the SDPA backend
        # reads whole blocks and relies on masks, like a zero-initialised real cache).
        self.kv_caches = [
            (torch.randn(shape, generator=gen) * 3 if junk else torch.zeros(shape)).to(dtype)
            for _ in range(model.num_layers)
        ]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def build(self, chunks: list[Chunk], pad_to: int | None = None):
        """(input_ids, positions, metadata) for one step; leading 1-token chunks of requests
        with context are the decodes. ``pad_to`` adds padding tokens (slot -1)."""
        bs = self.block_size
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        num_decodes = 0
        for c in chunks:
            start = self.lens.get(c.req_id, 0)
            if len(c.tokens) == 1 and start > 0 and num_decodes == len(seq_lens):
                num_decodes += 1
            end = start + len(c.tokens)
            blocks = self.blocks.setdefault(c.req_id, [])
            while len(blocks) * bs < end:
                blocks.append(self.free.pop())
            for p in range(start, end):
                slots.append(blocks[p // bs] * bs + p % bs)
            ids += c.tokens
            pos += range(start, end)
            qsl.append(qsl[-1] + len(c.tokens))
            seq_lens.append(end)
            self.lens[c.req_id] = end
        n = len(ids)
        pad = max(0, (pad_to or 0) - n)
        ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad
        width = max(len(self.blocks[c.req_id]) for c in chunks) + 1
        table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, c in enumerate(chunks):
            table[i, : len(self.blocks[c.req_id])] = torch.tensor(self.blocks[c.req_id])
        md = AttentionMetadata(
            num_actual_tokens=n,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=table,
            max_query_len=max(len(c.tokens) for c in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            num_decode_tokens=num_decodes,
        )
        return torch.tensor(ids), torch.tensor(pos), md

    def step(self, model, chunks: list[Chunk], pad_to: int | None = None) -> torch.Tensor:
        """Run one step; returns the final hidden states of the step's real tokens."""
        input_ids, positions, md = self.build(chunks, pad_to)
        md = model.model.layers[0].self_attn.attn.backend.build_metadata(md)
        with torch.no_grad():
            hidden = model(input_ids, positions, ForwardContext(md, self.kv_caches))
        return hidden[: md.num_actual_tokens]
