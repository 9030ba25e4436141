"""Tiny random mixture-of-experts checkpoints (Qwen3-MoE, Mixtral) with more experts than
active ones, for the MoE tests: every parameter random (norm weights too, so loading mistakes
show), the router wide enough that tokens spread over the experts."""

from __future__ import annotations

from pathlib import Path

import torch

MOE_ARCHS = ("qwen3_moe", "mixtral")

_COMMON = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)  # fmt: skip


def make_moe_config(arch: str, **overrides):
    import transformers

    kw = dict(_COMMON)
    if arch == "qwen3_moe":
        # Layer 1 dense (mlp_only_layers): both kinds of feed-forward in one model.
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1],
                  decoder_sparse_step=1)
        cls = transformers.Qwen3MoeConfig
    elif arch == "mixtral":
        kw.update(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48)
        cls = transformers.MixtralConfig
    else:
        raise ValueError(f"unknown arch {arch!r}; valid: {MOE_ARCHS}")
    kw.update(overrides)
    return cls(**kw)


def make_moe_hf_model(arch: str, seed: int = 0, **overrides):
    """A float32 HF model running its eager experts loop, every parameter random."""
    import transformers

    torch.manual_seed(seed)
    # "eager": the loop over experts written in the modeling file, which ember's torch path
    # follows op for op (transformers 5 defaults to a grouped-mm path that rounds differently
    # in bf16).
    model = transformers.AutoModelForCausalLM.from_config(make_moe_config(arch, **overrides),
                                                          dtype=torch.float32)
    use_eager_experts(model)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith("gate.weight"):  # the router: distinct, spread-out choices
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def use_eager_experts(model) -> None:
    """Run the model's eager experts loop. Its experts read the choice from the config at each
    call (transformers 5.x); versions without the choice only have the loop."""
    model.config._experts_implementation = "eager"


def make_moe_model(arch: str, tmp_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random MoE model (per-expert safetensors names, as HF saves); its path."""
    path = Path(tmp_dir) / f"tiny-{arch}"
    make_moe_hf_model(arch, seed, **overrides).save_pretrained(path, safe_serialization=True)
    return path
