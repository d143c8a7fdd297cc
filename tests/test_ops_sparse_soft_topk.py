"""sparse_soft_topk and sorted_sparse_soft_topk (quadratic regularisation): values against a generic QP
solver (cvxpy), gradients by float64 gradcheck, the limits, exact zeros, ties, masks, bad input, the
device check and loss scaling."""

import functools
import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from device_check import package_device_check
from fairseq_softtopk.ops import sorted_sparse_soft_topk, sorted_sparse_soft_topk_window, sparse_soft_topk

_QP_TOL = dict(tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)


def _cvxpy():
    """cvxpy, imported where a test needs it: the cuda tests of this module run where it is not installed."""
    return pytest.importorskip("cvxpy", reason="the QP reference needs cvxpy (pip install -e '.[dev]')")


def qp_sparse_topk(x: np.ndarray, k: int, regularization: float, p: float = 2) -> np.ndarray:
    """argmax <x, y> - (lambda/p) sum y^p over {0 <= y <= 1, sum y = k}, by a generic conic solver (a QP for p = 2)."""
    cp = _cvxpy()
    y = cp.Variable(len(x))
    penalty = cp.sum_squares(y) / 2 if p == 2 else cp.sum(cp.power(y, p)) / p
    cp.Problem(cp.Maximize(x @ y - regularization * penalty),
               [y >= 0, y <= 1, cp.sum(y) == k]).solve(solver="CLARABEL", **_QP_TOL)
    return y.value


def qp_sorted_sparse_topk(x: np.ndarray, k: int, regularization: float) -> np.ndarray:
    """The quadratically regularised OT between x (mass 1 each) and the anchors k, ..., 0 (mass 1 each,
    n - k for the last) with cost -x_i y_r, by a generic QP solver: the plan's first k columns."""
    cp = _cvxpy()
    n = len(x)
    anchors = np.arange(k, -1, -1.0)
    plan = cp.Variable((n, k + 1), nonneg=True)
    cost = -np.outer(x, anchors)
    cp.Problem(cp.Minimize(cp.sum(cp.multiply(cost, plan)) + regularization / 2 * cp.sum_squares(plan)),
               [cp.sum(plan, axis=1) == 1, cp.sum(plan, axis=0) == np.r_[np.ones(k), n - k]]
               ).solve(solver="CLARABEL", **_QP_TOL)
    return plan.value[:, :k]


@pytest.mark.parametrize("p", [2, 4 / 3], ids=["p2", "p4/3"])
@pytest.mark.parametrize("regularization", [0.05, 0.3, 1.0, 5.0])
@pytest.mark.parametrize("largest", [True, False])
def test_sparse_topk_equals_the_qp(rng, regularization, largest, p):
    x = torch.randn(3, 15, generator=rng, dtype=torch.float64)
    ours = sparse_soft_topk(x, 4, regularization=regularization, largest=largest, p=p)
    sign = 1.0 if largest else -1.0
    ref = np.stack([qp_sparse_topk(sign * row.numpy(), 4, regularization, p) for row in x])
    if p == 2:
        np.testing.assert_allclose(ours.numpy(), ref, atol=1e-7, rtol=0)
    else:  # the conic solver's power cones are less accurate near 0: ours must be at least as good an optimum
        np.testing.assert_allclose(ours.numpy(), ref, atol=1e-5, rtol=0)
        for row, y, y_ref in zip(sign * x.numpy(), ours.numpy(), ref):
            def objective(v):
                return row @ v - regularization / p * np.sum(np.abs(v) ** p)
            assert objective(y) >= objective(y_ref) - 1e-10
    torch.testing.assert_close(ours.sum(-1), torch.full((3,), 4.0, dtype=torch.float64), atol=1e-12, rtol=0)
    # exact zeros and ones where the QP's solution is at its bounds
    assert bool((ours[torch.from_numpy(ref) < 1e-9] == 0).all())
    assert bool((ours[torch.from_numpy(ref) > 1 - 1e-9] == 1).all())


@pytest.mark.parametrize("regularization", [0.05, 0.3, 1.0, 5.0])
@pytest.mark.parametrize("largest", [True, False])
def test_sorted_sparse_topk_equals_the_qp(rng, regularization, largest):
    x = torch.randn(3, 12, generator=rng, dtype=torch.float64)
    ours, info = sorted_sparse_soft_topk(x, 3, regularization=regularization, largest=largest, tol=1e-12,
                                         return_info=True)
    assert info.converged and info.marginal_error <= 1e-12
    sign = 1.0 if largest else -1.0
    ref = np.stack([qp_sorted_sparse_topk(sign * row.numpy(), 3, regularization) for row in x])
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-7, rtol=0)
    # the plan is sparse exactly where the QP's is: the zeros are exact, not small
    np.testing.assert_array_equal((ours == 0).numpy(), ref < 1e-7)
    torch.testing.assert_close(ours.sum(1), torch.ones(3, 3, dtype=torch.float64), atol=1e-12, rtol=0)


