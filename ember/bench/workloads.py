"""Synthetic workloads: random token-id prompts with fixed or uniformly drawn lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_workload(
    num_requests: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """nano-vllm's recipe: lengths uniform in [lo, hi], token ids uniform in [0, min(vocab, 10000))."""
    rng = random.Random(seed)
    high = min(vocab_size, 10000) - 1
    prompts = [
        [rng.randint(0, high) for _ in range(rng.randint(*input_len))] for _ in range(num_requests)
    ]
    outputs = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompts, outputs)
