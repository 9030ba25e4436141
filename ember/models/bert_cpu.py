"""oneDNN linears for the BERT encoder on the CPU: each weight prepacked once into oneDNN's
blocked layout, and the activation (GELU, erf or tanh; ReLU) or the residual add done in the
matmul's epilogue instead of another pass over the activations.

Float32 kernels throughout: torch's fp32 matmul precision setting is left as it is, so nothing
is computed in a lower precision. Where torch was built without oneDNN, BertLayer keeps ATen's
linears (AVAILABLE is false).
"""

from __future__ import annotations

import torch
from torch import nn

AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise")

# hidden_act -> oneDNN's eltwise post-op (attr, algorithm)
_POST_OPS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"),
             "gelu_pytorch_tanh": ("gelu", "tanh"), "gelu_fast": ("gelu", "tanh"),
             "relu": ("relu", "")}


class PackedLinear:
    """One nn.Linear's weight in oneDNN's layout; repacked if the weight is written again."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def weight(self) -> torch.Tensor:
        w = self.linear.weight
        key = (w.data_ptr(), w._version)  # a load or copy_ into the weight bumps its version
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._key = key
        return self._packed  # type: ignore[return-value]

    def __call__(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        attr, algorithm = _POST_OPS[act] if act is not None else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x, self.weight(), self.linear.bias, attr, [],
                                                  algorithm)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b + residual in one kernel."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight(),
                                                         self.linear.bias, "add")


def supports(hidden_act: str, dtype: torch.dtype) -> bool:
    return AVAILABLE and dtype == torch.float32 and hidden_act in _POST_OPS
