"""soft_topk: values and gradients against independent computations, limits, masks, errors."""

import math
import subprocess
import sys
import warnings

import pytest
import torch

import fairseq_softtopk.ops as ops
from fairseq_softtopk.ops import soft_topk, sorted_soft_topk, sorted_sparse_soft_topk, sparse_soft_topk
from fairseq_softtopk.ops.paper_algorithm import paper_soft_topk
from conftest import compiles_fixed_solve
from ot_reference import sinkhorn_topk


def test_all_exports_exist():
    assert set(ops.__all__) >= {"soft_topk", "sorted_soft_topk", "SolverInfo"}
    for name in ops.__all__:
        assert hasattr(ops, name), name


def test_ops_import_without_fairseq(repo_root):
    code = ("import sys; sys.modules['fairseq'] = None\n"
            "from fairseq_softtopk.ops import soft_topk, sorted_soft_topk\n"
            "import torch; print(float(soft_topk(torch.tensor([3., 1., 2.]), 1, epsilon=1e-3).sum()))\n"
            "assert 'fairseq_softtopk.models' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(1.0)


def test_every_ops_and_modules_file_imports_without_fairseq(repo_root):
    """The layering: ``ops`` and ``modules`` are torch only; fairseq glue lives in ``models``/``criterions``."""
    code = ("import importlib, pkgutil, sys; sys.modules['fairseq'] = None\n"
            "import fairseq_softtopk.ops as ops, fairseq_softtopk.modules as modules\n"
            "names = [info.name for package in (ops, modules)\n"
            "         for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.') if not info.ispkg]\n"
            "for name in names: importlib.import_module(name)\n"
            "print(len(names))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 20  # every file was walked, not an empty package


@pytest.mark.parametrize("epsilon", [2.0, 0.5, 0.1])
def test_forward_and_gradient_match_unrolled_sinkhorn(rng, epsilon):
    x = torch.randn(3, 17, generator=rng, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 17, generator=rng, dtype=torch.float64)
    ours = soft_topk(x, 5, epsilon=epsilon, tol=1e-14)
    ref = sinkhorn_topk(x, 5, epsilon, sorted=False)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
    g_ours, = torch.autograd.grad((ours * weights).sum(), x)
    g_ref, = torch.autograd.grad((ref * weights).sum(), x)
    assert float((g_ours - g_ref).norm() / g_ref.norm()) <= 1e-6


@pytest.mark.parametrize("cost", ["linear", "sqeuclidean"])
@pytest.mark.parametrize("largest", [True, False])
def test_gradcheck_float64(rng, cost, largest):
    x = torch.randn(2, 9, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, -2:] = True
    assert torch.autograd.gradcheck(
        lambda v: soft_topk(v, 3, epsilon=0.3, tol=1e-14, cost=cost, largest=largest, mask=mask), (x,))


@pytest.mark.parametrize("epsilon", [0.5, 0.1, 0.02])
def test_paper_cost_matches_published_algorithm(rng, epsilon):
    """cost='paper', largest=False is Algorithm 1 on one row (run to convergence)."""
    x = torch.randn(1, 12, generator=rng, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(1, 12, generator=rng, dtype=torch.float64)
    ref, _ = paper_soft_topk(x, 4, epsilon, n_iter=20000, sorted=False)
    ours = soft_topk(x, 4, epsilon=epsilon, cost="paper", largest=False, tol=1e-14)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
    g_ref, = torch.autograd.grad((ref * weights).sum(), x)
    g_ours, = torch.autograd.grad((ours * weights).sum(), x)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-7, atol=1e-10)


def test_largest_is_the_mirror_of_smallest(rng):
    x = torch.randn(4, 10, generator=rng, dtype=torch.float64)
    for cost in ("linear", "sqeuclidean"):
        torch.testing.assert_close(soft_topk(x, 3, epsilon=0.2, cost=cost),
                                   soft_topk(-x, 3, epsilon=0.2, cost=cost, largest=False))
    # paper cost: the mirror x -> 1 - x maps anchors {0, 1} onto {1, 0}
    torch.testing.assert_close(soft_topk(x, 3, epsilon=0.2, cost="paper"),
                               soft_topk(1 - x, 3, epsilon=0.2, cost="paper", largest=False))


@pytest.mark.parametrize("epsilon", [1e-1, 3e-2, 1e-2, 3e-3])
def test_tends_to_hard_topk_within_theorem_2(rng, epsilon):
    """||Gamma* - Gamma_eps||_F <= eps (ln n + ln 2) / (n (x_(k+1) - x_(k))), squared cost."""
    n, k = 30, 6
    x = torch.randn(n, generator=rng, dtype=torch.float64)
    soft = soft_topk(x, k, epsilon=epsilon, cost="sqeuclidean", largest=False, tol=1e-13)
    hard = soft_topk(x, k, largest=False, hard=True)
    # the plan's two columns are A/n and (1 - A)/n
    frobenius = math.sqrt(2.0) * float((soft - hard).norm()) / n
    xs = x.sort().values
    bound = epsilon * (math.log(n) + math.log(2)) / (n * float(xs[k] - xs[k - 1]))
    assert frobenius <= bound
    assert frobenius > 0


def test_marginals_and_range_across_epsilon_and_size(rng):
    for n in (10, 1000, 100000):
        x = torch.randn(2, n, generator=rng) * 3
        for epsilon in (10.0, 1.0, 1e-2, 1e-4):
            out, info = soft_topk(x, 5, epsilon=epsilon, return_info=True)
            assert torch.isfinite(out).all()
            assert info.converged, (n, epsilon, info)
            assert float(out.min()) >= 0 and float(out.max()) <= 1
            torch.testing.assert_close(out.sum(-1, dtype=torch.float64), torch.full((2,), 5.0, dtype=torch.float64),
                                       rtol=0, atol=5 * 1e-4)


def test_rows_are_independent(rng):
    """Unlike the published code (cost normalised over the batch), each row is its own problem."""
    x = torch.randn(3, 8, generator=rng, dtype=torch.float64)
    x[2] *= 100
    batched = soft_topk(x, 2, epsilon=0.1, cost="paper")
    for i in range(3):
        torch.testing.assert_close(batched[i], soft_topk(x[i], 2, epsilon=0.1, cost="paper"))


def test_mask_and_negative_infinity_equal_truncation(rng):
    x = torch.randn(2, 10, generator=rng, dtype=torch.float64, requires_grad=True)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[:, 7:] = True
    out = soft_topk(x, 3, epsilon=0.2, mask=mask)
    truncated = soft_topk(x[:, :7], 3, epsilon=0.2)
    torch.testing.assert_close(out[:, :7], truncated)
    assert bool((out[:, 7:] == 0).all())
    (out * torch.arange(10.0, dtype=torch.float64)).sum().backward()
    assert bool((x.grad[:, 7:] == 0).all())
    padded = x.detach().masked_fill(mask, -float("inf"))
    torch.testing.assert_close(soft_topk(padded, 3, epsilon=0.2), out.detach())


@pytest.mark.parametrize("operator", [soft_topk, sorted_soft_topk, sparse_soft_topk, sorted_sparse_soft_topk])
@pytest.mark.parametrize("fixed_iterations", [False, True])
def test_masked_entries_are_ignored_whatever_they_hold(rng, operator, fixed_iterations):
    """NaN or either infinity where the mask excludes: the values and the gradient are those of finite entries
    there (the masked entries get no gradient); NaN where the mask keeps an entry is still refused."""
    x = torch.randn(3, 9, generator=rng, dtype=torch.float64)
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[:, [1, 5]] = True
    mask[2, 0] = True
    if fixed_iterations and operator is sparse_soft_topk:
        pytest.skip("sparse_soft_topk has no fixed-iteration solver")
    options = {} if "sparse" in operator.__name__ else {"epsilon": 0.3}
    if fixed_iterations:
        options["fixed_iterations"] = True
    results = []
    for fill in (0.7, math.nan, math.inf, -math.inf):
        scores = x.masked_fill(mask, fill).requires_grad_()
        out = operator(scores, 3, mask=mask, **options)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        results.append((out.detach(), scores.grad))
    for out, grad in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=0)
    assert bool((results[1][1][mask] == 0).all()) and bool(torch.isfinite(results[1][0]).all())
    if not fixed_iterations:  # the fixed-iteration solvers never look at the data
        kept_nan = x.masked_fill(mask, math.nan)
        kept_nan[0, 2] = math.nan
        with pytest.raises(ValueError, match="scores contain NaN where the mask keeps them"):
            operator(kept_nan, 3, mask=mask, **options)  # options hold no fixed_iterations here


def test_k_equal_to_valid_count_selects_everything():
    x = torch.tensor([[0.3, -1.0, 2.0, -float("inf")]], requires_grad=True)
    out = soft_topk(x, 3, epsilon=0.1)
    assert out.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    (out * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    assert bool((x.grad == 0).all())


def test_ties_share_the_selection_equally():
    out = soft_topk(torch.tensor([1.0, 1.0, 0.0, -1.0], dtype=torch.float64), 1, epsilon=1e-3)
    torch.testing.assert_close(out, torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64), atol=1e-9, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes(rng, dtype):
    x = torch.randn(4, 50, generator=rng, dtype=torch.float64)
    ref = soft_topk(x, 7, epsilon=0.3)
    out = soft_topk(x.to(dtype), 7, epsilon=0.3)
    assert out.dtype == dtype
    tol = {torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)


def test_dim_argument_and_hard_mode(rng):
    x = torch.randn(3, 6, 4, generator=rng)
    out = soft_topk(x, 2, dim=1, epsilon=1e-4)
    hard = soft_topk(x, 2, dim=1, hard=True)
    expected = torch.zeros_like(x).scatter_(1, x.topk(2, dim=1).indices, 1.0)
    assert torch.equal(hard, expected)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=0)
    assert not soft_topk(x.requires_grad_(), 2, dim=1, hard=True).requires_grad


def test_linear_cost_is_translation_invariant(rng):
    x = torch.randn(2, 11, generator=rng, dtype=torch.float64, requires_grad=True)
    out = soft_topk(x, 4, epsilon=0.3)
    torch.testing.assert_close(out, soft_topk(x + 7.5, 4, epsilon=0.3))
    grad, = torch.autograd.grad((out * torch.randn(2, 11, generator=rng, dtype=torch.float64)).sum(), x)
    torch.testing.assert_close(grad.sum(-1), torch.zeros(2, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), "k must be an integer >= 1"),
    (dict(k=9), "exceeds the number of valid"),
    (dict(k=2, epsilon=0.0), "epsilon must be"),
    (dict(k=2, epsilon=-1.0), "epsilon must be"),
    (dict(k=2, epsilon=True), "epsilon must be"),
    (dict(k=2, cost="euclid"), "cost must be one of"),
    (dict(k=2, tol="1e-5"), "tol must be a number > 0, got '1e-5'"),
    (dict(k=2, tol=0.0), "tol must be a number > 0"),
    (dict(k=2, mask=torch.ones(3, dtype=torch.bool)), "mask shape"),
])
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        soft_topk(torch.randn(8), **kwargs)


