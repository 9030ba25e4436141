"""The attention layers as one opaque custom op, so that ``torch.compile`` traces a model's whole
forward as one graph (``compile_model=True``).

An attention backend reads host-side metadata and writes the paged KV cache in place: traced,
dynamo would break the graph at every layer (one compiled piece between each two attention
layers, each with its own guards and entry cost: slower than eager on a CPU decode step). Here
each ``Attention`` runs as ``ember::attention(q, k, v, key)``, which dynamo and inductor keep as
one call; the step's ForwardContext reaches it through this module (``forward_context``, set
around each call of the compiled model), as vLLM's unified attention op reads its forward
context. The op is registered on first use (registering costs tens of milliseconds).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ember.layers.attention import Attention, ForwardContext

_layers: weakref.WeakValueDictionary[int, Attention] = weakref.WeakValueDictionary()
_keys = itertools.count()
_context: list[ForwardContext | None] = [None]


def prepare(model: torch.nn.Module) -> None:
    """Register the op and give each of the model's attention layers the key that names it in
    the op's calls (unique in the process: several engines' layers share indices), before the
    model is compiled."""
    from ember.layers.attention import Attention

    attention_op()
    for module in model.modules():
        if isinstance(module, Attention) and module._op_key is None:
            module._op_key = next(_keys)
            _layers[module._op_key] = module


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """The ForwardContext the op's calls read while a compiled forward runs."""
    previous, _context[0] = _context[0], ctx
    try:
        yield
    finally:
        _context[0] = previous


@functools.cache
def attention_op() -> Callable[..., torch.Tensor]:
    """``ember::attention``: the layer ``key``'s eager forward under the current context."""

    # The KV cache it writes is no argument, so torch does not see that write: nothing else in
    # the graph reads the cache, and each layer's call depends on the layer before.
    @torch.library.custom_op("ember::attention", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int) -> torch.Tensor:
        ctx = _context[0]
        if ctx is None:
            raise RuntimeError("ember::attention ran outside compiled_attention.forward_context")
        return _layers[key].eager_forward(q, k, v, ctx)

    @attention.register_fake
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: int) -> torch.Tensor:
        layer = _layers[key]
        return q.new_empty(q.shape[0], layer.num_heads * layer.head_size)

    return attention
