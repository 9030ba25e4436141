"""Sampler: turns one step's logits [B, V] into sampled token ids (and logprobs), vLLM v1-style.

Order, as in vLLM v1: raw logprobs (log_softmax of the model's logits) -> the logits processors
that may change the argmax (allowed_token_ids, bad_words, min_tokens, logit_bias, then those a
request names) -> penalties (repetition, frequency, presence) -> greedy rows take the argmax;
random rows divide by temperature, then the argmax-invariant processors (min-p, ...), top-k,
top-p, then sample with the exponential race (argmax of probs / Exp(1) noise), which needs no
device->host sync. Seeded rows draw their noise from their
own generator so their tokens do not depend on the batch they sit in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember import kernels
from ember.kernels import dispatch
from ember.layers.sampling_metadata import GREEDY_EPS, SamplingMetadata, pad_token_ids
from ember.structured_output.bitmask import apply_token_bitmask_

# Up to this many rows the chunked argmax kernel beats torch's one-block-per-row reduction, which
# leaves most SMs idle when there are few rows.
GREEDY_KERNEL_MAX_ROWS = 16


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token ids of [rows, vocab] logits: ember's chunked kernel (ember.kernels.argmax)
    for a few rows on CUDA, torch's argmax otherwise."""
    if (logits.dim() == 2 and logits.shape[0] <= GREEDY_KERNEL_MAX_ROWS
            and logits.stride(-1) == 1 and dispatch.on_gpu(logits)
            and dispatch.layer_kernels_enabled()):
        return kernels.argmax.argmax_rows(logits)
    return logits.argmax(dim=-1)


@dataclass
class LogprobsTensors:
    """Per row: the chosen token then the top-k tokens, their logprobs, the chosen token's rank."""

    logprob_token_ids: torch.Tensor  # [N, k+1] int64; column 0 is the sampled/target token
    logprobs: torch.Tensor  # [N, k+1] float32
    selected_token_ranks: torch.Tensor  # [N] int64; 1 + #tokens with a strictly greater logprob

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return (
            self.logprob_token_ids.tolist(),
            self.logprobs.tolist(),
            self.selected_token_ranks.tolist(),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None unless some row asked for logprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Pick `token_ids`' logprobs and ranks plus each row's top-k from full logprobs [N, V]."""
    token_ids = token_ids.long().unsqueeze(-1)
    chosen = logprobs.gather(-1, token_ids)
    ranks = (logprobs > chosen).sum(-1) + 1
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=-1)
        vals = torch.cat([chosen, top_vals], dim=-1)
    else:
        ids, vals = token_ids, chosen
    return LogprobsTensors(ids, vals, ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, k: int
) -> LogprobsTensors:
    """prompt_logprobs: logits [P, V] at prompt positions, target_ids [P] the next tokens."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, k)


def _token_counts(padded: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # The pad id is vocab_size: it lands in an extra column that is dropped.
    counts = torch.zeros(padded.shape[0], vocab_size + 1, dtype=torch.int32, device=padded.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties, out of place: repetition (prompt or output), then frequency, presence."""
    if md.no_penalties:
        return logits
    num_rows, vocab = logits.shape
    out_ids = md.output_ids_padded
    if out_ids is None:
        out_ids = pad_token_ids(md.output_token_ids, vocab, logits.device)
    out_counts = _token_counts(out_ids, vocab)
    out_mask = out_counts > 0
    if md.repetition_penalty is not None:
        prompt_ids = md.prompt_ids_padded
        if prompt_ids is None:
            prompt_ids = pad_token_ids(md.prompt_token_ids, vocab, logits.device)
        seen = out_mask | (_token_counts(prompt_ids, vocab) > 0)
        rep = md.repetition_penalty.unsqueeze(1).expand(num_rows, vocab)
        penalty = torch.where(seen, rep, torch.ones_like(rep))
        # CTRL: shrink positive logits, push negative ones further down.
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty.unsqueeze(1) * out_counts
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty.unsqueeze(1) * out_mask
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int = 0
) -> torch.Tensor:
    """Mask to -inf what top-k (ties with the k-th value kept) and top-p (smallest set whose
    probability reaches top_p, at least one token) exclude. Rows with k = V / p = 1 are unchanged.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    if top_p is None and 0 < max_top_k < vocab:
        # top-k only: a topk() of the largest k is much cheaper than sorting the vocabulary.
        top_vals = logits.topk(max_top_k, dim=-1).values
        kth = top_vals.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k >= vocab).unsqueeze(1), float("-inf"))
        return logits.masked_fill_(logits < kth, float("-inf"))

    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        # Ascending cumsum: a token goes when all tokens at or below it sum to <= 1 - p, i.e.
        # the tokens above it already reach p. Unlike a descending test this keeps every token
        # when p == 1 even with float rounding.
        cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)


