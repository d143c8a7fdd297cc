"""``torch.library`` ops around the many-programs-a-row kernels of :func:`~fairseq_softtopk.ops.sorted_soft_topk`
(``sorted_soft_topk_split_triton``): few, long rows, where one program a row would leave the GPU idle.

* ``fairseq_softtopk::sorted_soft_topk_split_forward``: the whole row's semi-dual Newton solve, in rounds of two
  launches (an evaluation on a ``(rows, chunks)`` grid, a step of one program a row), then the plan on the same
  grid. Returns what ``sorted_soft_topk_forward`` returns: the plan ``(rows, k + 1, n)``, per row the iterations
  and the marginal error reached.
* ``fairseq_softtopk::sorted_soft_topk_split_backward``: the implicit gradient in three launches (per-chunk sums,
  a per-row ``k x k`` solve, the per-chunk gradient).

How many rounds: every row stops on its own tests (the one-program kernel's: tolerance, stall, ``max_iter``), and
programs of finished rows return at once. With ``sync_free=False`` the launcher reads, every
:data:`CHECK_EVERY` rounds, whether a row is still going (one host read); with ``sync_free=True``
(``fixed_iterations=True``) it reads nothing and runs :func:`sync_free_rounds` rounds (a row still going then
keeps the point it reached, reported unconverged in its error).
"""

import contextlib
import math
import threading
from pathlib import Path
from typing import ContextManager, Iterator, Tuple

import torch
from torch import Tensor

from ..semi_dual import subnormal_cut
from ..semi_dual_warm_start import hard_start
from .loading import check_device, launch, load_kernels
from .soft_topk_op import _float32_halves
from .sorted_soft_topk_op import (_ridge, _setup_context, anchor_lanes, block_size, implicit_backward,
                                  pass_options)

KERNEL_FILE = Path(__file__).with_name("sorted_soft_topk_split_triton.py")
#: entries of a row per program on a GPU (16 iterations of BLOCK = 128 with the anchors unrolled, 32 of 64 in KP = 16
#: tiles); a row of 1e6 entries runs on 489 programs
CHUNK = 2048
#: ... and under the interpreter (whose cost is per iteration and per program)
INTERPRETER_CHUNK = 1 << 17
#: rows at least this long, in calls of at most SPLIT_MAX_ROWS rows, take these kernels (the one-program kernels'
#: grid would have fewer programs than an H100 has SMs); not yet tuned on a GPU
SPLIT_MIN_LENGTH = 16384
SPLIT_MAX_ROWS = 32
#: rounds between two host reads of whether a row is still going (sync_free=False)
CHECK_EVERY = 4

#: the kernels' run-time arguments and their Triton types (``D``: the scores' dtype), for ahead-of-time compilation
#: (the compile tests, scripts/bench/kernel_instructions.py); the passes over entries take the constexprs HAS_MASK
#: (the evaluation and the plan), BLOCK, KP, CHUNK and K1, the row launches KP
KERNEL_SIGNATURES = {
    "_split_evaluate_kernel": dict(Z="*D", VALID="*u8", EPS="*D", N_VALID="*D", STATE="*fp64", PART="*fp64",
                                   n="i32", k="i32", CUT="fp32"),
    "_split_step_kernel": dict(EPS="*D", N_VALID="*D", STATE="*fp64", PART="*fp64", N_ITER="*i32", ERR="*fp64",
                               chunks="i32", k="i32", tol_hi="fp32", tol_lo="fp32", max_iter="i32", RIDGE="fp32"),
    "_split_plan_kernel": dict(Z="*D", VALID="*u8", EPS="*D", N_VALID="*D", STATE="*fp64", PLAN="*D", n="i32",
                               k="i32", CUT="fp32"),
    "_split_backward_sums_kernel": dict(PLAN="*D", GRAD="*D", PART="*fp64", n="i32", k="i32"),
    "_split_backward_solve_kernel": dict(PART="*fp64", NO_REST="*u8", U="*fp64", chunks="i32", k="i32",
                                         RIDGE="fp32"),
    "_split_backward_grad_kernel": dict(PLAN="*D", GRAD="*D", U="*fp64", EPS="*D", GRAD_Z="*D", n="i32", k="i32"),
}

_kernel_modules = {}
_forced = threading.local()  # the family one_program_a_row / split_for_long_rows force: "one", "split" or none
# the per-row state's layout (sorted_soft_topk_split_triton): four KP vectors, the KP x KP Gram matrix, 16 scalars
_TRIAL_AT, _ERR, _FRESH, _ACTIVE = 1, 1, 5, 12


