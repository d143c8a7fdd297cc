"""sorted_soft_topk: values and gradients against independent computations, limits, masks."""

import math
import warnings

import pytest
import torch

from fairseq_softtopk.ops import sorted_soft_topk
from fairseq_softtopk.ops.paper_algorithm import paper_soft_topk
from conftest import compiles_fixed_solve
from ot_reference import sinkhorn_topk


@pytest.mark.parametrize("epsilon", [2.0, 0.5, 0.1])
def test_forward_and_gradient_match_unrolled_sinkhorn(rng, epsilon):
    x = torch.randn(3, 13, generator=rng, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 13, 4, generator=rng, dtype=torch.float64)
    ours = sorted_soft_topk(x, 4, epsilon=epsilon, tol=1e-14)
    ref = sinkhorn_topk(x, 4, epsilon, sorted=True)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
    g_ours, = torch.autograd.grad((ours * weights).sum(), x)
    g_ref, = torch.autograd.grad((ref * weights).sum(), x)
    assert float((g_ours - g_ref).norm() / g_ref.norm()) <= 1e-6


@pytest.mark.parametrize("cost", ["linear", "sqeuclidean"])
@pytest.mark.parametrize("largest", [True, False])
def test_gradcheck_float64(rng, cost, largest):
    x = torch.randn(2, 8, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[0, :2] = True
    assert torch.autograd.gradcheck(
        lambda v: sorted_soft_topk(v, 3, epsilon=0.4, tol=1e-14, cost=cost, largest=largest, mask=mask), (x,))


def test_gradcheck_when_k_equals_valid_count(rng):
    """No rest anchor: a full soft sort of the valid entries."""
    x = torch.randn(1, 5, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False, False, False, True, True]])
    out = sorted_soft_topk(x, 3, epsilon=0.5, mask=mask, tol=1e-14)
    torch.testing.assert_close(out.sum(-1)[0, :3], torch.ones(3, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda v: sorted_soft_topk(v, 3, epsilon=0.5, mask=mask, tol=1e-14), (x,))


@pytest.mark.parametrize("epsilon", [0.5, 0.1, 0.02])
def test_paper_cost_matches_published_algorithm(rng, epsilon):
    """cost='paper' is the appendix code (TopK_custom) on one row, run to convergence."""
    x = torch.randn(1, 11, generator=rng, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(1, 11, 3, generator=rng, dtype=torch.float64)
    ref, _ = paper_soft_topk(x, 3, epsilon, n_iter=20000, sorted=True)
    ours = sorted_soft_topk(x, 3, epsilon=epsilon, cost="paper", tol=1e-14)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
    g_ref, = torch.autograd.grad((ref * weights).sum(), x)
    g_ours, = torch.autograd.grad((ours * weights).sum(), x)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-7, atol=1e-10)


def test_smallest_is_section_2_3(rng):
    """largest=False: anchors 0, 1, ..., k as in the paper's section 2.3 (smallest first)."""
    x = torch.randn(2, 9, generator=rng, dtype=torch.float64)
    torch.testing.assert_close(sorted_soft_topk(x, 3, epsilon=0.3, largest=False),
                               sorted_soft_topk(-x, 3, epsilon=0.3))
    torch.testing.assert_close(sorted_soft_topk(x, 3, epsilon=0.3, largest=False, cost="paper"),
                               sorted_soft_topk(3 - x, 3, epsilon=0.3, cost="paper"))


@pytest.mark.parametrize("t", [3.0, 6.0, 12.0])
def test_tends_to_the_hard_permutation(rng, t):
    """The error is the logistic split of the closest pair at a rank boundary.

    Two scores ``delta`` apart competing for adjacent anchors (linear cost, anchor spacing 1)
    form a 2x2 block with unit marginals whose cross ratio is ``exp(delta / epsilon)``: the
    swapped mass ``a`` solves ``((1 - a) / a) ** 2 = exp(delta / epsilon)``, so
    ``a = sigmoid(-delta / (2 epsilon))``. With the other gaps at least a few times larger, the
    largest entry-wise error is that ``a``; epsilon = delta / (2 t) makes it ``sigmoid(-t)``
    (0.047, 2.5e-3, 6.1e-6): each case fails if the solver is off by 5%.
    """
    x = torch.randn(4, 40, generator=rng, dtype=torch.float64)
    top = x.sort(-1, descending=True).values[:, :6]
    delta = float((top[:, :-1] - top[:, 1:]).min())  # over ranks 1..k+1, all rows
    soft = sorted_soft_topk(x, 5, epsilon=delta / (2 * t), tol=1e-12)
    hard = sorted_soft_topk(x, 5, hard=True)
    expected = torch.zeros(4, 40, 5, dtype=torch.float64).scatter_(1, x.topk(5, dim=-1).indices.unsqueeze(1), 1.0)
    assert torch.equal(hard, expected)
    err = float((soft - hard).abs().max())
    assert err == pytest.approx(float(torch.sigmoid(torch.tensor(-t))), rel=0.05)


def test_marginals_across_epsilon_and_size(rng):
    for n in (10, 1000, 100000):
        x = torch.randn(2, n, generator=rng) * 3
        for epsilon in (10.0, 1.0, 1e-2, 1e-4):
            out, info = sorted_soft_topk(x, 5, epsilon=epsilon, return_info=True)
            assert torch.isfinite(out).all() and info.converged, (n, epsilon, info)
            col = out.sum(-2, dtype=torch.float64)
            torch.testing.assert_close(col, torch.ones_like(col), rtol=0, atol=1e-4)
            assert float(out.sum(-1).max()) <= 1 + 1e-5 and float(out.min()) >= 0


def test_rows_independent_and_dim_argument(rng):
    x = torch.randn(3, 7, 2, generator=rng, dtype=torch.float64)
    out = sorted_soft_topk(x, 2, dim=1, epsilon=0.2, cost="paper")
    assert out.shape == (3, 7, 2, 2)
    for b in range(3):
        for c in range(2):
            torch.testing.assert_close(out[b, :, c], sorted_soft_topk(x[b, :, c], 2, epsilon=0.2, cost="paper"))


def test_mask_and_negative_infinity_equal_truncation(rng):
    x = torch.randn(2, 9, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 6:] = True
    out = sorted_soft_topk(x, 2, epsilon=0.3, mask=mask)
    torch.testing.assert_close(out[:, :6], sorted_soft_topk(x[:, :6], 2, epsilon=0.3))
    assert bool((out[:, 6:] == 0).all())
    (out * torch.randn(2, 9, 2, generator=rng, dtype=torch.float64)).sum().backward()
    assert bool((x.grad[:, 6:] == 0).all())
    torch.testing.assert_close(sorted_soft_topk(x.detach().masked_fill(mask, -float("inf")), 2, epsilon=0.3),
                               out.detach())


def test_ties_split_ranks_equally():
    out = sorted_soft_topk(torch.tensor([2.0, 2.0, 0.0, -3.0], dtype=torch.float64), 2, epsilon=1e-3)
    torch.testing.assert_close(out[:2], torch.full((2, 2), 0.5, dtype=torch.float64), atol=1e-9, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(rng, dtype):
    x = torch.randn(3, 40, generator=rng, dtype=torch.float64)
    ref = sorted_soft_topk(x, 3, epsilon=0.3)
    out = sorted_soft_topk(x.to(dtype), 3, epsilon=0.3)
    assert out.dtype == dtype
    tol = {torch.float16: 3e-2, torch.bfloat16: 8e-2}.get(dtype, 1e-5)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)


def test_errors():
    with pytest.raises(ValueError, match="exceeds the number of valid"):
        sorted_soft_topk(torch.randn(4), 5)
    with pytest.raises(ValueError, match="NaN"):
        sorted_soft_topk(torch.tensor([0.0, float("nan"), 1.0]), 1)
    with pytest.raises(ValueError, match="epsilon"):
        sorted_soft_topk(torch.randn(4), 2, epsilon=0)
    with pytest.raises(ValueError, match="k must be"):
        sorted_soft_topk(torch.randn(4), 1.5)


def test_newton_converges_fast_on_near_ties(rng):
    """Rows with a few near-tied top scores (gaps ~ epsilon / 6) used to converge linearly."""
    top = torch.tensor([-2.7376, -2.8076, -3.3343, -3.5685, -3.6499, -3.6669, -3.7642])
    for dtype in (torch.float32, torch.float64):
        rest = -4.0 - 6.0 * torch.rand(200, generator=rng)
        noise = 0.02 * torch.randn(8, 7, generator=rng)
        scores = torch.cat([top + noise, rest.expand(8, -1)], dim=-1).to(dtype)
        _, info = sorted_soft_topk(scores, 5, epsilon=0.1, tol=1e-6 if dtype == torch.float64 else 1e-4,
                                   return_info=True)
        assert info.converged and info.n_iter <= 8, (dtype, info)


def test_result_is_a_view_that_can_be_cloned_and_modified():
    """The soft result is a transposed view of the plan; a clone takes in-place ops with correct gradients."""
    x = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    A = sorted_soft_topk(x, 4, epsilon=0.1, tol=1e-10)
    assert not A.is_contiguous() and A.shape == (3, 40, 4)
    weights = torch.randn(3, 40, 4, dtype=torch.float64)
    (grad_plain,) = torch.autograd.grad((A * weights).sum(), x, retain_graph=True)
    doubled = A.clone().mul_(2.0)
    (grad_doubled,) = torch.autograd.grad((doubled * weights).sum(), x)
    torch.testing.assert_close(grad_doubled, 2 * grad_plain)


def test_histogram_newton_solves_the_weighted_problem(rng):
    """The warm start's solver on weighted points is Sinkhorn on the points repeated by their weights."""
    from fairseq_softtopk.ops.semi_dual_warm_start import hard_start, histogram_newton

    k, epsilon = 3, 0.3
    z = torch.randn(2, 12, generator=rng, dtype=torch.float64)
    repeats = torch.randint(1, 4, (12,), generator=rng)
    w = repeats.double().expand(2, -1)
    eps = torch.full((2, 1), epsilon, dtype=torch.float64)
    n_valid = w.sum(-1)
    g = hard_start(z.sort(-1, descending=True).values[:, : k + 1], n_valid == k, eps, k)
    g = histogram_newton(z, w, n_valid, eps, k, g, tol=1e-13, max_iter=50)
    anchors = torch.arange(k, -1, -1, dtype=torch.float64)
    P = torch.softmax(z.unsqueeze(1) * anchors.unsqueeze(-1) / epsilon + g.unsqueeze(-1), dim=1)  # (2, k+1, 12)
    ref = sinkhorn_topk(z.repeat_interleave(repeats, dim=1), k, epsilon, sorted=True)
    torch.testing.assert_close(P[:, :k].transpose(1, 2).repeat_interleave(repeats, dim=1), ref, atol=1e-9, rtol=0)


def test_histogram_start_on_large_masked_rows(rng):
    """Large smooth rows start from the histogram (no Newton step on all n is needed), masks included."""
    x = torch.randn(2, 20000, generator=rng)
    mask = torch.rand(2, 20000, generator=rng) < 0.3
    out, info = sorted_soft_topk(x, 5, epsilon=0.05, cost="paper", mask=mask, tol=1e-4, return_info=True)
    assert info.converged and info.n_iter == 0, info
    assert bool((out[mask] == 0).all())
    for b in range(2):
        ref = sorted_soft_topk(x[b][~mask[b]].double(), 5, epsilon=0.05, cost="paper", tol=1e-12)
        torch.testing.assert_close(out[b][~mask[b]].double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_candidate_window_floor_bounds_what_lies_below(rng, k):
    """Candidates crowded just below the window's floor carry less than tol / 100 of every rank,
    with the default boundary gap and with the proven one, log(k (1 + tol) / (1 - k tol));
    the latter is tight for k = 1 at tied best scores."""
    from fairseq_softtopk.ops import candidate_window

    eps, tol, n_below = 0.1, 1e-4, 3000
    top = torch.cat([torch.zeros(1, k + 1, dtype=torch.float64),  # k + 1 tied best scores
                     torch.rand(3, k + 1, generator=rng, dtype=torch.float64) * 3 * eps])
    kth = top.amin(-1, keepdim=True)
    for gap in (None, math.log(k * (1 + tol) / (1 - k * tol))):
        floor = candidate_window(kth, k, eps, tol, n_out=n_below, boundary_gap=gap)
        below = floor - 1e-3 * eps * torch.rand(4, n_below, generator=rng, dtype=torch.float64)
        A = sorted_soft_topk(torch.cat([top, below], -1), k, epsilon=eps, tol=1e-12)
        mass = A[:, k + 1:].sum(1)  # (rows, k): what the candidates below the floor put on each rank
        assert float(mass.max()) < tol / 100
        if k == 1 and gap is not None:
            assert float(mass[0].max()) > 0.99 * tol / 100


def _hard_permutation(x, k, largest=True):
    index = x.topk(k, dim=-1, largest=largest).indices
    return torch.zeros(*x.shape, k, dtype=x.dtype).scatter_(-2, index.unsqueeze(-2), 1.0)


@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, 1e37), (torch.float32, 1e38),
                                              (torch.float64, 1e307), (torch.float64, 1e308)])
