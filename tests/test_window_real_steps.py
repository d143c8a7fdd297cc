"""sorted_soft_topk_window on real beam-search steps, and edge cases of its certificate.

The fixture (tests/fixtures/beam_steps_multi30k_transformer.npz, written by
scripts/diagnostics/capture_beam_steps.py; its ``meta`` says how) holds 128 rows of the candidate scores that
reached the selection of the shipped Multi30k Transformer's soft beam search (valid sentences, beam 5, steps 0-26),
each cut to its 4,096 best of 38,840 candidates. The operator's floor counts the row's candidates (``n``), which the
public API takes from the row's width: so the operator runs on the stored 4,096-wide rows (floor 2.2 epsilons
higher than the full row's), while the certified-window sizes are counted with each row's true ``n``.
"""

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from triton_harness import interpreter_runner, kernel_test, run_under_the_interpreter
from conftest import REPO, script_module
from fairseq_softtopk.ops import candidate_window, default_window_width, sorted_soft_topk, sorted_soft_topk_window

FIXTURE = Path(__file__).parent / "fixtures" / "beam_steps_multi30k_transformer.npz"
K = 5  # the search's beam


@functools.lru_cache(maxsize=None)
def _fixture():
    """``(scores (rows, 4096) float32 sorted, n (rows,) int64, meta dict)`` (read-only: clone before use)."""
    data = np.load(FIXTURE)
    return torch.from_numpy(data["scores"]), torch.from_numpy(data["n"]), json.loads(str(data["meta"]))


def _floor(sorted_rows, k, epsilon, tol, n):
    """``(rows,)`` the certificate's floor as documented, written out here: ``log(100 n / tol) + log(2 (k+1)^2)``
    epsilons under the (k+1)-th best, in the rows' dtype (the operator's order of operations)."""
    return sorted_rows[:, k] - (math.log(100.0 * n / tol) + math.log(2.0 * (k + 1) ** 2)) * epsilon


def _scattered(ranks, index, n):
    """``(rows, n, k)``: the window's ranks in place, zeros elsewhere."""
    return ranks.new_zeros(ranks.shape[0], n, ranks.shape[2]).scatter(
        1, index.unsqueeze(-1).expand(-1, -1, ranks.shape[2]), ranks)


def test_the_fixture_holds_real_steps_of_many_sentences():
    x, n, meta = _fixture()
    assert x.shape == (128, 4096) and x.dtype == torch.float32 and bool((n == 38840).all())
    assert bool((x[:, :-1] >= x[:, 1:]).all()) and bool(torch.isfinite(x).all())  # sorted, best first
    assert meta["checkpoint"] == "checkpoints/multi30k_en_de_transformer_tf/checkpoint_best.pt"
    assert meta["subset"] == "valid" and meta["rows"] == 128 and len(meta["steps"]) >= 20
    assert float(x.max()) <= 0.0  # cumulative log-likelihoods


@pytest.mark.parametrize("epsilon", [0.03, 0.1])
@pytest.mark.parametrize("tol", [1e-4, 1e-5])  # the beam search's, the operator's default
def test_certified_windows_of_real_rows_fit_the_default_widths(epsilon, tol):
    """The candidates at or above candidate_window's floor (the full row's: n = 38,840), counted on the stored
    rows (the floor lies above each row's 4,096th best, so the count is the full row's), are fewer than the
    default width: a default or floor that would overflow real beam steps fails here. On this fixture: a median of
    9 and a largest of 24 (tol 1e-4) or 27 (1e-5) at epsilon 0.03; a median of 25-27 and a largest of 161 or 314 at
    0.1."""
    x, n, _ = _fixture()
    floor = candidate_window(x[:, K:K + 1], K, epsilon, tol, n_out=int(n[0]))
    assert bool((floor[:, 0] > x[:, -1]).all())
    counts = (x >= floor).sum(1)
    width = default_window_width(int(n[0]), K, epsilon)
    assert int(counts.max()) < width, (int(counts.max()), width)
    assert int(counts.min()) >= K + 1  # the k + 1 best are always in