def kernel_module():
    """The kernels module (``sorted_soft_topk_split_triton.py``), loaded on first use."""
    if "module" not in _kernel_modules:
        _kernel_modules["module"] = load_kernels(KERNEL_FILE, f"{__package__}.sorted_soft_topk_split_triton",
                                                 "_split_step_kernel")
    return _kernel_modules["module"]


def state_size(kp: int) -> int:
    """Float64 entries of a row's solver state."""
    return 4 * kp + kp * kp + 16


def use_split_kernels(rows: int, n: int) -> bool:
    """Whether a call of ``rows`` rows of ``n`` entries runs on these kernels rather than the one-program ones."""
    forced = getattr(_forced, "family", None)
    if forced == "one":
        return False
    if forced == "split":
        return n >= SPLIT_MIN_LENGTH and rows > 0
    return n >= SPLIT_MIN_LENGTH and 0 < rows <= SPLIT_MAX_ROWS


@contextlib.contextmanager
def _forcing(family: str) -> Iterator[None]:
    before = getattr(_forced, "family", None)
    _forced.family = family
    try:
        yield
    finally:
        _forced.family = before


def one_program_a_row() -> ContextManager[None]:
    """Inside the block (this thread), sorted_soft_topk's kernels run one program a row whatever the shape: the
    benchmarks time both families on the same rows."""
    return _forcing("one")


def split_for_long_rows() -> ContextManager[None]:
    """Inside the block (this thread), calls of rows at least ``SPLIT_MIN_LENGTH`` long run on these kernels however
    many rows they have (``SPLIT_MAX_ROWS`` is not yet set from a GPU): the benchmarks time both families on the same
    rows (the beam search's 64 rows of 38,840 candidates, say)."""
    return _forcing("split")


def sync_free_rounds(max_iter: int) -> int:
    """Rounds (evaluations) a sync-free solve runs: the start, then two a step (room for one backtrack each)."""
    return 1 + 2 * max_iter


def pass_geometry(n: int, k: int, interpret: bool, unroll: bool = True) -> Tuple[int, int, int, dict]:
    """``(BLOCK, CHUNK, chunks, pass options)``: entries per iteration and per program (CHUNK a multiple of BLOCK),
    programs a row, the compile options of the passes over entries (``K1`` and the launch options); ``unroll=False``:
    the (BLOCK, KP) tiles whatever k (the instruction counts compare both)."""
    chunk = INTERPRETER_CHUNK if interpret else CHUNK
    block = block_size(chunk, k, interpret, unroll)
    chunk = max(chunk, block)
    return block, chunk, max(1, math.ceil(n / chunk)), pass_options(block, k, unroll)


def row_options(kp: int) -> dict:
    """Compiler options of the one-program-a-row launches (the step, the backward's solve): at KP = 32 their
    (KP, KP) float64 tiles spill registers on sm_90 with 4 warps, not with 8."""
    return dict(num_warps=4 if kp <= 16 else 8, enable_fp_fusion=True)


def _kernels_for(t: Tensor):
    module = kernel_module()
    check_device(module, t)
    return module, module.INTERPRETED