@pytest.mark.parametrize("op, strength", [(soft_topk, "epsilon"), (sorted_soft_topk, "epsilon"),
                                          (sparse_soft_topk, "regularization"),
                                          (sorted_sparse_soft_topk, "regularization")])
def test_number_arguments_given_as_tensors_are_refused_naming_what_to_pass(op, strength):
    """A tensor k or epsilon (a 0-dim one, or one that requires grad: the operators are not differentiable in it)
    is refused naming the argument and the conversion, not as "must be a finite number" of its repr."""
    scores = torch.randn(8)
    with pytest.raises(ValueError, match=r"k must be a Python or numpy number, got a tensor of shape \(\): "
                                         r"pass k.item\(\) or int\(k\)"):
        op(scores, torch.tensor(3), **{strength: 0.5})
    with pytest.raises(ValueError, match=f"{strength} must be a Python or numpy number, got a tensor of shape "
                                         rf"\(\) that requires grad: pass {strength}.item\(\) \(the operators are "
                                         f"not differentiable in {strength}\\)"):
        op(scores, 3, **{strength: torch.tensor(0.5, requires_grad=True)})


@pytest.mark.parametrize("op, strength", [(soft_topk, "epsilon"), (sorted_soft_topk, "epsilon"),
                                          (sparse_soft_topk, "regularization"),
                                          (sorted_sparse_soft_topk, "regularization")])
