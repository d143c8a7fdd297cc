"""An identity whose backward pass caps the gradient norm of every row, in units of the loss's gradient.

Soft beam search chains the soft top-k over the T decoding steps: the selection at step t
mixes the states that score the candidates of step t + 1, so the vector-Jacobian product
through the selection (of size about 1 / epsilon at a near tie) is multiplied once per
step and grows geometrically along a sentence. Capping it where it enters each step's
operator, per row (one sentence at one step), bounds every step's contribution, so the
gradient grows at most linearly in T, and keeps its direction (the same remedy as
per-step gradient clipping for recurrent networks).

A cap on the gradient's norm is not linear in the gradient: were it absolute, multiplying the
loss by a factor before the backward pass (fp16 and amp training multiply it by a loss scale of
128 to 2^15 and more, then divide the gradients) would change what is capped, and the update.
So the cap is relative to the gradient that reaches the loss: the function also returns a
*scale probe*, a zero-valued scalar that the caller adds to its loss. Its gradient is then
``d(whatever is differentiated) / d(loss)``, the loss scale (1 in plain float32 training), and each
row is capped at ``max_norm`` times it. Every parameter gradient then scales exactly with the loss
(tested with powers of two). Where the probe is not part of what is differentiated, ``max_norm`` is
absolute.
"""

import math
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor


class RowGradientCapFunction(torch.autograd.Function):
    """Forward: ``(x, zero probe)``. Backward: ``g * min(1, max_norm * |s| / ||g_row||)`` over the last
    dimension, ``s`` the probe's gradient (1 where the probe reached no loss)."""

    @staticmethod
    def forward(x: Tensor, max_norm: float, observer: Optional[Callable[[Tensor], None]]) -> Tuple[Tensor, Tensor]:
        return x.view_as(x), x.new_zeros(())

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _, ctx.max_norm, ctx.observer = inputs
        ctx.set_materialize_grads(False)  # an unused probe gets None (absolute cap), not a zero

    @staticmethod
    def backward(ctx, grad: Optional[Tensor], probe_grad: Optional[Tensor]):
        if grad is None:
            return None, None, None
        norms = torch.linalg.vector_norm(grad, dim=-1, keepdim=True)
        scale = None if probe_grad is None else probe_grad.abs().to(norms.dtype)
        if ctx.observer is not None:  # the norms in units of the loss's gradient (0 where the loss was zeroed)
            ctx.observer((norms if scale is None else norms / torch.where(scale > 0, scale, 1.0)).squeeze(-1))
        if math.isinf(ctx.max_norm):
            return grad, None, None
        cap = ctx.max_norm if scale is None else ctx.max_norm * scale
        factor = (cap / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0)
        return grad * factor, None, None


def cap_row_grad_norm(x: Tensor, max_norm: float = math.inf, observer: Optional[Callable[[Tensor], None]] = None,
                      *, return_scale_probe: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``x`` itself; in the backward pass each row's gradient is scaled to L2 norm at most ``max_norm``.

    Args:
        x: ``(*, n)``; a row is the last dimension.
        max_norm: the cap, > 0 (``inf``: no cap, only observation), in units of the loss's gradient
            where the scale probe is added to the loss (module docstring), else absolute.
        observer: called in the backward pass with the ``(*)`` norms of the incoming gradient
            before capping, in the cap's units (for diagnostics).
        return_scale_probe: also return the probe: a 0-dim zero to add to the loss, so that the cap
            (and the observed norms) follow any factor the loss is multiplied by before ``backward``.
    Returns:
        ``x`` (a view), whose gradient is capped per row; with ``return_scale_probe``, ``(x, probe)``.
    Raises:
        ValueError: if ``max_norm`` is not positive (or NaN).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    capped, probe = RowGradientCapFunction.apply(x, float(max_norm), observer)
    return (capped, probe) if return_scale_probe else capped
