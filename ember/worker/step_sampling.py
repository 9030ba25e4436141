"""Sampling a step's logits rows into its InFlightStep: the greedy fast paths (a plain argmax,
under a grammar's bitmask on the device or the host) and the full sampler otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember.kernels import dispatch
from ember.layers.sampler import Sampler, greedy_argmax

if TYPE_CHECKING:
    from ember.core.scheduler_output import GrammarBitmask
    from ember.logits_processors.pipeline import LogitsProcessorSet
    from ember.worker.grammar_mask import GrammarMasks
    from ember.worker.in_flight import InFlightStep
    from ember.worker.input_batch import CachedRequestState


def uses_penalties(params) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def plain_greedy(params, num_output: int, processors: LogitsProcessorSet) -> bool:
    return (
        params.temperature == 0.0
        and params.logprobs is None
        and not uses_penalties(params)
        and not processors.affects_greedy(params, num_output)
    )


def sample_rows(rows: list[CachedRequestState], logits: torch.Tensor, step: InFlightStep,
                previous: InFlightStep | None, grammar: GrammarBitmask | None, *,
                sampler: Sampler, processors: LogitsProcessorSet, grammar_masks: GrammarMasks,
                device: torch.device, any_special: bool) -> None:
    """Sample ``rows`` (their logits in order) and attach the tokens to ``step``, under
    ``grammar``'s bitmask where one is given. ``any_special``: some running request samples
    with more than an argmax (else the rows are not checked one by one)."""
    from ember.layers.sampling_metadata import build_sampling_metadata

    # A reserved step's own placeholders are in its rows' outputs already (InFlightStep.
    # reserve): the sampling sees the outputs before them.
    own = 1 if step.reserved else 0
    if not any_special or all(
        plain_greedy(s.sampling_params, len(s.output_token_ids) - own, processors) for s in rows
    ):
        # Nothing to build: no penalties or logprobs, just the argmax (of the masked logits
        # under a grammar: the sampler would mask them alike, in place, then take it; on a
        # GPU one kernel reads the bitmask and the logits as they are).
        if grammar is not None and dispatch.on_gpu(logits) and dispatch.layer_kernels_enabled():
            step.attach_samples(rows, grammar_masks.masked_argmax(logits, rows, grammar), None)
            return
        if grammar is not None and logits.device.type == "cpu":
            step.attach_samples(
                rows, grammar_masks.masked_greedy_on_host(logits, rows, grammar), None)
            return
        if grammar is not None:
            logits = grammar_masks.masked_logits(logits, rows, grammar)
        step.attach_samples(rows, greedy_argmax(logits), None)
        return
    if previous is not None and any(
        s.pending is not None and (
            uses_penalties(s.sampling_params)
            or processors.needs_output_tokens(s.sampling_params, len(s.output_token_ids) - own))
        for s in rows
    ):
        # Penalties and some processors (bad_words) read earlier tokens on the host: wait for
        # the step in flight.
        previous.resolve()
    metadata = build_sampling_metadata(
        [s.sampling_params for s in rows],
        [s.output_token_ids[:-1] if own else s.output_token_ids for s in rows],
        [s.prompt_token_ids for s in rows],
        {i: s.generator for i, s in enumerate(rows) if s.generator is not None},
        logits.shape[-1],
        device,
        processors,
        [s.req_id for s in rows],
    )
    if grammar is not None:
        mask = grammar_masks.for_sampler(rows, grammar)
        if mask is not None:
            metadata.grammar_bitmask, metadata.grammar_rows, metadata.grammar_row_list = mask
    sampled = sampler(logits, metadata)
    step.attach_samples(rows, sampled.sampled_token_ids, sampled.logprobs)