@pytest.mark.parametrize("largest", [True, False])
def test_finite_scores_of_any_magnitude_give_the_hard_limit(rng, dtype, magnitude, largest):
    """Gaps of ~1e36 epsilons: the exact result is the hard permutation (was NaN: the logits
    z * y / epsilon overflowed, and near the largest number the centring too)."""
    x = torch.randn(4, 10, generator=rng, dtype=torch.float64)
    x = (x / x.abs().amax(-1, keepdim=True) * 1.7 * magnitude).to(dtype)  # up to 1.7 magnitude, no ties
    x.requires_grad_()
    out, info = sorted_soft_topk(x, 3, largest=largest, return_info=True)
    assert info.converged, info
    torch.testing.assert_close(out, _hard_permutation(x.detach(), 3, largest), atol=1e-12, rtol=0)
    grad, = torch.autograd.grad((out * torch.randn(4, 10, 3, generator=rng, dtype=dtype)).sum(), x)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype, exponent", [(torch.float32, 126), (torch.float64, 1022)])
def test_scaling_scores_and_epsilon_together_changes_nothing_up_to_the_largest_number(rng, dtype, exponent):
    """The linear cost's plan depends on scores / epsilon only: rows whose best scores add up past the
    dtype's largest number (they are centred between them) give the plan of the scaled-down row exactly."""
    x = torch.randn(3, 12, generator=rng, dtype=torch.float64).clamp(-3.9, 3.9)
    x[:, :4] = torch.tensor([3.9, 3.5, 3.2, 2.9], dtype=torch.float64)
    scale = 2.0 ** exponent
    small, large = x.to(dtype), (x * scale).to(dtype).requires_grad_()
    for kwargs in (dict(epsilon=0.5), dict(epsilon=0.5, cost="sqeuclidean"), dict(epsilon=0.05, largest=False)):
        expected = sorted_soft_topk(small, 3, **kwargs)
        out = sorted_soft_topk(large, 3, **{**kwargs, "epsilon": kwargs["epsilon"] * scale})
        assert torch.equal(out, expected), kwargs
        grad, = torch.autograd.grad(out[..., 0].sum(), large)
        assert torch.isfinite(grad).all()


