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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class Outer:
    """A stacked linear layer's weight gradient left as its two factors, ``grad_out^T @
    x`` per client: an optimizer step can fold it straight into the weight (one
    ``baddbmm_``) instead of writing the gradient out and reading it back."""

    grad_out: torch.Tensor  # (clients, rows, out)
    x: torch.Tensor  # (clients, rows, in)

    def take(self, rows: torch.Tensor) -> Outer:
        """The factors of some clients only."""
        return Outer(self.grad_out[rows], self.x[rows])


class _BatchedLinear(torch.autograd.Function):
    """``x @ W^T + b`` per client, with the backward pass written out: the weight's
    gradient comes out as ``grad_out^T @ x``, laid out as the weight is (autograd's own
    rule for ``baddbmm`` over a transposed weight gives it transposed, and slower), and the
    input's only when something upstream needs it. A layer that defers its gradients
    (:attr:`StackedLinear.deferred`) is handed them as :class:`Outer` factors and the
    bias's sum instead, and autograd gets none for either."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: StackedLinear,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.layer = layer
        w = weight.transpose(1, 2)
        if bias is None:
            return torch.bmm(x, w)
        return torch.baddbmm(bias.unsqueeze(1), x, w)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        layer: StackedLinear = ctx.layer
        grad_x = torch.bmm(grad_out, weight) if ctx.needs_input_grad[0] else None
        wants_b = ctx.has_bias and (layer.deferred or ctx.needs_input_grad[2])
        grad_b = grad_out.sum(dim=1) if wants_b else None
        if layer.deferred:
            layer.grads = (Outer(grad_out.detach(), x.detach()), grad_b)
            return grad_x, None, None, None
        grad_w = torch.bmm(grad_out.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, grad_b, None


class StackedLinear(nn.Module):
    """``x @ W_c^T + b_c`` for each client c: ``x`` is ``(clients, batch..., in)``; the
    weight and bias are set per step (:meth:`StackedModel.bind`), not parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None
        #: Whether the backward pass leaves the gradients in :attr:`grads`.
        self.deferred = False
        self.grads: tuple[Outer, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        out: torch.Tensor = _BatchedLinear.apply(flat, self.weight, self.bias, self)  # type: ignore[no-untyped-call]
        return out.view(*x.shape[:-1], out.shape[-1])


class StackedModel:
    """A copy of a model with each ``nn.Linear`` replaced by a :class:`StackedLinear`."""

    def __init__(self, module: nn.Module, layers: dict[str, StackedLinear]) -> None:
        self.module = module
        self._layers = layers

    def bind(self, params: Mapping[str, torch.Tensor], deferred: bool = False) -> None:
        """Use ``params`` (the model's own names -> (clients, *shape)) from now on;
        ``deferred``: the backward pass leaves the gradients to :meth:`deferred_grads`."""
        for prefix, layer in self._layers.items():
            layer.weight = params[f"{prefix}weight"]
            layer.bias = params.get(f"{prefix}bias")
            layer.deferred = deferred
            layer.grads = None

    def deferred_grads(self) -> dict[str, torch.Tensor | Outer]:
        """Each parameter's gradient from the last backward pass of a deferred binding:
        weights as :class:`Outer` factors, biases as tensors."""
        out: dict[str, torch.Tensor | Outer] = {}
        for prefix, layer in self._layers.items():
            if layer.grads is None:
                raise RuntimeError(f"layer {prefix!r} had no backward pass")
            weight, bias = layer.grads
            out[f"{prefix}weight"] = weight
            if bias is not None:
                out[f"{prefix}bias"] = bias
            layer.grads = None
        return out

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
