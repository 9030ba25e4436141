"""Physical limits of a workload on a device: bytes moved and FLOPs over measured ceilings.

Decode is memory-bound: each step reads every weight once plus the KV cache of every running
request. Prefill is compute-bound: 2 x params FLOPs per prompt token. The lower bound on time is
the sum over steps of max(bytes / bandwidth, flops / matmul rate).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelShape:
    num_params: int  # all weights (embedding counted once when tied)
    matmul_params: int  # weights touched per token (excludes the embedding gather)
    kv_bytes_per_token: int
    dtype_bytes: int = 2

    @classmethod
    def from_hf_config(cls, cfg, dtype_bytes: int = 2) -> ModelShape:
        h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        head = getattr(cfg, "head_dim", None) or h // heads
        inter = cfg.intermediate_size
        per_layer = h * head * (heads + 2 * kv_heads) + heads * head * h + 3 * h * inter
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        embed = vocab * h
        num_params = layers * per_layer + embed * (1 if tied else 2)
        matmul = layers * per_layer + embed  # lm_head
        kv = 2 * layers * kv_heads * head * dtype_bytes
        return cls(num_params, matmul, kv, dtype_bytes)


def throughput_limit(shape: ModelShape, prompt_lens, output_lens, bandwidth: float,
                     flops: float, max_batch: int = 10**9) -> dict:
    """Best-case output tok/s for an offline batch (all requests start together)."""
    active = sorted(zip(output_lens, prompt_lens, strict=True))
    prefill_flops = 2 * shape.matmul_params * sum(prompt_lens)
    total = prefill_flops / flops
    step = 0
    weight_bytes = shape.num_params * shape.dtype_bytes
    remaining = [(o, p) for o, p in active]
    while remaining:
        batch = remaining[:max_batch]
        kv = sum((p + step) * shape.kv_bytes_per_token for _, p in batch)
        t_mem = (weight_bytes + kv) / bandwidth
        t_flop = 2 * shape.matmul_params * len(batch) / flops
        total += max(t_mem, t_flop)
        step += 1
        remaining = [(o, p) for o, p in remaining if o > step]
    return {"limit_output_tok_s": sum(output_lens) / total, "limit_seconds": total}


def decode_latency_limit(shape: ModelShape, prompt_len: int, new_tokens: int,
                         bandwidth: float) -> float:
    """Best-case batch-1 decode tok/s: weights plus the KV so far, read once per token."""
    weight_bytes = shape.num_params * shape.dtype_bytes
    avg_ctx = prompt_len + new_tokens / 2
    return bandwidth / (weight_bytes + avg_ctx * shape.kv_bytes_per_token)
