"""The quantization-method contract and the one mechanism that applies any method to a model.

A method turns each float weight of a linear layer into whatever it stores (`quantize`), can turn
that back into floats (`dequantize`, the reference its kernel is checked against by
`ember.testing.check_quantization_method`), and computes the layer from its stored form
(`apply`). After the float weights are loaded, `quantize_model` swaps every decoder linear layer
(not the embedding or lm_head, which the sampler needs exactly) for a `QuantizedLinear`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn


class QuantizationMethod:
    name: ClassVar[str] = ""
    # Module names (suffixes) left in float: logits feed sampling and logprobs directly.
    skip_modules: ClassVar[tuple[str, ...]] = ("lm_head",)

    def quantize(self, weight: torch.Tensor) -> Any:
        raise NotImplementedError

    def dequantize(self, state: Any) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Default: dequantize and multiply (methods override with a fused kernel)."""
        return F.linear(x, self.dequantize(state).to(x.dtype), bias)


class QuantizedLinear(nn.Module):
    """A linear layer computed by a quantization method from its stored weight state."""

    def __init__(self, method: QuantizationMethod, state: Any, bias: torch.Tensor | None,
                 in_features: int, out_features: int) -> None:
        super().__init__()
        self.method = method
        self.state = state
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self.state, x, self.bias)

    def extra_repr(self) -> str:
        return f"{self.method.name}, in={self.in_features}, out={self.out_features}"


def quantize_model(model: nn.Module, method: QuantizationMethod) -> int:
    """Replace every eligible nn.Linear in `model` in place; returns how many were replaced."""
    targets = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith(method.skip_modules)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            state = method.quantize(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(parent, child, QuantizedLinear(method, state, bias, linear.in_features,
                                               linear.out_features))
    return len(targets)