@pytest.mark.parametrize("largest", ["no", 0, None])
def test_largest_must_be_a_bool(op, strength, largest):
    """``largest="no"`` is truthy: it selected the largest entries without a word."""
    with pytest.raises(ValueError, match=f"largest must be True or False, got {largest!r}"):
        op(torch.randn(8), 2, largest=largest, **{strength: 0.5})


@pytest.mark.parametrize("op, strength", [(soft_topk, "epsilon"), (sorted_soft_topk, "epsilon"),
                                          (sparse_soft_topk, "regularization"),
                                          (sorted_sparse_soft_topk, "regularization")])
def test_numpy_scalars_give_the_python_numbers_result(op, strength, monkeypatch):
    """A sweep over ``np.linspace``/``np.arange`` hands numpy scalars: taken as the Python numbers they equal
    (``np.float32(0.3)`` was refused as "not a finite number > 0"), and the solver is given Python numbers."""
    import re

    import numpy as np

    module = sys.modules[op.__module__]
    name = "prepare_scores" if hasattr(module, "prepare_scores") else "sparse_rows"
    prepare, seen = getattr(module, name), []

    def recorded(scores, k, dim, largest, strength_value, *args, **kwargs):
        seen.append((type(k), type(strength_value)))
        return prepare(scores, k, dim, largest, strength_value, *args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    x = torch.tensor([[0.3, 2.0, -1.0, 1.4, 0.9, 1.1]], dtype=torch.float64)
    for k, value, tol in [(np.int64(2), np.float32(0.3), np.float64(1e-9)), (np.int32(3), np.float64(0.5), 1e-9)]:
        kwargs = {} if op is sparse_soft_topk else {"tol": tol}
        ours = op(x, k, **{strength: value}, **kwargs)
        expected = op(x, int(k), **{strength: float(value)}, **({} if op is sparse_soft_topk else {"tol": 1e-9}))
        torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert set(seen) == {(int, float)} and len(seen) == 4
    with pytest.raises(ValueError, match="k must be an integer >= 1, got " + re.escape(repr(np.True_))):
        op(x, np.True_, **{strength: 0.3})
    # dim too (it was refused: Python ints only); a bool still is
    columns = x.reshape(2, 3).T.contiguous()
    torch.testing.assert_close(op(columns, 2, dim=np.int64(0), **{strength: 0.3}),
                               op(columns, 2, dim=0, **{strength: 0.3}), rtol=0, atol=0)
    with pytest.raises(ValueError, match="dim must be an integer"):
        op(columns, 2, dim=np.True_, **{strength: 0.3})


def test_bad_scores_raise():
    with pytest.raises(ValueError, match="NaN"):
        soft_topk(torch.tensor([1.0, float("nan"), 0.0]), 1)
    with pytest.raises(ValueError, match="floating dtype"):
        soft_topk(torch.tensor([1, 2, 3]), 1)
    with pytest.raises(ValueError, match=r"contain inf"):
        soft_topk(torch.tensor([1.0, float("inf"), 0.0]), 1)
    with pytest.raises(ValueError, match="exceeds the number of valid"):
        soft_topk(torch.tensor([1.0, -float("inf"), -float("inf")]), 2)


def _hard_indicator(x, k, largest=True):
    return torch.zeros_like(x).scatter_(-1, x.topk(k, dim=-1, largest=largest).indices, 1.0)


@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, 1e38), (torch.float64, 1e308)])
@pytest.mark.parametrize("largest", [True, False])
def test_finite_scores_of_any_magnitude_give_the_hard_limit(rng, dtype, magnitude, largest):
    """Scores whose gaps are ~1e37 epsilons: the exact result is the hard top-k (was NaN near the
    dtype's largest number: the logits z / epsilon and the centring overflowed)."""
    x = torch.randn(4, 10, generator=rng, dtype=torch.float64)
    x = (x / x.abs().amax(-1, keepdim=True) * 1.7 * magnitude).to(dtype)  # up to 1.7 magnitude, no ties
    x.requires_grad_()
    out, info = soft_topk(x, 3, largest=largest, return_info=True)
    assert info.converged and info.marginal_error == 0.0, info
    torch.testing.assert_close(out, _hard_indicator(x.detach(), 3, largest), atol=1e-30, rtol=0)
    grad, = torch.autograd.grad((out * torch.randn(4, 10, generator=rng, dtype=dtype)).sum(), x)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("dtype, exponent", [(torch.float32, 126), (torch.float64, 1022)])
