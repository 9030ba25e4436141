"""Weights read into the GPU's L2 cache on a stream beside the model's, while the model's own
kernels leave the memory idle (decoding one or two sequences: rotary, attention and its merge
take microseconds a layer and read little).

``prefetch_weights(layers, x)`` forks a side stream off the current one, launches
ember.kernels.l2_prefetch there for the tensors the layers' methods name
(``LinearMethod.weights_to_prefetch``), and returns; the model's stream goes on at once.
``join_prefetches()`` makes the current stream wait for the side stream again: a model calls it
once at the end of its forward, so a CUDA-graph capture ends joined and nothing outlives the
step. The prefetch is a hint: the layers read their weights as usual, from L2 where it got
there first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember import kernels
from ember.kernels import dispatch
from ember.layers.linear import Linear

_side_streams: dict[torch.device, torch.cuda.Stream] = {}
_forked: set[torch.device] = set()


def prefetch_weights(layers: Sequence[Linear], x: torch.Tensor) -> None:
    """Start reading into L2 the weights ``layers`` will take ``x``'s rows through (a tensor
    of the step, on its device: nothing off CUDA)."""
    if not dispatch.on_gpu(x):
        return
    tensors = [t for layer in layers for t in layer.weights_to_prefetch(x.shape[0])]
    if not tensors:
        return
    device = tensors[0].device
    side = _side_streams.get(device)
    if side is None:
        side = _side_streams[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        kernels.l2_prefetch.prefetch_l2(tensors)
    _forked.add(device)


def join_prefetches() -> None:
    """The current stream waits for every prefetch forked so far."""
    for device in _forked:
        torch.cuda.current_stream(device).wait_stream(_side_streams[device])
    _forked.clear()