def exponential_noise(
    like: torch.Tensor, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """Exp(1) noise shaped like `like`; seeded rows draw from their own generator."""
    noise = torch.empty_like(like).exponential_()
    for row, gen in generators.items():
        if _same_device(gen.device, like.device):
            noise[row].exponential_(generator=gen)
        else:
            # The generator lives elsewhere (e.g. a CPU generator for a CUDA batch): draw where
            # it lives so its stream is the same whatever device the batch is on.
            row_noise = torch.empty(like.shape[-1], dtype=like.dtype, device=gen.device)
            row_noise.exponential_(generator=gen)
            if row_noise.device.type == "cpu" and like.device.type == "cuda":
                row_noise = row_noise.pin_memory()
            noise[row].copy_(row_noise, non_blocking=True)
    return noise


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    idx_a = a.index if a.index is not None else torch.cuda.current_device()
    idx_b = b.index if b.index is not None else torch.cuda.current_device()
    return idx_a == idx_b


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample each row of `probs` by the exponential race: argmax(p_i / E_i) has law p."""
    noise = exponential_noise(probs, generators)
    # exponential_ can return exactly 0; 0/0 would be NaN, which argmax would pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


class Sampler(nn.Module):
    """Batched sampler: one call per step over the B rows being sampled."""

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        if md.grammar_bitmask is not None:
            # Structured outputs first (as vLLM): logprobs and every later step see the mask.
            # In place: the caller's logits are made for sampling (a copy costs as much again).
            logits = apply_token_bitmask_(logits, md.grammar_bitmask, md.grammar_rows,
                                          md.grammar_row_list)
        # vLLM v1's default: logprobs describe the model's own distribution (raw logits).
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        before = md.processors.before_penalties
        if before:
            # Processors may work in place: the caller's logits are left untouched.
            logits = logits.clone()
            for processor in before:
                logits = processor.apply(logits)
        logits = apply_penalties(logits, md)  # out of place
        sampled = self.sample(logits, md)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = None
        if not md.all_random:
            greedy = logits.argmax(dim=-1)
            if md.all_greedy:
                return greedy
        temperature = md.temperature.unsqueeze(1)
        if not md.all_greedy and not md.all_random:
            # Greedy rows get a harmless 1.0 here; their random draw is discarded below.
            temperature = torch.where(temperature < GREEDY_EPS, 1.0, temperature)
        logits = logits / temperature  # new tensor: in-place steps below are safe
        for processor in md.processors.after_temperature:
            logits = processor.apply(logits)
        max_top_k = md.max_top_k
        if md.top_k is not None and max_top_k <= 0:
            max_top_k = logits.shape[-1]  # unknown on the host: take the sort path, no sync
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, max_top_k)
        probs = torch.softmax(logits, dim=-1)
        sampled = random_sample(probs, md.generators)
        if greedy is not None:
            sampled = torch.where(md.temperature < GREEDY_EPS, greedy, sampled)
        return sampled