def test_scaling_scores_and_epsilon_together_changes_nothing_up_to_the_largest_number(rng, dtype, exponent):
    """The linear cost's plan depends on scores / epsilon only: rows whose best scores add up past the
    dtype's largest number (they are centred between them) give the plan of the scaled-down row exactly."""
    x = torch.randn(3, 12, generator=rng, dtype=torch.float64).clamp(-3.9, 3.9)
    x[:, :4] = torch.tensor([3.9, 3.5, 3.2, 2.9], dtype=torch.float64)  # the best sum past 2**(exponent + 2)
    scale = 2.0 ** exponent
    small = x.to(dtype).requires_grad_()
    large = (x * scale).to(dtype).requires_grad_()
    weights = torch.randn(3, 12, generator=rng, dtype=torch.float64).to(dtype)
    for kwargs in (dict(epsilon=0.5), dict(epsilon=0.5, cost="sqeuclidean"), dict(epsilon=0.05, largest=False)):
        expected = soft_topk(small, 3, **kwargs)
        out = soft_topk(large, 3, **{**kwargs, "epsilon": kwargs["epsilon"] * scale})
        assert torch.equal(out, expected), kwargs
        grad, = torch.autograd.grad((out * weights).sum(), large)  # scale times smaller: mostly 0 here
        assert torch.isfinite(grad).all()