GRADCHECK_CASES = {
    "unsorted_p2": functools.partial(sparse_soft_topk, regularization=0.7),
    "unsorted_p4/3": functools.partial(sparse_soft_topk, regularization=0.7, p=4 / 3),
    **{f"sorted_{value:g}": functools.partial(sorted_sparse_soft_topk, regularization=value, tol=1e-13)
       for value in (0.2, 1.0, 4.0)},
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
@pytest.mark.parametrize("largest", [True, False])
def test_gradcheck(rng, case, largest):
    x = torch.randn(3, 10, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :3] = True
    assert torch.autograd.gradcheck(lambda v: GRADCHECK_CASES[case](v, 3, largest=largest, mask=mask), (x,),
                                    atol=1e-7)


def test_gradcheck_sorted_when_k_equals_valid_count(rng):
    """No rest anchor: a sparse soft sort of the valid entries."""
    x = torch.randn(1, 6, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, False, False, False, True, True]])
    out = sorted_sparse_soft_topk(x, 4, regularization=0.8, mask=mask, tol=1e-13)
    torch.testing.assert_close(out.sum(-1)[0, :4], torch.ones(4, dtype=torch.float64))
    assert torch.autograd.gradcheck(
        lambda v: sorted_sparse_soft_topk(v, 4, regularization=0.8, mask=mask, tol=1e-13), (x,), atol=1e-7)


