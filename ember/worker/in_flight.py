"""InFlightStep: a launched step whose sampled tokens are still on (or coming from) the device.

The model runner launches a step and returns at once; the platform starts copying the sampled ids
(and logprobs) to host memory without blocking, and an event it records marks when they land.
`resolve()` waits for that event (the step's one device-to-host sync), writes the tokens over the
placeholders the runner put in its request states, and builds the ModelRunnerOutput. It is
idempotent: the engine resolves a step after launching the next one, and the runner may resolve it
earlier when the next step's sampling needs the tokens on the host (penalties).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember.core.scheduler_output import ModelRunnerOutput
from ember.layers.sampler import LogprobsTensors
from ember.worker.input_batch import PLACEHOLDER, CachedRequestState

if TYPE_CHECKING:
    from ember.platforms.base import DeviceEvent, Platform


class InFlightStep:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.sampled: torch.Tensor | None = None  # [rows] on the device, read by the next step
        self.result = ModelRunnerOutput()  # filled as it goes
        self._rows: list[tuple[CachedRequestState, int]] = []  # state, index of its placeholder
        self._host_sampled: torch.Tensor | None = None
        self._host_logprobs: tuple[torch.Tensor, ...] | None = None
        self._ready: DeviceEvent | None = None
        self._resolved = False
        # (rows, logits, previous step) of a step whose sampling waits for its grammar bitmask
        # (ModelRunner.finish_sampling); None once sampled.
        self.deferred_sampling: tuple | None = None
        self.reserved = False  # the placeholders are in the request states (reserve)

    def reserve(self, states: list[CachedRequestState]) -> None:
        """Leave a placeholder in each sampling request's outputs now, before the step is
        sampled (deferred sampling: the next step's inputs are built before this step's
        tokens are sampled, and read them on the device)."""
        rows = self._rows
        for row, state in enumerate(states):
            output = state.output_token_ids
            output.append(PLACEHOLDER)
            state.pending = (self, row)
            rows.append((state, len(output) - 1))
        self.reserved = True

    def attach_samples(
        self,
        states: list[CachedRequestState],
        sampled: torch.Tensor,
        logprobs: LogprobsTensors | None,
    ) -> None:
        """Start the copies home and leave a placeholder in each sampling request's outputs
        (unless `reserve` did)."""
        self.sampled = sampled
        to_host = self.platform.copy_to_host
        self._host_sampled = to_host(sampled)
        if logprobs is not None:
            self._host_logprobs = tuple(
                to_host(t) for t in (logprobs.logprob_token_ids, logprobs.logprobs,
                                     logprobs.selected_token_ranks)
            )
        self._ready = self.platform.record_event()
        if not self.reserved:
            self.reserve(states)

    def resolve(self) -> ModelRunnerOutput:
        if self._resolved:
            return self.result
        if self.deferred_sampling is not None:
            raise RuntimeError("a step waiting for its grammar bitmask was resolved before "
                               "finish_sampling")
        self._resolved = True
        if not self._rows:
            return self.result
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host_sampled.tolist()  # type: ignore[union-attr]
        lp = None
        if self._host_logprobs is not None:
            lp = tuple(t.tolist() for t in self._host_logprobs)
        result = self.result
        for row, (state, index) in enumerate(self._rows):
            token = tokens[row]
            if state.pending is not None and state.pending[0] is self:
                state.output_token_ids[index] = token
                state.pending = None
            result.sampled_token_ids[state.req_id] = token
            num_lp = state.sampling_params.logprobs
            if lp is not None and num_lp is not None:
                lp_ids, lp_values, lp_ranks = lp
                keep = num_lp + 1
                result.logprobs[state.req_id] = (lp_ids[row][:keep], lp_values[row][:keep],
                                                 lp_ranks[row])
        return result