def test_paper_cost_at_extreme_magnitudes_is_uniform_as_its_normalisation_makes_it():
    """Logits about 2 / (epsilon m) for scores of magnitude m (the squared distance is divided by
    its row maximum): the plan is uniform to float32's precision, the float64 solution of the same
    scores; was NaN (the squares and the centring overflowed)."""
    x = torch.tensor([[3e38, -3e38, 1.0, 2.0, -1e38, 2e38], [1e38, 1e37, 3e38, -2e38, 0.0, 5.0]])
    for largest in (True, False):
        out = sorted_soft_topk(x.requires_grad_(), 2, cost="paper", epsilon=0.1, largest=largest)
        torch.testing.assert_close(out.double(), sorted_soft_topk(x.double(), 2, cost="paper", largest=largest))
        torch.testing.assert_close(out, torch.full_like(out, 1 / 6), atol=1e-6, rtol=0)
        grad, = torch.autograd.grad(out[..., 0].sum(), x)
        assert torch.isfinite(grad).all()


def test_epsilon_below_the_dtypes_range_gives_the_hard_limit(rng):
    """float32 cannot hold epsilon = 1e-300 (it was 0: the solver never returned, or gave NaN)."""
    x = torch.randn(4, 10, generator=rng)
    for epsilon in (1e-45, 1e-300):
        out, info = sorted_soft_topk(x, 3, epsilon=epsilon, return_info=True)
        assert info.converged
        torch.testing.assert_close(out, _hard_permutation(x, 3), atol=1e-12, rtol=0)