def launch_split_forward(z: Tensor, valid: Tensor, eps: Tensor, top: Tensor, n_valid: Tensor, k: int, tol: float,
                         max_iter: int, has_mask: bool, sync_free: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Runs the forward kernels; arguments as :func:`sorted_soft_topk_split_forward`'s. Returns ``(P, n_iter, err)``."""
    rows, n = z.shape
    z = z.contiguous()
    plan = z.new_empty((rows, k + 1, n))
    n_iter = z.new_zeros((rows,), dtype=torch.int32)
    err = z.new_full((rows,), math.inf, dtype=torch.float64)
    if rows == 0:
        return plan, n_iter, err
    module, interpret = _kernels_for(z)
    kp = anchor_lanes(k)
    block, chunk, chunks, options = pass_geometry(n, k, interpret)
    state = z.new_zeros((rows, state_size(kp)), dtype=torch.float64)
    scalars = state[:, 4 * kp + kp * kp:]
    state[:, _TRIAL_AT * kp:_TRIAL_AT * kp + k + 1] = hard_start(top, n_valid == k, eps, k)
    scalars[:, [_FRESH, _ACTIVE]] = 1.0
    scalars[:, _ERR] = math.inf
    parts = z.new_empty((rows, chunks, kp + 1 + kp * kp), dtype=torch.float64)
    valid = valid.contiguous().view(torch.uint8)
    eps = eps.reshape(rows).contiguous()
    n_valid = n_valid.contiguous()
    tol_hi, tol_lo = _float32_halves(float(tol))
    cut, ridge = subnormal_cut(z.dtype, k), _ridge(z.dtype)
    # with host reads the rows' own budget ends the solve: the start, then at most 12 trials (MAX_BACKTRACK) a step
    rounds = sync_free_rounds(max_iter) if sync_free else 1 + max_iter * 13
    for done in range(1, rounds + 1):
        launch(module._split_evaluate_kernel, (rows, chunks), z, valid, eps, n_valid, state, parts, n, k, cut,
               HAS_MASK=has_mask, BLOCK=block, KP=kp, CHUNK=chunk, **options)
        launch(module._split_step_kernel, (rows,), eps, n_valid, state, parts, n_iter, err, chunks, k, tol_hi, tol_lo,
               max_iter, ridge, KP=kp, **row_options(kp))
        if not sync_free and done % CHECK_EVERY == 0 and not bool(scalars[:, _ACTIVE].any()):
            break
    launch(module._split_plan_kernel, (rows, chunks), z, valid, eps, n_valid, state, plan, n, k, cut,
           HAS_MASK=has_mask, BLOCK=block, KP=kp, CHUNK=chunk, **options)
    return plan, n_iter, err


def launch_split_backward(plan: Tensor, grad: Tensor, eps: Tensor, no_rest: Tensor) -> Tensor:
    """Runs the backward kernels; arguments as :func:`sorted_soft_topk_split_backward`'s. Returns ``(rows, n)``."""
    rows, anchors, n = plan.shape
    k = anchors - 1
    plan = plan.contiguous()
    grad = grad.to(plan.dtype).contiguous()
    grad_z = plan.new_empty((rows, n))
    if rows == 0:
        return grad_z
    module, interpret = _kernels_for(plan)
    kp = anchor_lanes(k)
    block, chunk, chunks, options = pass_geometry(n, k, interpret)
    parts = plan.new_empty((rows, chunks, kp + 1 + kp * kp), dtype=torch.float64)
    u = plan.new_empty((rows, kp), dtype=torch.float64)
    launch(module._split_backward_sums_kernel, (rows, chunks), plan, grad, parts, n, k, BLOCK=block, KP=kp,
           CHUNK=chunk, **options)
    launch(module._split_backward_solve_kernel, (rows,), parts, no_rest.contiguous().view(torch.uint8), u, chunks, k,
           _ridge(plan.dtype), KP=kp, **row_options(kp))
    launch(module._split_backward_grad_kernel, (rows, chunks), plan, grad, u, eps.reshape(rows).to(plan.dtype)
           .contiguous(), grad_z, n, k, BLOCK=block, KP=kp, CHUNK=chunk, **options)
    return grad_z


@torch.library.custom_op("fairseq_softtopk::sorted_soft_topk_split_forward", mutates_args=())
def sorted_soft_topk_split_forward(x: Tensor, z: Tensor, valid: Tensor, eps: Tensor, grad_eps: Tensor, top: Tensor,
                                   n_valid: Tensor, k: int, tol: float, max_iter: int, has_mask: bool,
                                   sync_free: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """As ``sorted_soft_topk_op.sorted_soft_topk_forward`` (same arguments and results; the whole row is solved,
    never a candidate window), ``sync_free``: read nothing on the host (see the module's docstring)."""
    return launch_split_forward(z, valid, eps, top, n_valid, k, tol, max_iter, has_mask, sync_free)


@sorted_soft_topk_split_forward.register_fake
def _split_forward_fake(x, z, valid, eps, grad_eps, top, n_valid, k, tol, max_iter, has_mask, sync_free):
    rows, n = z.shape
    return (z.new_empty((rows, k + 1, n)), z.new_empty((rows,), dtype=torch.int32),
            z.new_empty((rows,), dtype=torch.float64))


@torch.library.custom_op("fairseq_softtopk::sorted_soft_topk_split_backward", mutates_args=())
def sorted_soft_topk_split_backward(plan: Tensor, grad: Tensor, eps: Tensor, no_rest: Tensor) -> Tensor:
    """As ``sorted_soft_topk_op.sorted_soft_topk_backward``."""
    return launch_split_backward(plan, grad, eps, no_rest)


@sorted_soft_topk_split_backward.register_fake
def _split_backward_fake(plan, grad, eps, no_rest):
    return plan.new_empty((plan.shape[0], plan.shape[2]))


sorted_soft_topk_split_forward.register_autograd(implicit_backward(sorted_soft_topk_split_backward, 12),
                                                 setup_context=_setup_context)