def _hard_permutation(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros(*x.shape, k, dtype=x.dtype).scatter_(-2, x.topk(k).indices.unsqueeze(-2), 1.0)


def test_small_regularization_gives_hard_topk_exactly(rng):
    x = torch.randn(4, 50, generator=rng, dtype=torch.float64)
    gaps = x.sort(-1).values.diff(dim=-1).amin()
    small = float(gaps) / 4  # below every gap between scores: no two entries share a rank or the threshold
    for p in (2, 4 / 3):
        torch.testing.assert_close(sparse_soft_topk(x, 5, regularization=small, p=p),
                                   sparse_soft_topk(x, 5, hard=True), atol=0, rtol=0)
    out, info = sorted_sparse_soft_topk(x, 5, regularization=small, return_info=True)
    torch.testing.assert_close(out, _hard_permutation(x, 5), atol=0, rtol=0)
    assert info.n_iter == 0  # the hard thresholds are the exact solution there


@pytest.mark.parametrize("n, k", [(30, 4), (200, 10)])
def test_large_regularization_tends_to_uniform(rng, n, k):
    x = torch.randn(2, n, generator=rng, dtype=torch.float64)
    for regularization in (1e2, 1e4):
        unsorted = sparse_soft_topk(x, k, regularization=regularization)
        # exactly k/n + (x_i - mean x) / lambda once every entry is strictly inside (0, 1)
        torch.testing.assert_close(unsorted, k / n + (x - x.mean(-1, keepdim=True)) / regularization,
                                   atol=1e-12, rtol=0)
        cubic = sparse_soft_topk(x, k, regularization=regularization, p=4 / 3)
        # p = 4/3: ((x - tau) / lambda)^3 = k/n + O(1 / lambda) once every entry is strictly inside (0, 1)
        assert float((cubic - k / n).abs().max()) <= 10.0 * float(x.abs().max()) / regularization ** (1 / 3) * k / n
        sorted_ = sorted_sparse_soft_topk(x, k, regularization=regularization, tol=1e-10)
        # each entry deviates from 1/n by O(|x| k / lambda)
        assert float((sorted_ - 1.0 / n).abs().max()) <= 10.0 * k * float(x.abs().max()) / regularization
    assert int((sorted_ == 0).sum()) == 0  # near uniform: nothing is exactly 0 any more


def test_exact_zeros_at_training_scale(rng):
    """At the regularisation used for beam search (0.1 nats) over log-probability-like scores, almost every
    candidate is exactly 0 on every rank; the support is what a sparse mixing pays for."""
    logits = torch.randn(8, 5000, generator=rng) * 3.0
    scores = torch.log_softmax(logits, -1)
    out = sorted_sparse_soft_topk(scores, 5, regularization=0.1)
    support = (out > 0).any(-1).sum(-1)
    assert int(support.max()) <= 20 and int(support.min()) >= 5
    unsorted = sparse_soft_topk(scores, 5, regularization=0.1)
    assert int((unsorted > 0).sum(-1).max()) <= 20


def test_ties_get_equal_values(rng):
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    for p in (2, 4 / 3):
        unsorted = sparse_soft_topk(x, 2, regularization=1e-3, p=p)
        torch.testing.assert_close(unsorted, torch.tensor([[1.0, 1 / 3, 1 / 3, 1 / 3, 0.0]], dtype=torch.float64))
    ranks = sorted_sparse_soft_topk(torch.tensor([2.0, 2.0, 0.0, -3.0], dtype=torch.float64), 2,
                                    regularization=1e-3)
    torch.testing.assert_close(ranks[:2], torch.full((2, 2), 0.5, dtype=torch.float64), atol=1e-12, rtol=0)
    assert bool((ranks[2:] == 0).all())


@pytest.mark.parametrize("operator", [sparse_soft_topk, sorted_sparse_soft_topk])
def test_mask_and_negative_infinity_equal_truncation(rng, operator):
    x = torch.randn(2, 9, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 6:] = True
    out = operator(x, 2, regularization=0.6, mask=mask)
    torch.testing.assert_close(out[:, :6], operator(x[:, :6], 2, regularization=0.6))
    assert bool((out[:, 6:] == 0).all())
    weights = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    (out * weights).sum().backward()
    assert bool((x.grad[:, 6:] == 0).all())
    torch.testing.assert_close(operator(x.detach().masked_fill(mask, -math.inf), 2, regularization=0.6),
                               out.detach())


@pytest.mark.parametrize("operator", [sparse_soft_topk, sorted_sparse_soft_topk])
def test_rows_independent_and_dim_argument(rng, operator):
    x = torch.randn(3, 7, 2, generator=rng, dtype=torch.float64)
    out = operator(x, 2, dim=1, regularization=0.4)
    for b in range(3):
        for c in range(2):
            torch.testing.assert_close(out[b, :, c], operator(x[b, :, c], 2, regularization=0.4))


@pytest.mark.parametrize("operator", [sparse_soft_topk, sorted_sparse_soft_topk])
def test_errors_name_the_problem(operator):
    with pytest.raises(ValueError, match="exceeds the number of valid"):
        operator(torch.randn(4), 5)
    with pytest.raises(ValueError, match="exceeds the number of valid"):
        operator(torch.tensor([0.0, -math.inf, 1.0]), 3)
    with pytest.raises(ValueError, match="NaN"):
        operator(torch.tensor([0.0, float("nan"), 1.0]), 1)
    with pytest.raises(ValueError, match="inf"):
        operator(torch.tensor([0.0, math.inf, 1.0]), 1)
    with pytest.raises(ValueError, match="regularization"):
        operator(torch.randn(4), 2, regularization=0.0)
    with pytest.raises(ValueError, match="regularization"):
        operator(torch.randn(4), 2, regularization=math.inf)
    with pytest.raises(ValueError, match="k must be"):
        operator(torch.randn(4), 0)
    with pytest.raises(ValueError, match="mask shape"):
        operator(torch.randn(4), 2, mask=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="floating"):
        operator(torch.arange(4), 2)


def test_only_p_2_and_4_3_are_implemented():
    with pytest.raises(ValueError, match="p=1.5 is not supported"):
        sparse_soft_topk(torch.randn(4), 2, p=1.5)


def test_p_4_3_is_smooth_where_p_2_has_kinks(rng):
    """The cubic mask's derivative vanishes where an entry enters the support: moving a score across that point
    changes the mask's Jacobian continuously with p = 4/3 and by a jump with p = 2."""
    base = torch.tensor([3.0, 1.0, 0.0, -2.0], dtype=torch.float64)

    def jacobian_entry(value, p):
        x = base.clone()
        x[2] = value
        x.requires_grad_()
        out = sparse_soft_topk(x, 2, regularization=1.0, p=p)
        grad, = torch.autograd.grad(out[2], x)
        return float(grad[2])

    for p, jumps in ((2, True), (4 / 3, False)):
        tau = None
        # find where entry 2 enters the support: its mask turns positive
        values = torch.linspace(-1.0, 1.0, 2001, dtype=torch.float64)
        masks = [float(sparse_soft_topk(torch.cat([base[:2], v.view(1), base[3:]]), 2, regularization=1.0, p=p)[2])
                 for v in values]
        tau = next(i for i, m in enumerate(masks) if m > 0)
        before, after = jacobian_entry(float(values[tau - 1]), p), jacobian_entry(float(values[tau]), p)
        assert before == 0.0
        assert (after > 0.1) == jumps and (after < 1e-3) == (not jumps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("operator", [sparse_soft_topk, sorted_sparse_soft_topk])
def test_dtypes(rng, operator, dtype):
    x = torch.randn(3, 40, generator=rng, dtype=torch.float64)
    ref = operator(x.to(dtype).double(), 3, regularization=0.5)
    out = operator(x.to(dtype), 3, regularization=0.5)
    assert out.dtype == dtype
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)


def test_float32_threshold_keeps_its_precision_at_a_million_entries(rng):
    """The threshold's prefix sums only pick the segment; its value comes from direct sums."""
    x = torch.randn(2, 1_000_000, generator=rng)
    for regularization in (1e-3, 0.1, 1.0):
        out = sparse_soft_topk(x, 50, regularization=regularization)
        torch.testing.assert_close(out.double().sum(-1), torch.full((2,), 50.0, dtype=torch.float64),
                                   atol=1e-3, rtol=0)


def test_fixed_iterations_equal_the_default_solve(rng):
    x = torch.randn(4, 60, generator=rng, dtype=torch.float64)
    default = sorted_sparse_soft_topk(x, 5, regularization=0.5, tol=1e-12)
    fixed, info = sorted_sparse_soft_topk(x, 5, regularization=0.5, tol=1e-12, max_iter=10, fixed_iterations=True,
                                          return_info=True)
    assert bool(info.converged)
    torch.testing.assert_close(fixed, default, atol=1e-12, rtol=0)


@pytest.mark.parametrize("operator", [sparse_soft_topk, sorted_sparse_soft_topk])
def test_device_check_forward_and_backward(rng, operator):
    """Every tensor the operators create (forward and backward) takes the data's device and dtype."""
    x = torch.randn(3, 40, generator=rng, dtype=torch.float64).requires_grad_()
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[1, :7] = True
    with_inf = x.detach().clone()
    with_inf[2, 3] = -math.inf
    with package_device_check():
        for options in (dict(), dict(mask=mask), dict(largest=False), dict(hard=True)):
            out = operator(x, 4, regularization=0.3, **options)
            if out.requires_grad:
                (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        operator(with_inf.requires_grad_(), 4, regularization=0.3).square().sum().backward()
        operator(x.detach().half(), 2, regularization=0.3)
        if operator is sorted_sparse_soft_topk:
            operator(x.detach(), 4, regularization=0.3, fixed_iterations=True, max_iter=5)
        else:
            operator(x, 4, regularization=0.3, p=4 / 3, mask=mask).square().sum().backward()
    assert x.grad is not None and with_inf.grad is not None


def test_device_check_window_form(rng, monkeypatch):
    """The same for sorted_sparse_soft_topk_window, with a window narrower than the rows."""
    from fairseq_softtopk.ops import quadratic_semi_dual

    monkeypatch.setattr(quadratic_semi_dual, "_WINDOW_MIN", 1)
    x = torch.randn(3, 40, generator=rng, dtype=torch.float64)
    x[2, 3] = -math.inf
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[1, :7] = True
    leaf = x.clone().requires_grad_()
    with package_device_check():
        for options in (dict(), dict(mask=mask)):
            ranks, index = sorted_sparse_soft_topk_window(leaf, 4, regularization=0.3, **options)
            assert index.shape[1] < 40
            (ranks * torch.linspace(-1, 1, ranks.numel(), dtype=ranks.dtype).reshape(ranks.shape)).sum().backward()
        sorted_sparse_soft_topk_window(x.half(), 2, regularization=0.3)
    assert leaf.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("operator", [sparse_soft_topk, sorted_sparse_soft_topk,
                                      functools.partial(sparse_soft_topk, p=4 / 3)], ids=["p2", "sorted", "p4/3"])
def test_gradients_scale_exactly_with_the_loss(rng, operator, dtype):
    """fp16/amp loss scaling multiplies the upstream gradient by a power of two: the selection's gradient
    must scale by exactly the same factor (no clamp, no normalisation of the incoming gradient)."""
    x = (torch.randn(4, 50, generator=rng) * 2).to(dtype)
    weights = torch.randn(4, 50, 3, generator=rng)[..., : 3 if operator is sorted_sparse_soft_topk else 1]
    weights = weights.to(dtype) if operator is sorted_sparse_soft_topk else weights.reshape(4, 50).to(dtype)
    grads = []
    for scale in (1.0, 1024.0):
        leaf = x.clone().requires_grad_()
        out = operator(leaf, 3, regularization=0.5)
        (out * weights * scale).sum().backward()
        grads.append(leaf.grad / scale)
    assert bool((grads[0] != 0).any())
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)
    if operator is sorted_sparse_soft_topk:  # its window form too
        window_grads = []
        for scale in (1.0, 1024.0):
            leaf = x.clone().requires_grad_()
            ranks, index = sorted_sparse_soft_topk_window(leaf, 3, regularization=0.5)
            (ranks * weights.gather(1, index.unsqueeze(-1).expand(-1, -1, 3)) * scale).sum().backward()
            window_grads.append(leaf.grad / scale)
        assert bool((window_grads[0] != 0).any())
        torch.testing.assert_close(window_grads[1], window_grads[0], atol=0, rtol=0)


@pytest.mark.parametrize("regularization", [0.05, 2.0])
def test_the_window_solve_equals_the_whole_row_solve(rng, monkeypatch, regularization):
    """The adaptive solve works on a window of each row's best entries, widened until the entries below it
    provably sit on the rest anchor alone: values and gradients equal the solve over every entry (the fixed-
    iteration solve), also where the window had to widen (a wide support at lambda = 2, a 1-entry start)."""
    from fairseq_softtopk.ops import quadratic_semi_dual

    x = torch.randn(3, 400, generator=rng, dtype=torch.float64)
    x[1, 50:] = -math.inf
    weights = torch.randn(3, 400, 4, generator=rng, dtype=torch.float64)
    solves = []
    original = quadratic_semi_dual.QuadraticSemiDual

    class Recorded(original):
        def __init__(self, values, *args):
            solves.append(values.shape[1])
            super().__init__(values, *args)

    monkeypatch.setattr(quadratic_semi_dual, "QuadraticSemiDual", Recorded)
    monkeypatch.setattr(quadratic_semi_dual, "_WINDOW_MIN", 1)
    results = []
    for options in (dict(), dict(fixed_iterations=True, max_iter=30)):
        leaf = x.clone().requires_grad_()
        out = sorted_sparse_soft_topk(leaf, 4, regularization=regularization, tol=1e-12, **options)
        (out * weights).sum().backward()
        results.append((out.detach(), leaf.grad))
    windows, whole = solves[:-1], solves[-1]
    assert whole == 400 and windows[0] == 17 and max(windows) < 400
    if regularization == 2.0:
        assert len(windows) > 1  # the first window was too narrow and widened
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-12, rtol=0)
    # an entry on the edge of the support (its weight 0 up to rounding) may count as in or out of it: the
    # generalised Jacobians differ there by rounding-sized terms
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-9)