def test_paper_cost_at_extreme_magnitudes_is_uniform_as_its_normalisation_makes_it(rng):
    """The paper divides the squared distance by its row maximum m**2, so the logits are about
    2 / (epsilon m): scores spanning float32's range are (to the dtype's precision) the uniform k / n,
    the float64 solution of the same scores; was NaN (the squares and the centring overflowed)."""
    x = torch.tensor([[3e38, -3e38, 1.0, 2.0, -1e38, 2e38], [1e38, 1e37, 3e38, -2e38, 0.0, 5.0]])
    x64 = x.double()
    for largest in (True, False):
        out = soft_topk(x.requires_grad_(), 2, cost="paper", epsilon=0.1, largest=largest)
        torch.testing.assert_close(out.double(), soft_topk(x64, 2, cost="paper", epsilon=0.1, largest=largest))
        torch.testing.assert_close(out, torch.full_like(out, 2 / 6), atol=1e-6, rtol=0)
        grad, = torch.autograd.grad(out[:, 0].sum(), x)
        assert torch.isfinite(grad).all()
    big = torch.randn(4, 10, generator=rng, dtype=torch.float64).clamp(-1.7, 1.7) * 1e307
    torch.testing.assert_close(soft_topk(big, 3, cost="paper", tol=1e-14), torch.full_like(big, 0.3), atol=1e-12, rtol=0)


@pytest.mark.parametrize("epsilon", [1e-45, 1e-300])
def test_epsilon_below_the_dtypes_range_gives_the_hard_limit(rng, epsilon):
    """float32 cannot hold epsilon = 1e-300 (it was 0, and the result NaN): the hard top-k."""
    x = torch.randn(4, 10, generator=rng)
    out, info = soft_topk(x, 3, epsilon=epsilon, return_info=True)
    assert info.converged
    torch.testing.assert_close(out, _hard_indicator(x, 3), atol=1e-30, rtol=0)


