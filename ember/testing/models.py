"""Conformance check of a model against its transformers implementation, on a tiny random model.

The kit builds the HF model from a (tiny) config with random weights, saves it with
save_pretrained (safetensors), loads the directory with ember's loader into the model class under
test, and runs it the way the engine does: paged KV caches, every prompt in one flat prefill
batch, then batched decode steps. It compares ember's logits at every position with HF's (float32
by default, the design's reference) and checks that ember's greedy choice equals HF's greedy token
at each generated position (teacher forcing, so one early difference cannot cascade); a position
where HF's top two logits are closer than `tie_margin` is not held against the model.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from ember.testing.attention import _Allocator, build_step_metadata

_TOL = {"float32": 1e-4, "float16": 5e-2, "bfloat16": 1e-1}


def _hf_model(arch: str, hf_config: Any, seed: int):
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, arch, None)
    if cls is None:
        return transformers.AutoModelForCausalLM.from_config(hf_config)
    return cls(hf_config)


def _hf_reference(model, prompts: list[list[int]], max_new_tokens: int):
    """Greedy continuations and the logits at every position of prompt + continuation."""
    sequences, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(max_new_tokens):
                out = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(out.argmax()))
            sequences.append(seq)
            logits.append(model(torch.tensor([seq])).logits[0].float())
    return sequences, logits


@torch.inference_mode()  # as the engine's model runner runs models
def run_ember_logits(model, backend, sequences: list[list[int]], prompt_lens: list[int],
                     device: torch.device, dtype: torch.dtype, block_size: int = 16):
    """Logits at every position, run as the engine does: one prefill batch, then decodes."""
    from ember.layers.attention import ForwardContext

    longest = max(len(s) for s in sequences)
    num_blocks = 2 + len(sequences) * (-(-longest // block_size))
    caches = [torch.zeros(backend.kv_cache_shape(num_blocks, block_size, model.num_kv_heads,
                                                 model.head_size), dtype=dtype, device=device)
              for _ in range(model.num_layers)]
    alloc = _Allocator(block_size)
    for i in range(len(sequences)):
        alloc.start(i, None)
    results: list[list[torch.Tensor]] = [[] for _ in sequences]
    done = [0] * len(sequences)
    step = [(i, n) for i, n in enumerate(prompt_lens)]
    while step:
        md, order = build_step_metadata(alloc, step, device, None)
        md = backend.build_metadata(md)
        ids, pos = [], []
        for i, n in order:
            ids += sequences[i][done[i]: done[i] + n]
            pos += list(range(done[i], done[i] + n))
        hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                       ForwardContext(attn_metadata=md, kv_caches=caches))
        logits = model.compute_logits(hidden).float().cpu()
        row = 0
        for i, n in order:
            results[i].append(logits[row: row + n])
            row += n
            done[i] += n
        step = [(i, 1) for i, s in enumerate(sequences) if done[i] < len(s)]
    return [torch.cat(r) for r in results]


def check_model_against_transformers(
    arch_or_cls: str | type,
    hf_config: Any,
    *,
    dtype: str = "float32",
    attention_backend: str | type = "sdpa",
    device: str = "cpu",
    prompts: list[list[int]] | None = None,
    max_new_tokens: int = 8,
    seed: int = 0,
    atol: float | None = None,
    tie_margin: float = 1e-4,
    model_dir: str | None = None,
) -> list[str]:
    """Check an ember model against transformers on a random model built from `hf_config`.

    arch_or_cls: a registered architecture name, or the model class itself. hf_config: a
    transformers config (e.g. GemmaConfig(...) with a few tiny layers), or a dict of its fields
    with "model_type". Raises AssertionError naming the prompt and position that differ.
    """
    from ember.models.loader import load_model
    from ember.registry import AttentionBackendRegistry, ModelRegistry

    if isinstance(hf_config, dict):
        from transformers import AutoConfig

        fields = dict(hf_config)
        hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    arch = arch_or_cls if isinstance(arch_or_cls, str) else (
        (getattr(hf_config, "architectures", None) or [arch_or_cls.__name__])[0])
    hf_config.architectures = [arch]
    model_cls = ModelRegistry.resolve(arch) if isinstance(arch_or_cls, str) else arch_or_cls
    backend = (AttentionBackendRegistry.resolve(attention_backend)
               if isinstance(attention_backend, str) else attention_backend)
    hf = _hf_model(arch, hf_config, seed).float().eval()
    gen = torch.Generator().manual_seed(seed)
    vocab = int(hf_config.vocab_size)
    if prompts is None:
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 19, 1)]
    sequences, ref = _hf_reference(hf, prompts, max_new_tokens)

    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir or os.path.join(tmp, "model")
        hf.save_pretrained(path, safe_serialization=True)
        torch_dtype = getattr(torch, dtype)
        model = load_model(path, model_cls, backend, torch_dtype, device)
        got = run_ember_logits(model, backend, sequences, [len(p) for p in prompts],
                               torch.device(device), torch_dtype)

    tol = atol if atol is not None else _TOL[dtype]
    lines = []
    for i, (prompt, seq, g, w) in enumerate(zip(prompts, sequences, got, ref, strict=True)):
        err = (g - w).abs().max().item()
        if err > tol:
            where = int((g - w).abs().amax(-1).argmax())
            raise AssertionError(f"{arch}: logits of prompt {i} differ from transformers by "
                                 f"{err:.3g} (> {tol}), first worst at position {where}")
        for p in range(len(prompt) - 1, len(seq) - 1):
            top2 = w[p].topk(2).values
            if int(g[p].argmax()) != seq[p + 1] and float(top2[0] - top2[1]) > tie_margin:
                raise AssertionError(f"{arch}: greedy token at position {p} of prompt {i} is "
                                     f"{int(g[p].argmax())}, transformers chose {seq[p + 1]}")
        lines.append(f"ok  prompt {i} ({len(prompt)} tokens + {max_new_tokens} greedy): "
                     f"max logit error {err:.3g}")
    return lines