@pytest.mark.parametrize("epsilon", [0.1, 1.0, 10.0])
def test_max_iter_bounds_the_reported_iterations(rng, epsilon):
    """The rescaling steps that precede Newton at a large epsilon count within max_iter (they came on top:
    max_iter=1 reported 3). A solve converged within a budget is the same with any larger one."""
    x = torch.randn(4, 10, generator=rng)
    full, info = sorted_soft_topk(x, 3, epsilon=epsilon, return_info=True)
    assert info.converged
    for max_iter in range(1, info.n_iter + 3):
        out, capped = sorted_soft_topk(x, 3, epsilon=epsilon, max_iter=max_iter, return_info=True, warn=False)
        assert capped.n_iter <= max_iter, (max_iter, capped)
        if max_iter >= info.n_iter:
            assert capped == info and torch.equal(out, full)
        else:
            assert not capped.converged


def test_solves_on_candidate_windows_share_max_iter(rng, monkeypatch):
    """Where a candidate window is not confirmed by its solution (forced here: a rank/rest boundary guessed
    5 epsilons above the (k+1)-th best), the rows are solved again on a wider window: the info reports the
    iterations of every solve (it reported the last one's), and all of them together stay within max_iter."""
    import fairseq_softtopk.ops.semi_dual_newton as sdn

    x = torch.randn(3, 3000, generator=rng, dtype=torch.float64) * 3
    reference = sorted_soft_topk(x, 4, epsilon=0.1, tol=1e-9)
    counts = []
    solve = sdn._solve_rows

    def counting(*args, **kwargs):
        point, n_iter = solve(*args, **kwargs)
        counts.append(n_iter)
        return point, n_iter

    monkeypatch.setattr(sdn, "_WINDOW_GAP", -5.0)
    monkeypatch.setattr(sdn, "_solve_rows", counting)
    out, info = sorted_soft_topk(x, 4, epsilon=0.1, tol=1e-9, return_info=True)
    assert len(counts) >= 2 and info.converged and info.n_iter == sum(counts), (counts, info)
    torch.testing.assert_close(out, reference, atol=1e-8, rtol=0)
    for max_iter in range(1, info.n_iter):
        counts.clear()
        _, capped = sorted_soft_topk(x, 4, epsilon=0.1, tol=1e-9, max_iter=max_iter, return_info=True, warn=False)
        assert capped.n_iter == sum(counts) <= max_iter, (max_iter, counts, capped)