@pytest.mark.parametrize("regularization", [0.1, 2.0])
def test_the_window_form_is_the_dense_operator_on_its_window(rng, monkeypatch, regularization):
    """sorted_sparse_soft_topk_window (what soft beam search calls): scattered into zeros, its ranks are the
    dense operator's output (nothing outside the window carries weight), and its gradients are the dense
    operator's, also where the window had to widen (lambda 2 from a 1-entry start), with -inf and masked
    entries; QP-exact through the dense operator's tests."""
    from fairseq_softtopk.ops import quadratic_semi_dual

    monkeypatch.setattr(quadratic_semi_dual, "_WINDOW_MIN", 1)
    x = torch.randn(3, 300, generator=rng, dtype=torch.float64)
    x[1, 40:] = -math.inf
    mask = torch.zeros(3, 300, dtype=torch.bool)
    mask[2, :5] = True
    weights = torch.randn(3, 300, 4, generator=rng, dtype=torch.float64)
    dense_leaf, window_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense = sorted_sparse_soft_topk(dense_leaf, 4, regularization=regularization, mask=mask, tol=1e-12)
    ranks, index, info = sorted_sparse_soft_topk_window(window_leaf, 4, regularization=regularization, mask=mask,
                                                        tol=1e-12, return_info=True)
    assert bool(info.converged) and ranks.shape[:2] == index.shape and index.shape[1] < 300
    scattered = torch.zeros_like(dense).scatter(1, index.unsqueeze(-1).expand(-1, -1, 4), ranks)
    torch.testing.assert_close(scattered, dense.detach(), atol=1e-13, rtol=0)
    assert int((dense > 0).any(-1).sum()) == int((ranks > 0).any(-1).sum()) > 3 * 4  # every support entry is in it
    (dense * weights).sum().backward()
    (ranks * weights.gather(1, index.unsqueeze(-1).expand(-1, -1, 4))).sum().backward()
    torch.testing.assert_close(window_leaf.grad, dense_leaf.grad, atol=1e-12, rtol=0)
    assert bool((window_leaf.grad[1, 40:] == 0).all()) and bool((window_leaf.grad[2, :5] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_window_holds_the_best_scores_whatever_ties_the_capped_rows_make(rng, dtype):
    """The solver's window is each row's best entries by score: the sparse rows clamp every entry far below the
    (k+1)-th best to one position, and a window picked among those ties by position would depend on the device's
    topk (a GPU check found CPU and CUDA windows that differed). Rows with -inf and masked entries included."""
    x = torch.randn(4, 3000, generator=rng, dtype=dtype) * 3
    x[2, 100:] = -math.inf
    mask = torch.zeros(4, 3000, dtype=torch.bool)
    mask[3, ::2] = True
    _, index = sorted_sparse_soft_topk_window(x, 5, regularization=0.3, mask=mask)
    assert index.shape[1] < 3000
    ranked = x.masked_fill(mask, -math.inf)
    for row in range(4):
        n_valid = int(torch.isfinite(ranked[row]).sum())
        best = ranked[row].topk(min(index.shape[1], n_valid)).indices
        window = index[row][torch.isfinite(ranked[row, index[row]])]
        assert sorted(window.tolist()) == sorted(best.tolist())


def test_the_window_form_gradcheck_and_errors(rng, monkeypatch):
    from fairseq_softtopk.ops import quadratic_semi_dual

    monkeypatch.setattr(quadratic_semi_dual, "_WINDOW_MIN", 1)  # a window narrower than the row: m = 9 of 30
    x = torch.randn(2, 30, generator=rng, dtype=torch.float64, requires_grad=True)
    assert sorted_sparse_soft_topk_window(x, 2, regularization=0.5, tol=1e-13)[1].shape[1] < 30
    assert torch.autograd.gradcheck(
        lambda v: sorted_sparse_soft_topk_window(v, 2, regularization=0.5, tol=1e-13)[0], (x,), atol=1e-7)
    with pytest.raises(ValueError, match=r"takes \(rows, n\) scores, got \(2, 3, 30\)"):
        sorted_sparse_soft_topk_window(torch.zeros(2, 3, 30), 2)
    with pytest.raises(ValueError, match="NaN"):
        sorted_sparse_soft_topk_window(torch.full((1, 5), math.nan), 2)
    with pytest.raises(ValueError, match="k=6"):
        sorted_sparse_soft_topk_window(torch.zeros(1, 5), 6)


@pytest.mark.parametrize("p", [2, 4 / 3], ids=["p2", "p4/3"])
def test_the_unsorted_threshold_window_equals_the_whole_row(rng, monkeypatch, p):
    """sparse_soft_topk searches its threshold among the entries above x_(k+1) - lambda only (the others are 0
    whatever the threshold): the result equals the search over the whole row, and the QP's solution."""
    import importlib

    from fairseq_softtopk.ops.simplex_projection import capped_cubic_threshold, capped_simplex_threshold

    name, threshold = (("capped_simplex_threshold", capped_simplex_threshold) if p == 2 else
                       ("capped_cubic_threshold", capped_cubic_threshold))
    widths = []

    def recorded(values, k):
        widths.append(values.shape[1])
        return threshold(values, k)

    # the module, not the function of the same name that fairseq_softtopk.ops exports
    monkeypatch.setattr(importlib.import_module("fairseq_softtopk.ops.sparse_soft_topk"), name, recorded)

    x = torch.randn(3, 600, generator=rng, dtype=torch.float64)
    mask = torch.zeros(3, 600, dtype=torch.bool)
    mask[1, ::3] = True
    x[2, :100] = -math.inf
    out = sparse_soft_topk(x, 4, regularization=0.3, mask=mask, p=p)
    scaled = torch.where(mask | torch.isinf(x), -math.inf, x / 0.3)
    tau = threshold(scaled, torch.full((3, 1), 4.0, dtype=torch.float64))
    torch.testing.assert_close(out, (scaled - tau).clamp(0, 1) ** (1 if p == 2 else 3), atol=1e-12, rtol=0)
    assert widths[0] < 100  # the threshold was searched on a window, not on the 600 entries
    np.testing.assert_allclose(out[0].numpy(), qp_sparse_topk(x[0].numpy(), 4, 0.3, p), atol=1e-6)


# Extreme scales: scores far larger than the regularisation. The operators work on the differences of the scores
# in units of lambda with the gaps that cannot matter capped (fairseq_softtopk.ops.sparse_rows); these tests hold
# them to an exact rational solution (unsorted) and to the QP of the near-boundary entries (sorted).

def exact_sparse_topk(row, k: int, regularization, power: int = 1) -> list:
    """``clip(row / lambda - tau, 0, 1) ** power`` summing to k (``power`` 1: the projection onto {0 <= y <= 1,
    sum y = k}; 3: the p = 4/3 mask) in rational arithmetic (``row``: floats or Fractions, -inf = excluded): the
    piece of ``g(t) = sum clip(x_i - t, 0, 1) ** power`` that crosses k by bisection over the sorted breakpoints
    ``x_i`` and ``x_i - 1``, then its root: exact for power 1, within 2**-48 of the piece's width (at most 1) for
    power 3."""
    lam = Fraction(regularization)
    xs = {i: Fraction(v) / lam for i, v in enumerate(row) if v != -math.inf}
    breakpoints = sorted(set(xs.values()) | {x - 1 for x in xs.values()})

    def g(t):
        return sum(min(max(x - t, 0), 1) ** power for x in xs.values())

    lo, hi = 0, len(breakpoints) - 1  # g(breakpoints[lo]) >= k > g(breakpoints[hi])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if g(breakpoints[mid]) >= k else (lo, mid)
    t0, t1 = breakpoints[lo], breakpoints[hi]
    if power == 1:
        tau = t0 + (g(t0) - k) * (t1 - t0) / (g(t0) - g(t1))
    else:
        for _ in range(48):
            t0, t1 = ((t0 + t1) / 2, t1) if g((t0 + t1) / 2) >= k else (t0, (t0 + t1) / 2)
        tau = t0
    return [min(max(xs[i] - tau, 0), 1) ** power if i in xs else Fraction(0) for i in range(len(row))]


def near_boundary_rows(rows: int, n: int, k: int, scale: float, dtype, generator):
    """Normal scores times ``scale``, with 6 entries of each row put within 4 ulps of its k-th best (ties among them):
    the entries that share the selection when lambda is a few ulps. Returns ``(x, kth, ulp)``, ``(rows, 1)`` each."""
    x = (torch.randn(rows, n, generator=generator, dtype=torch.float64) * scale).to(dtype)
    kth = x.topk(k, dim=-1).values[:, -1:]
    ulp = torch.nextafter(kth.abs(), torch.tensor(math.inf, dtype=dtype)) - kth.abs()
    steps = torch.randint(-4, 5, (rows, 6), generator=generator).to(dtype)
    x[:, torch.randperm(n, generator=generator)[:6]] = kth + steps * ulp
    return x, kth, ulp


EXTREME_SCALES = [1e7, 1e12, 1e20]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", EXTREME_SCALES)
def test_sparse_topk_at_extreme_scales_is_the_exact_projection(rng, scale, dtype):
    """Rows sum to k with entries in [0, 1] at any scale, equal to the exact rational projection of the same
    scores (p = 2; p = 4/3 within 2**-48 of it): lambda 1 (from 1e12 up only tied scores share) and lambda a few
    ulps of the k-th best (the entries near it share), largest and smallest, with a mask and -inf."""
    k = 5
    x, kth, ulp = near_boundary_rows(4, 30, k, scale, dtype, rng)
    x[1, -3:] = -math.inf
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[2, :4] = True
    tol = 2e-6 if dtype == torch.float32 else 1e-13
    for regularization in (1.0, 3.0 * float(ulp.amax())):
        for largest in (True, False):
            scores = x if largest else torch.where(torch.isinf(x), math.inf, -x)
            out = sparse_soft_topk(scores, k, regularization=regularization, largest=largest, mask=mask)
            oriented = torch.where(mask, -math.inf, x).double().tolist()
            ref = torch.tensor([[float(v) for v in exact_sparse_topk(row, k, regularization)] for row in oriented],
                               dtype=torch.float64)
            torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
            torch.testing.assert_close(out.double().sum(-1), torch.full((4,), float(k), dtype=torch.float64),
                                       atol=k * tol, rtol=0)
            assert bool((out >= 0).all()) and bool((out <= 1).all())
            assert bool((out[mask] == 0).all()) and bool((out[1, -3:] == 0).all())
            cubic = sparse_soft_topk(scores, k, regularization=regularization, largest=largest, mask=mask, p=4 / 3)
            ref = torch.tensor([[float(v) for v in exact_sparse_topk(row, k, regularization, 3)] for row in oriented],
                               dtype=torch.float64)
            torch.testing.assert_close(cubic.double(), ref, atol=tol, rtol=0)
            torch.testing.assert_close(cubic.double().sum(-1), torch.full((4,), float(k), dtype=torch.float64),
                                       atol=k * tol, rtol=0)
            assert bool((cubic >= 0).all()) and bool((cubic <= 1).all())


def test_sparse_topk_of_normal_scores_times_1e7(rng):
    """The measured failure: rows summed to up to 11 instead of 5 at scale 1e7, lambda 1, float32."""
    x = torch.randn(200, 50, generator=rng) * 1e7
    out = sparse_soft_topk(x, 5, regularization=1.0)
    torch.testing.assert_close(out.sum(-1), torch.full((200,), 5.0), atol=1e-5, rtol=0)
    assert bool((out >= 0).all()) and bool((out <= 1).all())
    ref = torch.tensor([[float(v) for v in exact_sparse_topk(row, 5, 1.0)] for row in x.double().tolist()])
    torch.testing.assert_close(out, ref.float(), atol=1e-6, rtol=0)


def cluster_reference(row: torch.Tensor, kth: float, ulp: float, k: int, regularization: float):
    """The sorted plan of ``row`` (float64, -inf = excluded) whose entries are all more than 2 lambda apart except
    a cluster within 4 ulps of the k-th best: entries more than 2 lambda apart never share a rank (moving mass
    delta across such a gap both ways gains at least delta (gap - 2) lambda), so the j entries above the cluster
    take ranks 0..j-1, the entries below it nothing, and the cluster solves the same problem with k - j ranks,
    here by the QP solver on its offsets in units of lambda. Returns ``(plan (n, k), cluster index, j)``."""
    in_cluster = (row - kth).abs() <= 4 * ulp
    cluster = in_cluster.nonzero().squeeze(-1)
    outside = row[~in_cluster & torch.isfinite(row)]
    above = int((outside > kth).sum())
    # the premise: every other entry is more than 2 lambda from any other and from the cluster
    everything = torch.cat([outside, row[cluster]]).sort().values
    others = outside.sort().values
    assert float(others.diff().amin()) > 2 * regularization
    assert float((everything.unsqueeze(0) - others.unsqueeze(1)).abs().topk(2, largest=False).values[:, 1].amin()) \
        > 2 * regularization
    plan = torch.zeros(row.shape[0], k, dtype=torch.float64)
    plan[row.topk(above).indices, torch.arange(above)] = 1.0
    offsets = ((row[cluster] - kth) / regularization).numpy()
    cluster_plan = qp_sorted_sparse_topk(offsets, k - above, 1.0)
    plan[cluster.unsqueeze(-1), torch.arange(above, k)] = torch.from_numpy(cluster_plan)
    return plan, cluster, above


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", EXTREME_SCALES)
def test_sorted_sparse_topk_at_extreme_scales_is_the_cluster_qp(rng, scale, dtype):
    """Columns sum to 1 and rows lie in [0, 1] summing to at most 1 at any scale, the plan equal to the QP of the
    entries near the k-th best (lambda a few ulps of it: those share ranks), with a mask and -inf; the window form
    gives the same plan on its window."""
    k = 4
    x, kth, ulp = near_boundary_rows(3, 24, k, scale, dtype, rng)
    regularization = 3.0 * float(ulp.amax())
    x[1, torch.argsort(x[1])[:3]] = -math.inf  # the lowest three: far from the cluster
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[2, torch.argsort(x[2])[:2]] = True
    out, info = sorted_sparse_soft_topk(x, k, regularization=regularization, mask=mask, tol=1e-10, return_info=True)
    assert info.converged
    tol = 1e-6 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(out.double().sum(1), torch.ones(3, k, dtype=torch.float64), atol=tol, rtol=0)
    assert bool((out >= 0).all()) and float(out.double().sum(-1).max()) <= 1 + tol
    assert bool((out[mask] == 0).all()) and bool((out[1][torch.isinf(x[1])] == 0).all())
    for row, kth_row, ulp_row, plan in zip(torch.where(mask, -math.inf, x).double(), kth, ulp, out):
        ref, _, _ = cluster_reference(row, float(kth_row), float(ulp_row), k, regularization)
        torch.testing.assert_close(plan.double(), ref, atol=1e-6, rtol=0)  # the QP's own accuracy near 0
    ranks, index = sorted_sparse_soft_topk_window(x, k, regularization=regularization, mask=mask, tol=1e-10)
    scattered = torch.zeros_like(out).scatter(1, index.unsqueeze(-1).expand(-1, -1, k), ranks)
    torch.testing.assert_close(scattered, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hard_selections_and_ties_at_1e20(dtype):
    """The measured failure: an all-zero plan with a warning at scores 1e20, lambda 0.1. Scores apart by more than
    2 lambda give the hard permutation exactly, tied scores split their ranks equally, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.tensor([[1e20, -1e20, 5e19, 0.0]], dtype=dtype)
        torch.testing.assert_close(sorted_sparse_soft_topk(x, 2), _hard_permutation(x, 2), atol=0, rtol=0)
        ranks, index = sorted_sparse_soft_topk_window(x, 2)
        torch.testing.assert_close(torch.zeros(1, 4, 2, dtype=dtype).scatter(1, index.unsqueeze(-1).expand(-1, -1, 2),
                                                                               ranks), _hard_permutation(x, 2))
        torch.testing.assert_close(sparse_soft_topk(x, 2), torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=dtype))
        ties = torch.tensor([1e20, 5e19, 5e19, 0.0], dtype=dtype)
        expected = torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.0, 0.5], [0.0, 0.0]], dtype=dtype)
        torch.testing.assert_close(sorted_sparse_soft_topk(ties, 2), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(sparse_soft_topk(ties, 2), torch.tensor([1.0, 0.5, 0.5, 0.0], dtype=dtype))
        torch.testing.assert_close(sparse_soft_topk(-ties, 2, largest=False),
                                   torch.tensor([1.0, 0.5, 0.5, 0.0], dtype=dtype))


def test_gradients_at_scale_1e7_match_exact_and_float64_references(rng):
    """float32 scores around 1e7, lambda about 3 of their ulps: the unsorted gradient equals central differences of
    the exact rational projection, the sorted one (dense and window form) the gradient of the near-boundary
    cluster's problem in float64 at lambda 1 (itself checked by gradcheck), divided by lambda."""
    k = 4
    x, kth, ulp = near_boundary_rows(2, 20, k, 1e7, torch.float32, rng)
    regularization = 3.1 * float(ulp.amax())  # not a multiple of the ulps: no entry sits on a kink
    weights = torch.randn(2, 20, generator=rng, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    (sparse_soft_topk(leaf, k, regularization=regularization) * weights.float()).sum().backward()
    h = Fraction(regularization) / 2 ** 30
    for row, w, grad in zip(x.double().tolist(), weights.tolist(), leaf.grad):
        def loss(values):
            return sum(Fraction(wi) * yi for wi, yi in zip(w, exact_sparse_topk(values, k, regularization)))
        base = [Fraction(v) for v in row]
        fd = [float((loss(base[:j] + [v + h] + base[j + 1:]) - loss(base[:j] + [v - h] + base[j + 1:])) / (2 * h))
              for j, v in enumerate(base)]
        assert any(abs(v) > 0.01 for v in fd)
        torch.testing.assert_close(grad.double(), torch.tensor(fd, dtype=torch.float64), atol=1e-5, rtol=1e-5)

    weights = torch.randn(2, 20, k, generator=rng, dtype=torch.float64)
    dense_leaf, window_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense = sorted_sparse_soft_topk(dense_leaf, k, regularization=regularization, tol=1e-10)
    (dense * weights.float()).sum().backward()
    ranks, index = sorted_sparse_soft_topk_window(window_leaf, k, regularization=regularization, tol=1e-10)
    (ranks * weights.float().gather(1, index.unsqueeze(-1).expand(-1, -1, k))).sum().backward()
    for row, kth_row, ulp_row, w, grad, window_grad in zip(x.double(), kth, ulp, weights, dense_leaf.grad,
                                                           window_leaf.grad):
        _, cluster, above = cluster_reference(row, float(kth_row), float(ulp_row), k, regularization)
        offsets = ((row[cluster] - float(kth_row)) / regularization).requires_grad_()

        def cluster_plan(v):
            return sorted_sparse_soft_topk(v, k - above, regularization=1.0, tol=1e-13)

        assert torch.autograd.gradcheck(cluster_plan, (offsets,), atol=1e-7)
        (cluster_plan(offsets) * w[cluster, above:]).sum().backward()
        expected = torch.zeros(20, dtype=torch.float64).index_copy(0, cluster, offsets.grad / regularization)
        assert float(expected.abs().max()) > 0.01
        torch.testing.assert_close(grad.double(), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(window_grad, grad, atol=1e-7, rtol=1e-6)


def test_scores_and_regularization_at_the_ends_of_float32():
    """Scores near float32's largest number, and a regularization beyond it (differences that overflow float32
    still count): the large-lambda limit k/n + (x - mean x) / lambda exactly, the plan's marginals, no error."""
    x = torch.tensor([[3e38, -3e38, 1e38, 0.0, -1e-30]])
    exact = 2 / 5 + (x.double() - x.double().mean()) / 1e39
    torch.testing.assert_close(sparse_soft_topk(x, 2, regularization=1e39).double(), exact, atol=1e-6, rtol=0)
    plan = sorted_sparse_soft_topk(x, 2, regularization=1e39)
    torch.testing.assert_close(plan.sum(1), torch.ones(1, 2), atol=1e-6, rtol=0)
    assert float(plan.sum(-1).max()) <= 1 + 1e-6 and bool((plan >= 0).all())
    for lam in (1e-40, 1.0):  # everything apart by more than 2 lambda: the hard selections
        torch.testing.assert_close(sparse_soft_topk(x, 2, regularization=lam), sparse_soft_topk(x, 2, hard=True))
        torch.testing.assert_close(sorted_sparse_soft_topk(x, 2, regularization=lam), _hard_permutation(x, 2))