def test_unconverged_solve_warns_once_per_call_site(rng):
    """A result that misses its tolerance does not pass silently: a SoftTopKConvergenceWarning, whose text
    does not change from call to call, so that Python's default filter shows it once per call site."""
    x = torch.randn(4, 50, generator=rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            _, info = soft_topk(x, 7, epsilon=0.01, max_iter=1, return_info=True)
        assert not info.converged and info.n_iter == 1
    assert [w.category for w in caught] == [ops.SoftTopKConvergenceWarning]
    assert caught[0].filename == __file__  # the caller's line, not the operator's
    assert "soft_topk" in str(caught[0].message) and "max_iter=1" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        soft_topk(x, 7, epsilon=0.01, max_iter=1, warn=False)  # the caller checks info.converged itself
        assert soft_topk(x, 7, epsilon=0.01, return_info=True)[1].converged  # converged: no warning


def test_max_iter_bounds_the_reported_iterations_and_the_result_is_the_one_evaluated(rng):
    """At ``max_iter`` the reported error is the returned result's: the threshold is not moved after its last
    evaluation (it was, so that an "unconverged" result was another one than the info described)."""
    x = torch.randn(3, 40, generator=rng, dtype=torch.float64)
    _, full = soft_topk(x, 5, epsilon=0.02, tol=1e-12, return_info=True)
    assert full.converged and full.n_iter > 2
    for max_iter in range(1, full.n_iter):
        out, info = soft_topk(x, 5, epsilon=0.02, tol=1e-12, max_iter=max_iter, return_info=True, warn=False)
        assert info.n_iter == max_iter and not info.converged
        error = float(((out.sum(-1) - 5).abs() / 5).max())  # the column marginal, relative (min(k, n - k) = 5)
        assert error == pytest.approx(info.marginal_error, rel=1e-6, abs=1e-15)


def test_an_empty_candidate_dimension_is_named():
    """``torch.empty(4, 0)`` has nothing to select from: a ValueError naming the dimension (was a reshape error
    from inside the operator); an empty batch dimension is fine (empty result)."""
    with pytest.raises(ValueError, match=r"dimension dim=-1 of shape \(4, 0\) is empty"):
        soft_topk(torch.empty(4, 0), 3)
    with pytest.raises(ValueError, match=r"dimension dim=1 of shape \(2, 0, 5\) is empty"):
        soft_topk(torch.empty(2, 0, 5), 1, dim=1)
    with pytest.raises(ValueError, match=r"dim must be an integer in \[-2, 1\]"):
        soft_topk(torch.randn(2, 5), 1, dim=2)
    assert soft_topk(torch.empty(0, 5), 2).shape == (0, 5)


@pytest.mark.parametrize("cost, largest", [("linear", True), ("linear", False), ("paper", True)])
def test_fixed_iterations_equal_the_default_solve(rng, cost, largest):
    """``fixed_iterations=True`` (no host synchronisation): the same values and gradients as the
    default solve wherever every row converges, with masked and excluded (infinite) entries."""
    x = torch.randn(4, 300, generator=rng, dtype=torch.float64)
    x[1, :50] = -math.inf if largest else math.inf
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[2, 100:] = True
    weights = torch.randn(4, 300, generator=rng, dtype=torch.float64)
    results = []
    for fixed in (False, True):
        v = x.clone().requires_grad_()
        out, info = soft_topk(v, 7, epsilon=0.05, cost=cost, largest=largest, mask=mask, tol=1e-12, max_iter=40,
                              return_info=True, fixed_iterations=fixed)
        (out * weights).sum().backward()
        results.append((out.detach(), v.grad, info))
    (a, ga, info_a), (b, gb, info_b) = results
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    torch.testing.assert_close(gb, ga, rtol=0, atol=1e-9)
    assert info_b.n_iter == 40 and info_a.n_iter < 40
    assert isinstance(info_b.converged, torch.Tensor) and bool(info_b.converged)
    assert float(info_b.marginal_error) <= 1e-12


def test_fixed_iterations_report_a_miss_without_warning(rng):
    x = torch.randn(3, 500, generator=rng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, info = soft_topk(x, 5, epsilon=1.0, max_iter=1, return_info=True, fixed_iterations=True)
    assert not bool(info.converged) and float(info.marginal_error) > 1e-5


@compiles_fixed_solve
def test_fixed_iterations_compile_as_one_graph(rng):
    """No graph break (a host read would be one), and torch.compile(fullgraph=True) gives the eager
    values and gradients (aot_eager: traced forward and backward, no C++ compiler needed)."""
    x = torch.randn(3, 200, generator=rng, dtype=torch.float64)
    weights = torch.randn(3, 200, generator=rng, dtype=torch.float64)

    def select(v):
        return soft_topk(v, 4, epsilon=0.02, tol=1e-12, max_iter=30, fixed_iterations=True)

    torch._dynamo.reset()
    assert torch._dynamo.explain(select)(x).graph_break_count == 0
    compiled = torch.compile(select, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (select, compiled):
        v = x.clone().requires_grad_()
        out = fn(v)
        (out * weights).sum().backward()
        grads.append((out.detach(), v.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=1e-14)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=1e-12)
    torch._dynamo.reset()
