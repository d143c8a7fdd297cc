"""An identity whose backward pass caps the gradient norm of every row.

Soft beam search chains the soft top-k over the T decoding steps: the selection at step t
mixes the states that score the candidates of step t + 1, so the vector-Jacobian product
through the selection (of size about 1 / epsilon at a near tie) is multiplied once per
step and grows geometrically along a sentence. Capping it where it enters each step's
operator, per row (one sentence at one step), bounds every step's contribution, so the
gradient grows at most linearly in T, and keeps its direction (the same remedy as
per-step gradient clipping for recurrent networks).
"""

import math
from typing import Callable, Optional

import torch
from torch import Tensor


class RowGradientCapFunction(torch.autograd.Function):
    """Forward: ``x``. Backward: ``g * min(1, max_norm / ||g_row||)`` over the last dimension."""

    @staticmethod
    def forward(x: Tensor, max_norm: float, observer: Optional[Callable[[Tensor], None]]) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.max_norm, ctx.observer = inputs

    @staticmethod
    def backward(ctx, grad: Tensor):
        norms = torch.linalg.vector_norm(grad, dim=-1, keepdim=True)
        if ctx.observer is not None:
            ctx.observer(norms.squeeze(-1))
        if math.isinf(ctx.max_norm):
            return grad, None, None
        scale = (ctx.max_norm / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0)
        return grad * scale, None, None


def cap_row_grad_norm(x: Tensor, max_norm: float = math.inf,
                      observer: Optional[Callable[[Tensor], None]] = None) -> Tensor:
    """``x`` itself; in the backward pass each row's gradient is scaled to L2 norm at most ``max_norm``.

    Args:
        x: ``(*, n)``; a row is the last dimension.
        max_norm: the cap, > 0 (``inf``: no cap, only observation).
        observer: called in the backward pass with the ``(*)`` norms of the incoming
            gradient before capping (for diagnostics).
    Returns:
        ``x`` (a view), whose gradient is capped per row.
    Raises:
        ValueError: if ``max_norm`` is not positive (or NaN).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    return RowGradientCapFunction.apply(x, float(max_norm), observer)
