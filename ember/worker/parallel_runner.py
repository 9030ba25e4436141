"""ParallelModelRunner: the model runner of one rank when an engine spans several processes.

The model does its own tensor-parallel collectives (ember.layers.parallel_linear) and its own
pipeline send/recv between stages (ember.models.llama: a stage that is not the first receives
the hidden states and residual, one that is not the last sends them on). What the runner adds:

- only the last stage computes logits and samples (all its tensor-parallel ranks: the logits
  gather is a collective); earlier stages skip the LM head and prompt logprobs;
- the driver rank (tensor-parallel rank 0 of the last stage) broadcasts the sampled tokens to
  every rank before they are attached, so every rank keeps the same output tokens (the next
  step's inputs, and async scheduling's placeholders) whatever the sampler's randomness.
- with several batches in flight (`overlap_stages`), an earlier stage posts that broadcast
  without waiting and attaches the tokens when the step is resolved, so it can run batch k+1
  while the last stage still runs batch k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ember.distributed import parallel_state as ps
from ember.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from ember.core.scheduler_output import SchedulerOutput
    from ember.worker.in_flight import InFlightStep
    from ember.worker.input_batch import CachedRequestState, FlatBatch


class ParallelModelRunner(ModelRunner):
    # Set by RankWorker when several batches are in flight (pipeline parallel batch queue): an
    # earlier stage then receives the sampled tokens without waiting for them.
    overlap_stages = False
    # Batches this (earlier) stage started while the last stage had not yet sampled the batch
    # before: the stages ran at once (ember.bench.pipeline_overlap reports it).
    stage_overlaps = 0
    _last_broadcast = None

    def launch(self, out: SchedulerOutput,
               before_device: Callable[[], None] | None = None) -> InFlightStep:
        last = self._last_broadcast
        if last is not None and not last.is_completed():
            self.stage_overlaps += 1
        return super().launch(out, before_device)

    def overlap_count(self) -> int:
        """stage_overlaps (a collective_rpc method)."""
        return self.stage_overlaps

    def _sampling_logits(self, batch: FlatBatch, hidden: torch.Tensor,
                         ) -> tuple[list[CachedRequestState], torch.Tensor | None]:
        if ps.is_last_stage():
            return super()._sampling_logits(batch, hidden)  # type: ignore[misc]
        return self._sampling_rows(batch), None

    @staticmethod
    def _sampling_rows(batch: FlatBatch) -> list[CachedRequestState]:
        if len(batch.sample_rows) == len(batch.input_ids):
            return batch.states
        return [batch.states[row] for row in batch.sample_rows]

    def _sample(self, *args, **kwargs) -> None:
        """(rows or batch, logits or hidden, step, previous, grammar): the step is the third
        argument either way."""
        step: InFlightStep = args[2]
        comm = ps.get_comm()
        if not ps.is_last_stage():  # an earlier stage: the driver's tokens only
            first = args[0]
            rows = first if isinstance(first, list) else self._sampling_rows(first)
            sampled = torch.empty(len(rows), dtype=torch.int64, device=self.device)
            if not self.overlap_stages:
                comm.broadcast_from_driver(sampled)
                step.attach_samples(rows, sampled, None)
                return
            # Batch queue: this stage goes on to the next batch while the last stage runs this
            # one, so the tokens arrive later; they are attached when the step is resolved,
            # which the rank does before its requests are scheduled again (RankWorker).
            work = self._last_broadcast = comm.broadcast_from_driver(sampled, async_op=True)

            def wait_then_resolve():
                del step.resolve  # back to InFlightStep.resolve
                work.wait()
                step.attach_samples(rows, sampled, None)
                return step.resolve()

            step.resolve = wait_then_resolve  # type: ignore[method-assign]
            return
        attach = step.attach_samples

        def broadcast_then_attach(states, sampled, logprobs) -> None:
            sampled = sampled.to(torch.int64).contiguous()
            comm.broadcast_from_driver(sampled)
            attach(states, sampled, logprobs)

        step.attach_samples = broadcast_then_attach  # type: ignore[method-assign]
        try:
            super()._sample(*args, **kwargs)
        finally:
            del step.attach_samples

    def _prompt_logprobs(self, batch, hidden, out, result) -> None:
        if ps.is_last_stage():
            super()._prompt_logprobs(batch, hidden, out, result)
