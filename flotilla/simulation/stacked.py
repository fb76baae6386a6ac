"""A model's clients stacked: one copy of the model whose linear layers hold a weight per
client and multiply each client's batch by its own (``torch.baddbmm``).

``vmap`` gives the same per-client arithmetic for any model, but pays its batching
machinery on every operation of every step; for the layers that carry the FLOPs of the
models clients train in simulation (linear layers between elementwise activations), a
batched matrix product over ``(clients, batch, features)`` is what vmap would reach in the
end, with plain autograd for the backward pass. A model qualifies when every parameter is
a linear layer's: the rest of its forward must treat the leading dimensions as batch
dimensions, which the trainer's probe checks against the task's own loop before using it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class _BatchedLinear(torch.autograd.Function):
    """``x @ W^T + b`` per client, with the backward pass written out: the weight's
    gradient comes out as ``grad_out^T @ x``, laid out as the weight is (autograd's own
    rule for ``baddbmm`` over a transposed weight gives it transposed, and slower), and the
    input's only when something upstream needs it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        w = weight.transpose(1, 2)
        if bias is None:
            return torch.bmm(x, w)
        return torch.baddbmm(bias.unsqueeze(1), x, w)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad_out, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad_out.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_b = grad_out.sum(dim=1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class StackedLinear(nn.Module):
    """``x @ W_c^T + b_c`` for each client c: ``x`` is ``(clients, batch..., in)``; the
    weight and bias are set per step (:meth:`StackedModel.bind`), not parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        out: torch.Tensor = _BatchedLinear.apply(flat, self.weight, self.bias)  # type: ignore[no-untyped-call]
        return out.view(*x.shape[:-1], out.shape[-1])


class StackedModel:
    """A copy of a model with each ``nn.Linear`` replaced by a :class:`StackedLinear`."""

    def __init__(self, module: nn.Module, layers: dict[str, StackedLinear]) -> None:
        self.module = module
        self._layers = layers

    def bind(self, params: Mapping[str, torch.Tensor]) -> None:
        """Use ``params`` (the model's own names -> (clients, *shape)) from now on."""
        for prefix, layer in self._layers.items():
            layer.weight = params[f"{prefix}weight"]
            layer.bias = params.get(f"{prefix}bias")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Outputs ``(clients, batch, ...)`` for inputs ``(clients, batch, ...)``."""
        out: torch.Tensor = self.module(x)
        return out


def stack_model(model: nn.Module) -> StackedModel | None:
    """The stacked copy of ``model``, or None when some parameter is not a linear layer's
    or the model has buffers."""
    if any(True for _ in model.buffers()):
        return None
    linear = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if not linear or any(n.rpartition(".")[0] not in linear for n, _ in model.named_parameters()):
        return None
    if "" in linear:  # the model itself is one nn.Linear
        layer = StackedLinear()
        return StackedModel(layer, {"": layer})
    module = copy.deepcopy(model)
    layers: dict[str, StackedLinear] = {}
    for name in linear:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        layers[f"{name}."] = layer = StackedLinear()
        setattr(parent, child, layer)
    return StackedModel(module, layers)
