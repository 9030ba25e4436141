"""Tiny random Gemma 2, Gemma 3 and Phi-3 checkpoints for the model tests (the Llama family's are
in model_factory.py). Each config exercises what the architecture adds: soft-capping, alternating
sliding-window (8 tokens) and global layers, query_pre_attn_scalar != head_dim, Gemma 3's
per-layer-type rope bases with linear scaling on the global layers, Phi-3's LongRoPE with an
original context of 32 tokens.

The HF reference runs with attn_implementation="eager": it is the implementation that applies
Gemma 2's attention soft-cap.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("gemma2", "gemma3", "gemma3_mm", "phi3", "phi3_longrope")
LONGROPE_ORIGINAL = 32

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256,
    rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


def make_config(arch: str, **overrides):
    import transformers

    if arch == "gemma3_mm":  # Gemma3ForConditionalGeneration: gemma3's text + a tiny vision tower
        text = make_config("gemma3", **overrides).to_dict()
        config = transformers.Gemma3Config(
            text_config=text, mm_tokens_per_image=4, image_token_index=300, boi_token_index=301,
            eoi_token_index=302, vision_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=32, patch_size=8))
        config._attn_implementation = "eager"
        config.get_text_config()._attn_implementation = "eager"
        return config
    kw = dict(_COMMON)
    if arch == "gemma2":
        kw.update(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                  final_logit_softcapping=5.0)
        cls = transformers.Gemma2Config
    elif arch == "gemma3":
        kw.update(sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=None,
                  layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters={
                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                      "full_attention": {"rope_type": "linear", "factor": 2.0,
                                         "rope_theta": 1_000_000.0}})  # fmt: skip
        cls = transformers.Gemma3TextConfig
    elif arch in ("phi3", "phi3_longrope"):
        kw.pop("head_dim")
        kw.update(tie_word_embeddings=False, partial_rotary_factor=0.5)  # rotary dim 8
        if arch == "phi3_longrope":
            kw.update(original_max_position_embeddings=LONGROPE_ORIGINAL, rope_scaling={
                "type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(4)],
                "long_factor": [2.0 + 1.5 * i for i in range(4)]})  # fmt: skip
        cls = transformers.Phi3Config
    else:
        raise ValueError(f"unknown arch {arch!r}; valid: {ARCHS}")
    kw.update(overrides)
    config = cls(**kw)
    config._attn_implementation = "eager"
    return config


def make_hf_model(arch: str, seed: int = 0, **overrides):
    """A float32 HF model with every parameter random (Gemma's norm weights are offsets from
    1, initialised to zero by HF: random here, so a (1 + w) mistake shows)."""
    import transformers

    torch.manual_seed(seed)
    config = make_config(arch, **overrides)
    if arch == "gemma3_mm":
        model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty_like(p).uniform_(-0.5, 0.5, generator=gen)
                        + (0.0 if arch.startswith("gemma") else 1.0))
    return model.eval()


def make_model(arch: str, tmp_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random HF model of ``arch`` (safetensors) under tmp_dir; returns its path."""
    path = Path(tmp_dir) / f"tiny-{arch}"
    make_hf_model(arch, seed, **overrides).save_pretrained(path, safe_serialization=True)
    return path