@pytest.mark.parametrize("epsilon", [0.03, 0.1])
@pytest.mark.parametrize("dtype,tol,grad_rtol", [(torch.float32, 1e-5, 1e-4), (torch.float64, 1e-6, 1e-5)])
def test_real_rows_are_the_dense_operator_on_the_default_window(rng, epsilon, dtype, tol, grad_rtol):
    """With the default width no stored row overflows; the window's ranks scattered back are the dense operator's
    (float64, converged to 1e-11) to the tolerance, the score gradients for a random upstream gradient too
    (relative to the largest entry: near-hard rows' gradients are float32's rounding of 1 - A), zero outside the
    window, and the dense plan puts less than tol / 100 of every rank outside the window."""
    x, _, _ = _fixture()
    x = x.to(dtype)
    upstream = torch.randn(*x.shape, K, generator=rng, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    ranks, index, info = sorted_soft_topk_window(leaf, K, epsilon=epsilon, tol=tol, max_iter=20 if
                                                 dtype == torch.float32 else 30, return_info=True)
    assert index.shape == (x.shape[0], default_window_width(x.shape[1], K, epsilon))
    assert int(info.n_overflow) == 0 and bool(info.converged)
    dense_leaf = x.double().requires_grad_()
    dense = sorted_soft_topk(dense_leaf, K, epsilon=epsilon, tol=1e-11)
    scattered = _scattered(ranks, index, x.shape[1])
    assert float((scattered.detach().double() - dense.detach()).abs().max()) < tol
    (scattered * upstream.to(dtype)).sum().backward()
    (dense * upstream).sum().backward()
    error = (leaf.grad.double() - dense_leaf.grad).abs().max() / dense_leaf.grad.abs().max()
    assert float(error) < grad_rtol, float(error)
    outside = torch.ones_like(x, dtype=torch.bool).scatter(1, index, False)
    assert bool((leaf.grad[outside] == 0).all())
    assert float((dense.detach() * outside.unsqueeze(-1)).sum(1).max()) < tol / 100


@pytest.mark.parametrize("epsilon, width", [(0.03, None), (0.1, None), (0.3, 2048)])
def test_flags_are_the_rows_whose_next_candidate_reaches_the_floor(epsilon, width):
    """At the default width (at epsilon 0.3, 2,048), info.overflow is exactly the rows whose (W + 1)-th best stored
    candidate lies at or above the documented floor (n = the stored width), n_overflow their count; the certified
    ones are the dense operator's. At epsilon 0.3 most real rows hold more than 2,048 candidates above the floor
    (flagged): why no static width is the default there."""
    x, _, _ = _fixture()
    rows, n = x.shape
    width = width or default_window_width(n, K, epsilon)
    ranks, index, info = sorted_soft_topk_window(x, K, epsilon=epsilon, width=width, return_info=True)
    expected = x[:, width] >= _floor(x, K, epsilon, 1e-5, n)
    assert torch.equal(info.overflow, expected) and int(info.n_overflow) == int(expected.sum())
    if epsilon == 0.3:
        assert int(expected.sum()) > rows // 2
    certified = ~expected
    dense = sorted_soft_topk(x[certified].double(), K, epsilon=epsilon, tol=1e-11)
    assert float((_scattered(ranks, index, n)[certified].double() - dense).abs().max()) < 1e-5


def test_the_tightest_certified_window_of_each_real_row(rng):
    """Each row's tightest window (its candidates at or above the floor: W = their count) is certified, one
    fewer is flagged, and the dense plan puts less than tol / 100 of every rank past the W best: the certificate's
    promise, on real rows, where it is tightest."""
    x, _, _ = _fixture()
    x = x[torch.randperm(x.shape[0], generator=rng)[:24]].double()
    epsilon, tol, n = 0.1, 1e-5, x.shape[1]
    counts = (x >= _floor(x, K, epsilon, tol, n).unsqueeze(1)).sum(1)
    dense = sorted_soft_topk(x, K, epsilon=epsilon, tol=1e-12)
    for row, width in zip(x, counts.tolist()):
        flags = [bool(sorted_soft_topk_window(row[None], K, epsilon=epsilon, width=w, tol=tol,
                                              return_info=True)[2].overflow) for w in (width, width - 1)]
        assert flags == [False, True], width
    past = torch.arange(n) >= counts.unsqueeze(1)  # the rows are sorted: the W best are the first W
    assert float((dense * past.unsqueeze(-1)).sum(1).max()) < tol / 100


def test_a_window_too_narrow_flags_real_rows_and_gives_the_plan_of_its_candidates():
    """Width k + 1 at epsilon 0.1: every real row has more than k + 1 candidates above the floor, so every row is
    flagged and counted; its ranks are the plan of its k + 1 best alone (not the dense operator's)."""
    x, _, _ = _fixture()
    x = x.double()
    ranks, index, info = sorted_soft_topk_window(x, K, epsilon=0.1, width=K + 1, tol=1e-9, max_iter=40,
                                                 return_info=True)
    assert bool(info.overflow.all()) and int(info.n_overflow) == x.shape[0]
    assert torch.equal(index, torch.arange(K + 1).expand(x.shape[0], -1))  # sorted rows: the first k + 1
    alone = sorted_soft_topk(x[:, :K + 1], K, epsilon=0.1, tol=1e-12)
    assert float((ranks - alone).abs().max()) < 1e-8
    dense = sorted_soft_topk(x, K, epsilon=0.1, tol=1e-11)
    assert float((ranks - dense[:, :K + 1]).abs().max()) > 1e-3


@kernel_test
@pytest.mark.parametrize("epsilon", [0.03, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_window_on_real_rows_is_the_torch_path(rng, epsilon, dtype):
    """backend="triton" (a GPU, or Triton's interpreter) on four real rows: the torch path's window, flags, ranks
    and gradients."""
    from triton_harness import DEVICE

    x, _, _ = _fixture()
    x = x[::32].to(dtype)
    upstream = torch.randn(x.shape[0], default_window_width(x.shape[1], K, epsilon), K, generator=rng, dtype=dtype)
    results = []
    for backend, device in (("torch", "cpu"), ("triton", DEVICE)):
        leaf = x.clone().to(device).requires_grad_()
        ranks, index, info = sorted_soft_topk_window(leaf, K, epsilon=epsilon, return_info=True, backend=backend)
        grad, = torch.autograd.grad((ranks * upstream.to(device)).sum(), leaf)
        results.append((ranks.detach().cpu(), index.cpu(), grad.cpu(), info.overflow.cpu()))
    (ranks_t, index_t, grad_t, flags_t), (ranks_k, index_k, grad_k, flags_k) = results
    assert torch.equal(index_t, index_k) and torch.equal(flags_t, flags_k) and not bool(flags_t.any())
    atol = 2e-6 if dtype == torch.float32 else 1e-9
    assert float((ranks_t - ranks_k).abs().max()) < atol
    assert float((grad_t - grad_k).abs().max() / grad_t.abs().max()) < (1e-4 if dtype == torch.float32 else 1e-8)


@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """The kernel tests of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "test_kernel_")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_at_the_floor(dtype):
    """Candidates tied exactly at the floor (the k + 1 best tied too): a window that cuts through the tie is
    flagged, whichever tied candidates topk keeps; one that holds every tied candidate, the next one below the
    floor, is certified and is the dense operator."""
    k, epsilon, tol, n = 3, 0.2, 1e-4, 60
    x = torch.full((1, n), -1e3, dtype=dtype)
    x[0, :k + 1] = 0.0
    floor = float(_floor(x, k, epsilon, tol, n)[0])  # in the rows' dtype
    x[0, 10:16] = floor  # six tied at the floor, entries 4-9 inside
    x[0, 4:10] = torch.linspace(-0.1, floor + 0.5, 6, dtype=torch.float64).to(dtype)
    assert bool((x[0, 10:16] >= _floor(x, k, epsilon, tol, n)).all())
    for width, flagged in ((12, True), (15, True), (16, False)):
        ranks, index, info = sorted_soft_topk_window(x, k, epsilon=epsilon, width=width, tol=tol, max_iter=30,
                                                     return_info=True)
        assert bool(info.overflow[0]) == flagged, width
    dense = sorted_soft_topk(x.double(), k, epsilon=epsilon, tol=1e-12)
    assert float((_scattered(ranks, index, n).double() - dense).abs().max()) < tol
    assert float(dense[0, 16:].sum(0).max()) < tol / 100


def test_rows_with_at_most_k_finite_candidates():
    """Exactly k finite candidates (a full soft sort of them, ties included): certified, the dense operator's in
    values and gradient. Fewer than k: no plan exists (the dense operator refuses the row); the window flags it,
    whichever width, so that a caller's dense fallback raises that error instead of using an infeasible plan."""
    k, n = 3, 40
    x = torch.full((3, n), -math.inf, dtype=torch.float64)
    x[0, [2, 7, 30]] = torch.tensor([1.0, 0.5, 0.7], dtype=torch.float64)
    x[1, :3] = 0.25  # k tied
    x[2, 5:7] = torch.tensor([1.0, 0.2], dtype=torch.float64)  # k - 1
    upstream = torch.randn(2, n, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for width in (k, 8, n):
        leaf = x.clone().requires_grad_()
        ranks, index, info = sorted_soft_topk_window(leaf, k, epsilon=0.3, width=width, tol=1e-10, max_iter=40,
                                                     return_info=True)
        assert info.overflow.tolist() == [False, False, True] and int(info.n_overflow) == 1, width
        dense_leaf = x[:2].clone().requires_grad_()
        dense = sorted_soft_topk(dense_leaf, k, epsilon=0.3, tol=1e-12)
        scattered = _scattered(ranks, index, n)[:2]
        torch.testing.assert_close(scattered, dense, atol=1e-9, rtol=0)
        grad, = torch.autograd.grad((scattered * upstream).sum(), leaf)
        dense_grad, = torch.autograd.grad((dense * upstream).sum(), dense_leaf)
        torch.testing.assert_close(grad[:2], dense_grad, atol=1e-8, rtol=0)
    with pytest.raises(ValueError, match="exceeds the number of valid"):
        sorted_soft_topk(x[2:], k, epsilon=0.3)


def test_a_wide_epsilon_on_a_wide_window(rng):
    """Epsilon 0.3 (by default every candidate: real windows outgrow any static width there), on a window of 2,048
    of 5,000: rows with a long, low tail are certified and are the dense operator; a row as flat as the real
    search's uncertain steps (2,100 candidates within 1 nat) is flagged."""
    k, epsilon, n = 5, 0.3, 5000
    x = torch.randn(3, n, generator=rng, dtype=torch.float64) - 40.0
    x[:, :200] = -3.0 * torch.rand(3, 200, generator=rng, dtype=torch.float64)
    x[2, :2100] = -torch.rand(2100, generator=rng, dtype=torch.float64)
    assert default_window_width(n, k, epsilon) == n
    ranks, index, info = sorted_soft_topk_window(x, k, epsilon=epsilon, width=2048, tol=1e-6, max_iter=30,
                                                 return_info=True)
    assert info.overflow.tolist() == [False, False, True]
    dense = sorted_soft_topk(x[:2], k, epsilon=epsilon, tol=1e-11)
    assert float((_scattered(ranks, index, n)[:2] - dense).abs().max()) < 1e-6


def test_the_capture_script_samples_and_cuts_rows():
    """capture_beam_steps.fixture_arrays: a seeded sample of rows in (sentence, step) order, each its best
    ``keep`` scores sorted, with the row's candidate and finite counts; checkpoint_arch reads both shipped
    checkpoints' architectures (the Transformer's model config is an argparse.Namespace)."""
    capture = script_module("diagnostics/capture_beam_steps.py")
    rows = [(sentence, step, torch.tensor([float(step), -math.inf, -1.0 - sentence, 5.0 + sentence]))
            for sentence in (7, 3) for step in range(3)]
    arrays = capture.fixture_arrays(rows, 4, 2, seed=0)
    order = list(zip(arrays["sentence"].tolist(), arrays["step"].tolist()))
    assert len(order) == 4 and order == sorted(order) and len(set(order)) == 4
    for (sentence, step), best in zip(order, arrays["scores"]):
        assert best.tolist() == [5.0 + sentence, float(step)]
    assert arrays["n"].tolist() == [4] * 4 and arrays["n_finite"].tolist() == [3] * 4
    from fairseq_softtopk.experiments.checkpoint_sample import checkpoint_arch
    import fairseq_softtopk

    fairseq_softtopk.register()  # the safe globals that load the Namespace
    arch = {name: checkpoint_arch(torch.load(REPO / "checkpoints" / name / "checkpoint_best.pt", map_location="cpu",
                                             weights_only=True))
            for name in ("multi30k_en_de_transformer_tf", "demo_lstm_tf")}
    assert arch == {"multi30k_en_de_transformer_tf": "softtopk_transformer_prenorm_multi30k",
                    "demo_lstm_tf": "softtopk_lstm"}