def test_unconverged_solve_warns_once_per_call_site(rng):
    """A solve stopped by max_iter above its tol is not returned silently: a SoftTopKConvergenceWarning whose
    text does not change from call to call, so that the default filter shows it once per call site."""
    from fairseq_softtopk.ops import SoftTopKConvergenceWarning

    x = torch.randn(2, 1000, generator=rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            _, info = sorted_soft_topk(x, 60, epsilon=0.1, max_iter=2, return_info=True)
        assert not info.converged
    assert [w.category for w in caught] == [SoftTopKConvergenceWarning]
    assert caught[0].filename == __file__ and "sorted_soft_topk" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sorted_soft_topk(x, 60, epsilon=0.1, max_iter=2, warn=False)
        sorted_soft_topk(x[:, :50], 3, epsilon=0.1)  # converged: no warning


def test_an_empty_candidate_dimension_is_named():
    """Nothing to rank: a ValueError naming the empty dimension (was a reshape error from inside the operator)."""
    with pytest.raises(ValueError, match=r"dimension dim=-1 of shape \(4, 0\) is empty"):
        sorted_soft_topk(torch.empty(4, 0), 3)
    with pytest.raises(ValueError, match=r"dimension dim=0 of shape \(0, 3\) is empty"):
        sorted_soft_topk(torch.empty(0, 3), 1, dim=0)
    assert sorted_soft_topk(torch.empty(0, 5), 2).shape == (0, 5, 2)


@pytest.mark.parametrize("rows, n, k", [(20, 1000, 40), (20, 1000, 100), (2, 1500, 1000)])
def test_large_k_converges_in_float32_within_a_few_newton_steps(rows, n, k):
    """At k = 100, unit-spread scores and epsilon 0.1, float32 logits of magnitude ~1e3 are
    rounded by ~1e-4, above the 1e-5 tolerance: Newton stalled (50 iterations, errors 3-6e-5,
    seconds per row). Every row must now converge in a few steps, and agree with float64."""
    torch.manual_seed(0)
    x = torch.randn(rows, n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unconverged solve warns: that fails the test
        A, info = sorted_soft_topk(x, k, return_info=True)
    assert info.converged and info.n_iter <= 10
    columns = A.double().sum(-2)  # (rows, k): one element per rank
    assert float((columns - 1).abs().max()) <= 2e-5
    A64 = sorted_soft_topk(x.double(), k, tol=1e-9)
    assert float((A.double() - A64).abs().max()) <= 1e-4


def test_float32_logits_are_kept_where_their_rounding_is_below_the_tolerance(rng):
    """The float64 logits of large k are not taken where float32 suffices (small k, scores a few
    epsilons apart), since they double the plan's memory traffic."""
    from fairseq_softtopk.ops._common import prepare_scores
    from fairseq_softtopk.ops.semi_dual import SemiDualProblem, choose_logit_dtype

    def dtype_for(scores, k, epsilon, tol):
        prep = prepare_scores(scores, k, -1, True, epsilon, None, "linear", n_anchor_steps=k)
        return choose_logit_dtype(SemiDualProblem.prepared(prep, k), tol)

    log_probs = torch.randn(8, 5000, generator=rng).log_softmax(-1)
    assert dtype_for(log_probs, 5, 0.03, 1e-4) == torch.float32
    assert dtype_for(torch.randn(20, 1000, generator=rng), 100, 0.1, 1e-5) == torch.float64
    assert dtype_for(torch.randn(20, 1000, generator=rng).double(), 100, 0.1, 1e-5) == torch.float64


@pytest.mark.parametrize("banded", [False, True])
def test_blocked_gram_equals_the_dense_product(rng, banded):
    """banded_rank_gram against the dense product: on a solver's plan (banded: columns on a few
    neighbouring ranks), and on a random plan with no band (every rank reached by every element),
    with masked columns (zero plan) and a last block shorter than the others."""
    from fairseq_softtopk.ops.semi_dual_hessian import banded_rank_gram

    k, n = 40, 1003
    if banded:
        x = torch.randn(3, n, generator=rng, dtype=torch.float64)
        A = sorted_soft_topk(x, k, epsilon=0.05, tol=1e-12)  # (rows, n, k)
        P = torch.cat([A.transpose(1, 2), (1 - A.sum(-1)).unsqueeze(1)], dim=1)
        # the point of the blocks: most (element, rank) pairs are not reached
        assert float((P[:, :k] > torch.finfo(P.dtype).eps / (k + 1)).double().mean()) < 0.25
    else:
        P = torch.rand(3, k + 1, n, generator=rng, dtype=torch.float64)
        P /= P.sum(1, keepdim=True)
    P[1, :, 500:] = 0.0  # a row with fewer elements (masked entries)
    dense = torch.bmm(P[:, :k], P[:, :k].transpose(1, 2))
    for max_blocks in (64, 7, 1):
        torch.testing.assert_close(banded_rank_gram(P, k, max_blocks=max_blocks), dense, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("k, band", [(50, 7), (53, 9), (20, 10), (12, 1)])
def test_block_tridiagonal_solve_equals_the_dense_solve(rng, k, band):
    """Banded symmetric positive definite systems (entries vanish ``band`` or more off the
    diagonal), blocks that do not divide k, and the band read back from the matrix."""
    from fairseq_softtopk.ops.semi_dual_hessian import _band_width, block_tridiagonal_solve

    offsets = torch.arange(k)
    inside = (offsets.unsqueeze(0) - offsets.unsqueeze(1)).abs() < (band + 1) // 2
    half = torch.randn(3, k, k, generator=rng, dtype=torch.float64) * inside
    K = half @ half.transpose(1, 2) + 0.1 * torch.eye(k, dtype=torch.float64)
    rhs = torch.randn(3, k, generator=rng, dtype=torch.float64)
    width = _band_width(K)
    assert width <= band
    dense = torch.linalg.solve(K, rhs.unsqueeze(-1)).squeeze(-1)
    for w in {width, width + 3, k}:
        torch.testing.assert_close(block_tridiagonal_solve(K, rhs, w), dense, rtol=1e-10, atol=1e-12)


def test_blocked_hessian_gives_the_same_operator_and_an_exact_gradient(rng, monkeypatch):
    """From _BANDED_MIN_K on, the Newton Hessian and the backward's solve use banded_rank_gram and
    block_tridiagonal_solve: forced at k = 30 (small blocks of elements, evenly spread scores, so
    that the Hessian is banded), the operator agrees with the dense path and passes gradcheck,
    and the block solve did run in the forward and the backward pass."""
    from fairseq_softtopk.ops import semi_dual_hessian

    n, k, epsilon = 100, 30, 0.015
    x = torch.linspace(-3, 3, n, dtype=torch.float64).expand(2, n) + 0.01 * torch.randn(2, n, generator=rng,
                                                                                         dtype=torch.float64)
    x = x[:, torch.randperm(n, generator=rng)].clone().requires_grad_()
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[1, :10] = True
    dense = sorted_soft_topk(x, k, epsilon=epsilon, mask=mask, tol=1e-13)
    assert float(dense.detach().amax(-2).min()) < 0.9  # a soft selection: the gradient is not negligible
    monkeypatch.setattr(semi_dual_hessian, "_BANDED_MIN_K", 2)
    monkeypatch.setattr(semi_dual_hessian, "_GRAM_MIN_BLOCK", 4)
    solves = []
    block_solve = semi_dual_hessian.block_tridiagonal_solve
    monkeypatch.setattr(semi_dual_hessian, "block_tridiagonal_solve",
                        lambda K, rhs, width: solves.append(width) or block_solve(K, rhs, width))
    blocked = sorted_soft_topk(x, k, epsilon=epsilon, mask=mask, tol=1e-13)
    torch.testing.assert_close(blocked, dense, rtol=0, atol=1e-12)
    forward_solves = len(solves)
    blocked.sum(-1).pow(2).sum().backward()
    assert forward_solves > 0 and len(solves) > forward_solves and max(solves) <= k // 2
    assert torch.autograd.gradcheck(lambda v: sorted_soft_topk(v, k, epsilon=epsilon, mask=mask, tol=1e-13), (x,),
                                    fast_mode=True)


@pytest.mark.parametrize("dtype, epsilon", [(torch.float64, 1.0), (torch.float64, 0.05), (torch.float32, 0.02)])
def test_fixed_iterations_equal_the_default_solve(rng, dtype, epsilon):
    """``fixed_iterations=True`` (no host synchronisation, all entries, float64 logits): the default
    solve's values and gradients wherever every row converges, with masked and -inf entries and a
    row with exactly k valid entries (no rest anchor)."""
    x = torch.randn(5, 300, generator=rng, dtype=torch.float64).to(dtype)
    x[1, :100] = -math.inf
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[3, 4:] = True  # k valid entries
    weights = torch.randn(5, 300, 4, generator=rng, dtype=torch.float64).to(dtype)
    tol = 1e-11 if dtype == torch.float64 else 1e-5
    results = []
    for fixed in (False, True):
        v = x.clone().requires_grad_()
        out, info = sorted_soft_topk(v, 4, epsilon=epsilon, mask=mask, tol=tol, max_iter=20, return_info=True,
                                     fixed_iterations=fixed)
        (out * weights).sum().backward()
        results.append((out.detach().double(), v.grad.double(), info))
    (a, ga, info_a), (b, gb, info_b) = results
    assert info_a.converged and bool(info_b.converged) and info_b.n_iter == 20
    close = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(b, a, rtol=0, atol=close)
    assert float((gb - ga).norm() / ga.norm()) <= close


def test_fixed_iterations_report_a_miss_without_warning(rng):
    x = torch.randn(3, 400, generator=rng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, info = sorted_soft_topk(x, 5, epsilon=0.5, max_iter=1, return_info=True, fixed_iterations=True)
    assert not bool(info.converged) and float(info.marginal_error) > 1e-5


@compiles_fixed_solve
def test_fixed_iterations_compile_as_one_graph(rng):
    """No graph break, and torch.compile(fullgraph=True) (aot_eager: forward and backward traced)
    gives the eager values and gradients."""
    x = torch.randn(3, 200, generator=rng, dtype=torch.float64)
    weights = torch.randn(3, 200, 4, generator=rng, dtype=torch.float64)

    def select(v):
        return sorted_soft_topk(v, 4, epsilon=0.05, tol=1e-12, max_iter=12, fixed_iterations=True)

    torch._dynamo.reset()
    assert torch._dynamo.explain(select)(x).graph_break_count == 0
    compiled = torch.compile(select, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (select, compiled):
        v = x.clone().requires_grad_()
        out = fn(v)
        (out * weights).sum().backward()
        results.append((out.detach(), v.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-14)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-12)
    torch._dynamo.reset()
