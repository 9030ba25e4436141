"""HF transformers as the reference: greedy generation with top-5 logprobs, and vLLM's rule for
accepting a divergence that comes from a float32 near-tie."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GreedyRun:
    token_ids: list[int]
    top5: list[dict[int, float]]  # per generated position: token id -> logprob


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> GreedyRun:
    """Plain greedy decoding with HF's model, one prompt at a time (no padding effects)."""
    import inspect

    device = next(model.parameters()).device
    # transformers renamed past_key_values to cache (5.2x); accept either version.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([prompt_ids], device=device)
    past = None
    out: list[int] = []
    top5: list[dict[int, float]] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            result = model(input_ids=ids, use_cache=True, **{cache_arg: past})
            past = getattr(result, "cache", None) or result.past_key_values
            logprobs = torch.log_softmax(result.logits[0, -1].float(), dim=-1)
            values, indices = logprobs.topk(5)
            top5.append(dict(zip(indices.tolist(), values.tolist())))
            token = int(logprobs.argmax())
            out.append(token)
            if token in eos_ids:
                break
            ids = torch.tensor([[token]], device=device)
    return GreedyRun(out, top5)


def ember_top5(completion) -> list[dict[int, float]]:
    return [{tok: lp.logprob for tok, lp in pos.items()} for pos in completion.logprobs]


def check_greedy_match(
    ref: GreedyRun, ours_ids: list[int], ours_top5: list[dict[int, float]], label: str
) -> str | None:
    """Assert equal greedy ids; a divergence passes only under vLLM's near-tie rule.

    At the first differing position each side's token must be in the other side's top-5
    logprobs (then the two continuations are not comparable any more). Returns a note describing
    an accepted divergence, or None for an exact match."""
    for i, (a, b) in enumerate(zip(ref.token_ids, ours_ids)):
        if a == b:
            continue
        assert b in ref.top5[i] and a in ours_top5[i], (
            f"{label}: position {i}: HF chose {a}, ember chose {b}; not a near-tie "
            f"(HF top5 {ref.top5[i]}, ember top5 {ours_top5[i]})"
        )
        return (
            f"{label}: near-tie divergence at position {i} "
            f"(HF {a}: {ref.top5[i][a]:.6f} vs {b}: {ref.top5[i][b]:.6f})"
        )
    n = min(len(ref.token_ids), len(ours_ids))
    assert ref.token_ids[:n] == ours_ids[:n]
    assert len(ref.token_ids) == len(ours_ids), (
        f"{label}: lengths differ: HF {len(ref.token_ids)}, ember {len(ours_ids)}"
    )
    return None
