"""How a module calls a fused kernel, written once: :class:`FusedOp`.

A fused kernel reaches a module's forward three ways: as a torch custom op while torch.compile traces (the
launchers are not traceable: the graph holds one opaque op), through an autograd Function when a gradient is wanted
(the weights are frozen: the Function gives the input's gradient), and as a direct call otherwise. The direct call
is the decode path, where every microsecond of host time shows, so modules make it themselves and hand the other
two cases to :meth:`FusedOp.call`::

    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
        return OP.call(x, *args, *state)
    return eager(x, ...)  # direct: no extra frame on the decode path

The op's input gradient is one function (``input_grad``), which both the Function and the custom op's autograd use;
it gets the way to call the op itself: the custom op in the op's backward (traced with it), the whole choice
(:meth:`FusedOp.__call__`) in the Function's.
"""
from __future__ import annotations

from typing import Callable

import torch


class FusedOp:
    """A fused kernel as the custom op ``op(x, *args)``, the eager function ``eager(x, *args, *state)`` and the
    input gradient ``input_grad(call, grad_out, *args, *state)`` (``x``'s gradient; every other input is frozen;
    ``call(x, *args, *state)`` runs this op, for a gradient that is the op itself the other way round).

    ``state``: trailing arguments of the eager function that the custom op does not take (a layer's launch plans);
    the op's backward passes none. The autograd Function is :attr:`function` (``apply(x, *args, *state)``), named
    ``name``. ``op_runs(x)``: whether the custom op takes ``x`` while compiling (else torch.compile traces the
    Function, whose eager function must then be traceable torch code for such an ``x``)."""

    def __init__(self, name: str, op, eager: Callable[..., torch.Tensor], input_grad: Callable[..., torch.Tensor], *,
                 num_args: int, op_runs: Callable[[torch.Tensor], bool] | None = None):
        self.op, self.eager, self.input_grad, self.num_args, self.op_runs = op, eager, input_grad, num_args, op_runs
        self.function = _function(name, self, num_args)
        op.register_autograd(_op_backward(self, num_args), setup_context=_save_inputs)

    def call(self, x: torch.Tensor, *args_and_state):
        """The custom op while torch.compile traces, else the autograd Function (the module calls ``eager`` itself
        when neither applies)."""
        if torch.compiler.is_compiling() and (self.op_runs is None or self.op_runs(x)):
            return self.op(x, *args_and_state[:self.num_args])
        return self.function.apply(x, *args_and_state)

    def __call__(self, x: torch.Tensor, *args_and_state):
        """The whole choice (custom op, Function or eager), for calls off the decode path (backward passes)."""
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
            return self.call(x, *args_and_state)
        return self.eager(x, *args_and_state)


def _save_inputs(ctx, inputs, output=None) -> None:
    """Keep the inputs after ``x`` for the backward: tensors through ``save_for_backward``, the rest as they are."""
    args = inputs[1:]
    ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
    ctx.arg_is_tensor = tuple(isinstance(a, torch.Tensor) for a in args)
    ctx.arg_values = tuple(None if t else a for a, t in zip(args, ctx.arg_is_tensor))


def _saved_inputs(ctx) -> list:
    tensors = iter(ctx.saved_tensors)
    return [next(tensors) if t else a for a, t in zip(ctx.arg_values, ctx.arg_is_tensor)]


def _op_backward(fused: FusedOp, num_args: int):
    def call_op(x, *args):
        return fused.op(x, *args[:num_args])

    def backward(ctx, grad_out):
        grad_x = fused.input_grad(call_op, grad_out, *_saved_inputs(ctx)) if ctx.needs_input_grad[0] else None
        return (grad_x,) + (None,) * num_args

    return backward


def _function(name: str, fused: FusedOp, num_args: int) -> type[torch.autograd.Function]:
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *args_and_state):
            _save_inputs(ctx, (x, *args_and_state))
            return fused.eager(x, *args_and_state)

        @staticmethod
        def backward(ctx, grad_out):
            saved = _saved_inputs(ctx)
            grad_x = fused.input_grad(fused, grad_out, *saved) if ctx.needs_input_grad[0] else None
            return (grad_x,) + (None,) * len(saved)

    Function.__name__ = Function.__qualname__ = name
    return Function
