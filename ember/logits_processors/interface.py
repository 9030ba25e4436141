"""The logits-processor contract: one processor works on a whole step's batch of logits at once.

vLLM v1's batch-level interface is the model (a processor is built once per engine, learns the
batch's rows host-side in `update_state`, then edits the logits of every row in one `apply`),
adapted to ember's model runner, which has no persistent batch: each step `update_state` gets the
rows this processor is active on (their index in this step's logits, params, prompt and output
token ids), instead of vLLM's add/remove/move deltas. The runner decides which rows those are with
the class's `is_active`, so a processor never sees a request that did not ask for it.

Selection: the built-ins (ember.logits_processors.BUILTIN) read their own SamplingParams fields;
a registered processor of any other name is active on a request that names it in
``SamplingParams(extra_args={name: args})``, and `RowState.args` is that value.

Importing this module imports no torch (plugins' registration modules may import it freely).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from ember.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor is built with (fields may be added; none will be removed)."""

    vocab_size: int
    device: torch.device


@dataclass
class RowState:
    """One row of this step's logits that a processor is active on."""

    index: int  # the row in this step's logits
    req_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    # Tokens generated so far. Under async scheduling the last one may still be a placeholder
    # (-1) unless the class sets `needs_output_tokens`, which makes the runner wait for it.
    output_token_ids: Sequence[int]
    args: Any = None  # extra_args[name] for a processor selected by name; None for built-ins


class LogitsProcessor(ABC):
    """Base class of every logits processor (built-in or plugin).

    Class attributes the engine reads:
    - `argmax_invariant`: the processor never changes a row's argmax (min-p). vLLM's rule: such
      processors run only for random rows, after temperature; the others run on every row before
      penalties and temperature.
    - `needs_output_tokens`: `update_state` reads the values of generated tokens (bad words), so
      under async scheduling the runner first waits for the step in flight.
    """

    argmax_invariant: ClassVar[bool] = False
    needs_output_tokens: ClassVar[bool] = False

    def __init__(self, ctx: ProcessorContext) -> None:
        self.ctx = ctx

    @classmethod
    def validate_params(cls, params: SamplingParams, args: Any, vocab_size: int) -> None:
        """Check a request's arguments in the front end, before it reaches the engine core;
        raise ValueError naming what is wrong. The default accepts anything."""
        return None

    @classmethod
    def is_active(cls, params: SamplingParams, args: Any, num_output_tokens: int) -> bool:
        """Whether this processor changes the row of a request with these params that has
        generated `num_output_tokens` tokens. The default: selected by name, always active."""
        return True

    @abstractmethod
    def update_state(self, rows: list[RowState], batch_size: int) -> None:
        """Learn this step's active rows, of `batch_size` logits rows (host work: build index
        tensors, copy them without blocking). Called only when `rows` is not empty, then `apply`
        follows."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit float32 logits [B, V] of the whole step (rows not in `update_state` untouched);
        may work in place; returns the result. No device-to-host sync."""


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied from pinned memory without blocking on CUDA."""
    import torch

    pin = device.type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)
