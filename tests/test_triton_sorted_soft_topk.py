"""sorted_soft_topk's Triton kernels (``backend="triton"``) against the torch path.

As in test_triton_soft_topk.py: on a GPU the kernel tests run here on CUDA tensors; without one,
:func:`test_kernels_under_the_interpreter` runs them in a child pytest with ``TRITON_INTERPRET=1`` (Triton fixes
its mode at import). The interpreter runs each block iteration in Python, so the rows are a few hundred entries,
one or a few blocks long. Lowering to GPU code is checked by compiling both kernels for sm_90 and sm_80 (no GPU
needed). Tests that need triton skip, with the reason, where it is not installed.
"""

import math

import pytest
import torch

from triton_harness import (DEVICE, compile_without_spills, interpreter_runner, kernel_test, load_mutant,
                            load_shared_mutant, needs_triton, run_under_the_interpreter)
from fairseq_softtopk.ops import sorted_soft_topk
from fairseq_softtopk.ops.kernels import (KernelFallbackWarning, backend as backend_module, fallback_counts,
                                          reset_fallback_counts)
from fairseq_softtopk.ops.kernels import soft_topk_op, sorted_soft_topk_op



@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """Every kernel test of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "test_kernel_")


@pytest.fixture
def kernel_calls(monkeypatch):
    """A list that grows by one for each call sent to the kernels."""
    calls, kernel = [], sorted_soft_topk_op.sorted_soft_topk_kernel

    def counted(*args, **kwargs):
        calls.append(args[2])  # k
        return kernel(*args, **kwargs)

    monkeypatch.setattr(sorted_soft_topk_op, "sorted_soft_topk_kernel", counted)
    return calls


def _run(x, k, backend, weights, **kwargs):
    leaf = x.detach().clone().to(DEVICE).requires_grad_()
    if kwargs.get("mask") is not None:
        kwargs["mask"] = kwargs["mask"].to(DEVICE)
    out, info = sorted_soft_topk(leaf, k, backend=backend, return_info=True, warn=False, **kwargs)
    grad, = torch.autograd.grad((out * weights.to(DEVICE)).sum(), leaf)
    return out.detach().cpu(), grad.cpu(), info


def assert_matches_torch(x, k, rng, **kwargs):
    """The kernels give the torch path's values and gradients on ``x`` (float64, solved to ``tol`` 1e-12: to
    1e-11; float32 at the default tolerance: values to 2e-6, gradients to 1e-4 of their largest, the float32
    floor of both paths where entries near 1 cancel), converged, with the info's fields as tensors."""
    dim = kwargs.get("dim", -1)
    weights = torch.randn(*x.movedim(dim, -1).shape, k, generator=rng, dtype=torch.float64).to(x.dtype)
    weights = weights.movedim(-2, dim if dim >= 0 else x.dim() + dim)
    if x.dtype == torch.float64:
        kwargs.setdefault("tol", 1e-12)
    out_t, grad_t, info_t = _run(x, k, "torch", weights, **kwargs)
    out_k, grad_k, info_k = _run(x, k, "triton", weights, **kwargs)
    assert all(isinstance(v, torch.Tensor) for v in (info_k.n_iter, info_k.marginal_error, info_k.converged))
    assert out_k.shape == out_t.shape and out_k.dtype == x.dtype
    assert bool(info_k.converged) and info_t.converged, (info_k, info_t)
    assert 0 <= int(info_k.n_iter) <= kwargs.get("max_iter", 50)
    atol = (1e-11, 1e-10) if x.dtype == torch.float64 else (2e-6, 1e-4)
    torch.testing.assert_close(out_k, out_t, rtol=0, atol=atol[0])
    torch.testing.assert_close(grad_k, grad_t, rtol=0, atol=atol[1] * float(grad_t.abs().max()))


def _scores(rng, rows, n, dtype, excluded=0, masked=0, largest=True):
    """Standard normal scores; row 0's first ``excluded`` entries the losing infinity, row 1's first ``masked``
    entries masked. Returns ``(scores, mask or None)``."""
    x = torch.randn(rows, n, generator=rng, dtype=torch.float64).to(dtype)
    x[0, :excluded] = -math.inf if largest else math.inf
    mask = None
    if masked:
        mask = torch.zeros(rows, n, dtype=torch.bool)
        mask[1, :masked] = True
    return x, mask


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_masks_and_infinities_match_the_torch_path(rng, dtype):
    x, mask = _scores(rng, 3, 600, dtype, excluded=40, masked=100)
    assert_matches_torch(x, 5, rng, epsilon=0.1, mask=mask)


@kernel_test
def test_kernel_ties_and_extreme_k_match_the_torch_path(rng):
    """Tied scores; k = 1 at a small epsilon; k = n - 1 and k = n (no rest anchor: a full soft sort), the latter
    also as a masked row keeping exactly k entries."""
    ties = torch.randint(0, 6, (2, 300), generator=rng).double()
    assert_matches_torch(ties, 4, rng, epsilon=0.3)
    x, _ = _scores(rng, 2, 400, torch.float32)
    assert_matches_torch(x, 1, rng, epsilon=0.05)
    x, _ = _scores(rng, 2, 20, torch.float64)
    assert_matches_torch(x, 19, rng, epsilon=0.2)
    assert_matches_torch(x, 20, rng, epsilon=0.2)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[1, 12:] = True
    assert_matches_torch(x, 8, rng, epsilon=0.2, mask=mask)


@kernel_test
def test_kernel_rows_longer_than_a_block_match_the_torch_path(rng, monkeypatch):
    """Five blocks of 64 per pass, the last one partly outside the row."""
    monkeypatch.setattr(sorted_soft_topk_op, "INTERPRETER_MAX_TILE", 1024)
    monkeypatch.setattr(sorted_soft_topk_op, "MAX_TILE", 1024)
    assert sorted_soft_topk_op.block_size(300, 5, interpret=DEVICE == "cpu") == 64
    x, mask = _scores(rng, 2, 300, torch.float32, excluded=10, masked=70)
    assert_matches_torch(x, 5, rng, epsilon=0.05, mask=mask)


@kernel_test
@pytest.mark.parametrize("cost", ["linear", "sqeuclidean", "paper"])
def test_kernel_other_dims_smallest_and_costs_match_the_torch_path(rng, cost):
    x = torch.randn(2, 150, 2, generator=rng, dtype=torch.float64)
    assert_matches_torch(x, 3, rng, epsilon=0.3, dim=1, largest=False, cost=cost)


@kernel_test
def test_kernel_matches_unrolled_sinkhorn(rng, kernel_calls):
    """An independent reference: log-domain Sinkhorn, differentiated through its unrolled iterations."""
    from ot_reference import sinkhorn_topk

    x = torch.randn(2, 13, generator=rng, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 13, 4, generator=rng, dtype=torch.float64)
    ref = sinkhorn_topk(x, 4, 0.5, sorted=True)
    g_ref, = torch.autograd.grad((ref * weights).sum(), x)
    leaf = x.detach().to(DEVICE).requires_grad_()
    ours = sorted_soft_topk(leaf, 4, epsilon=0.5, tol=1e-13, backend="triton")
    g_ours, = torch.autograd.grad((ours * weights.to(DEVICE)).sum(), leaf)
    assert kernel_calls == [4]
    torch.testing.assert_close(ours.detach().cpu(), ref.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(g_ours.cpu(), g_ref, rtol=0, atol=1e-8 * float(g_ref.abs().max()))


@kernel_test
def test_kernel_gradcheck_float64(rng, kernel_calls):
    x = torch.randn(1, 6, generator=rng, dtype=torch.float64).to(DEVICE).requires_grad_()
    mask = torch.tensor([[False, True, False, False, False, False]], device=DEVICE)
    assert torch.autograd.gradcheck(
        lambda v: sorted_soft_topk(v, 3, epsilon=0.4, tol=1e-13, mask=mask, backend="triton"), (x,), fast_mode=True)
    assert kernel_calls and set(kernel_calls) == {3}


def opcheck_plan_ops(forward, backward, x, mask, rng, max_iter, *options):
    """``torch.library.opcheck`` of a sorted plan op ``forward`` (on ``x``'s rows prepared for k = 3, epsilon 0.3,
    the linear cost, ``mask``; its arguments then ``options``) and of ``backward`` on the plan it gives."""
    from fairseq_softtopk.ops._common import oriented_rows, prepare_scores

    prep = prepare_scores(x, 3, -1, True, 0.3, mask, "linear", 3)
    args = (oriented_rows(x, -1, prep), prep.z, prep.valid, prep.eps, prep.grad_eps, prep.top, prep.n_valid,
            3, 1e-10, max_iter, True, *options)
    torch.library.opcheck(forward, args)
    plan = forward(*args)[0]
    grad = torch.randn(plan.shape, generator=rng, dtype=torch.float64).to(DEVICE)
    torch.library.opcheck(backward, (plan.detach(), grad, prep.grad_eps, prep.n_valid == 3))


@kernel_test
def test_kernel_ops_pass_opcheck(rng):
    x, mask = _scores(rng, 2, 60, torch.float64, masked=10)
    opcheck_plan_ops(torch.ops.fairseq_softtopk.sorted_soft_topk_forward.default,
                     torch.ops.fairseq_softtopk.sorted_soft_topk_backward.default, x.to(DEVICE).requires_grad_(),
                     mask.to(DEVICE), rng, 50)


@kernel_test
def test_kernel_gradient_scales_with_the_loss(rng, kernel_calls):
    """The gradient of ``c * L`` is ``c`` times the gradient of ``L`` (exactly for a power of two)."""
    x = torch.randn(2, 200, generator=rng).to(DEVICE).requires_grad_()
    weights = torch.randn(2, 200, 4, generator=rng).to(DEVICE)
    out = sorted_soft_topk(x, 4, epsilon=0.1, backend="triton")
    grads = [torch.autograd.grad((c * out * weights).sum(), x, retain_graph=True)[0] for c in (1.0, 1024.0, 1e-3)]
    assert kernel_calls == [4]
    torch.testing.assert_close(grads[1], 1024.0 * grads[0], rtol=0, atol=0)
    # 1e-3 rounds: entries whose sums cancel move by the rounding of the largest
    torch.testing.assert_close(grads[2], 1e-3 * grads[0], rtol=1e-5, atol=1e-6 * float(grads[2].abs().max()))


@kernel_test
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN slice:RuntimeWarning")
def test_kernel_fixed_iterations_and_info_tensors(rng):
    """fixed_iterations=True runs the kernels, each row stopping when it converges (n_iter below the budget);
    a budget too small is reported as the torch path reports it; empty batches and NaN data."""
    x = torch.randn(3, 200, generator=rng).to(DEVICE)
    out_f, info_f = sorted_soft_topk(x, 4, epsilon=0.1, max_iter=20, fixed_iterations=True, return_info=True,
                                     backend="triton")
    out_t = sorted_soft_topk(x, 4, epsilon=0.1, max_iter=20, fixed_iterations=True, backend="torch")
    assert bool(info_f.converged) and int(info_f.n_iter) < 20
    torch.testing.assert_close(out_f, out_t, rtol=0, atol=1e-5)
    with pytest.warns(Warning, match="stopped above its tolerance"):
        _, info = sorted_soft_topk(x, 4, epsilon=0.02, max_iter=1, return_info=True, backend="triton")
    assert not bool(info.converged) and int(info.n_iter) == 1 and float(info.marginal_error) > 1e-5
    assert sorted_soft_topk(torch.empty(0, 5, device=DEVICE), 2, backend="triton").shape == (0, 5, 2)
    x[1, 7] = math.nan  # unchecked data: NaN gives NaN (in that row), as on the torch path
    out, info = sorted_soft_topk(x, 4, max_iter=5, fixed_iterations=True, return_info=True, backend="triton")
    assert out.isnan().flatten(1).any(1).tolist() == [False, True, False] and not bool(info.converged)


@kernel_test
def test_kernel_sync_free_call_compiles_as_one_graph(rng, kernel_calls):
    """fixed_iterations=True with the kernels: torch.compile(fullgraph=True) (no graph break) gives the eager
    values and gradients."""
    x = torch.randn(2, 200, generator=rng).to(DEVICE)
    weights = torch.randn(2, 200, 4, generator=rng).to(DEVICE)

    def select(v):
        return sorted_soft_topk(v, 4, epsilon=0.1, tol=1e-6, max_iter=20, fixed_iterations=True, backend="triton")

    torch._dynamo.reset()
    results = []
    for fn in (select, torch.compile(select, fullgraph=True, backend="aot_eager")):
        v = x.clone().requires_grad_()
        out = fn(v)
        (out * weights).sum().backward()
        results.append((out.detach(), v.grad))
    assert kernel_calls  # the eager call (the compiled one traces the custom op, not this function)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.fixture
def windows(monkeypatch):
    """Rows longer than 64 entries solve on candidate windows (16 entries with ``windows.cap(16)``), in blocks of
    64 entries (KP = 16); returns an object whose ``kernel`` lists, per kernel launch, each row's last window
    width (the entries the kernel wrote to its scratch memory; ``WINDOW_MAX`` where the window overflowed), and
    whose ``torch_windows(n)`` lists the torch path's window solves of rows of ``n`` (each row's width)."""
    from fairseq_softtopk.ops import semi_dual_newton

    record = type("Windows", (), {"kernel": [], "torch": []})()
    monkeypatch.setattr(sorted_soft_topk_op, "WINDOW_MAX", 64)
    monkeypatch.setattr(sorted_soft_topk_op, "INTERPRETER_MAX_TILE", 1024)
    monkeypatch.setattr(sorted_soft_topk_op, "MAX_TILE", 1024)
    record.cap = lambda wmax: monkeypatch.setattr(sorted_soft_topk_op, "WINDOW_MAX", wmax)
    buffer, solve = sorted_soft_topk_op.window_buffer, semi_dual_newton._solve_rows

    def filled(z, rows, wmax):  # NaN until written
        window = buffer(z, rows, wmax).fill_(math.nan)
        record.kernel.append(window)
        return window

    def solve_rows(problem, *args, **kwargs):
        record.torch.append((problem.z.shape[-1], problem.n_valid.long().tolist()))
        return solve(problem, *args, **kwargs)

    monkeypatch.setattr(sorted_soft_topk_op, "window_buffer", filled)
    monkeypatch.setattr(semi_dual_newton, "_solve_rows", solve_rows)
    # the torch path's windows: its solves of fewer columns than the rows'
    record.torch_windows = lambda n: [widths for columns, widths in record.torch if columns < n]
    record.widths = lambda: [(~window.isnan()).sum(-1).tolist() for window in record.kernel]
    return record


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_long_rows_solve_on_the_torch_paths_window(rng, windows, dtype):
    """Rows of 300 entries at a small epsilon: the kernel's windows are the torch path's (a masked row and one
    with excluded entries among them); a row with 100 entries near its top overflows the 64 entries of scratch
    memory and solves the whole row. Values and gradients as the torch path's."""
    x, mask = _scores(rng, 4, 300, dtype, excluded=30, masked=80)
    x[3, :100] = (3.0 + 0.01 * torch.randn(100, generator=rng, dtype=torch.float64)).to(dtype)
    assert_matches_torch(x, 5, rng, epsilon=0.02, mask=mask)
    torch_windows = windows.torch_windows(300)
    assert len(torch_windows) == 1 and windows.widths() == [torch_windows[0][:3] + [64]], (windows.widths(),
                                                                                          torch_windows)
    assert 5 < max(torch_windows[0][:3]) < 64 < torch_windows[0][3]


@kernel_test
def test_kernel_widens_an_uncertified_window(rng, windows, monkeypatch):
    """A first floor half an epsilon below the (k+1)-th best (the torch path's lies ``2 - margin`` epsilons below:
    its first window passes): the entries just below it carry more than the margin at the window's solution, the
    kernel widens the window by ``2 - margin`` epsilons, as the torch path does, and solves again."""
    floor_of = sorted_soft_topk_op.window_floor
    first = []

    def high_floor(top, n_valid, eps, k, tol):
        floor, margin = floor_of(top, n_valid, eps, k, tol)
        first.append((top[:, k] - 0.5 * eps.reshape(-1), margin, eps.reshape(-1)))
        return first[-1][0], margin

    monkeypatch.setattr(sorted_soft_topk_op, "window_floor", high_floor)
    x = torch.randn(2, 300, generator=rng, dtype=torch.float64)
    assert_matches_torch(x, 5, rng, epsilon=0.03)
    from fairseq_softtopk.ops._common import prepare_scores

    z = prepare_scores(x.to(DEVICE), 5, -1, True, 0.03, None, "linear", 5).z  # the device the kernel's floors are on
    floor, margin, eps = first[0]
    widened = floor + (margin - 2.0) * eps
    assert windows.widths() == [(z >= widened[:, None]).sum(-1).tolist()]
    assert ((z >= floor[:, None]).sum(-1) < (z >= widened[:, None]).sum(-1)).all()


@kernel_test
def test_kernel_windows_of_extreme_k_and_masked_rows_match_the_torch_path(rng, windows):
    """16 entries of scratch memory, rows of 20: k = n - 1 (the window holds the whole row: it overflows); a masked
    row of k + 1 valid entries, and one of exactly k (no rest anchor: every valid entry, no floor), on windows."""
    windows.cap(16)
    x, _ = _scores(rng, 2, 20, torch.float64)
    assert_matches_torch(x, 19, rng, epsilon=0.2)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[1, 14:] = True
    assert_matches_torch(x, 13, rng, epsilon=0.2, mask=mask)
    mask[1, 12:] = True
    assert_matches_torch(x, 12, rng, epsilon=0.2, mask=mask)
    assert [widths[1] for widths in windows.widths()] == [16, 14, 12]


@kernel_test
@pytest.mark.parametrize("old, new, check", [
    ("n_solved = m.to(tl.float64)", "n_solved = n_valid", "long-rows"),  # the window solved as the whole row
    ("if tl.where(rank_logit < margin, 0, 1) != 0:", "if tl.where(rank_logit < margin, 0, 0) != 0:", "widen"),
], ids=["window-rest-target", "no-certification"])
def test_kernel_window_mutant_fails_its_test(rng, windows, monkeypatch, tmp_path, old, new, check):
    """Each window test fails on a kernel whose window is broken: solved with the whole row's rest target, or
    never certified."""
    load_mutant(sorted_soft_topk_op, monkeypatch, tmp_path, old, new)
    with pytest.raises(AssertionError):
        if check == "long-rows":
            test_kernel_long_rows_solve_on_the_torch_paths_window(rng, windows, torch.float64)
        else:
            test_kernel_widens_an_uncertified_window(rng, windows, monkeypatch)


@pytest.mark.parametrize("k, limits, reason, message", [
    (32, {}, "rank_count", r"more ranks than the kernels hold in registers \(the sorted operators: k <= 31\)"),
    (4, {"MAX_PLAN_ENTRIES": 5 * 45 - 1}, "row_length", r"rows longer than the kernels' int32 offsets reach"),
], ids=["k-above-the-cap", "plan-beyond-int32"])
def test_calls_the_kernels_cannot_take_run_the_torch_path_and_are_counted(rng, monkeypatch, k, limits, reason,
                                                                           message):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernels ran")

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # "triton" resolves to the kernels on CPU tensors
    monkeypatch.setattr(backend_module, "_triton_import_error", "")
    monkeypatch.setattr(sorted_soft_topk_op, "sorted_soft_topk_kernel", no_kernel)
    for name, value in limits.items():
        monkeypatch.setattr(sorted_soft_topk_op, name, value)
    x = torch.randn(2, 45, generator=rng, dtype=torch.float64)
    expected = sorted_soft_topk(x, k, epsilon=0.3, backend="torch")
    reset_fallback_counts()
    with pytest.warns(KernelFallbackWarning, match=rf"sorted_soft_topk: the Triton kernels cannot take this call "
                                                   rf"\({message}\); it ran on the torch path"):
        got = sorted_soft_topk(x, k, epsilon=0.3, backend="triton")
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert fallback_counts() == {reason: 1}
    sorted_soft_topk(x, k, epsilon=0.3, backend="auto")  # CPU tensors: the torch path, not a fallback
    assert fallback_counts() == {reason: 1}
    with pytest.raises(ValueError, match=r"backend must be one of \('torch', 'triton', 'auto'\), got 'gpu'"):
        sorted_soft_topk(x, k, backend="gpu")
    reset_fallback_counts()
    assert sorted_soft_topk_op.MAX_K == 31 and sorted_soft_topk_op.anchor_lanes(31) == 32


def test_fake_implementations_give_shapes_and_dtypes_on_the_meta_device():
    rows, n, k = 3, 50, 4
    for dtype in (torch.float32, torch.float64):
        def meta(*shape, dtype=dtype):
            return torch.empty(*shape, dtype=dtype, device="meta")

        plan, n_iter, err = torch.ops.fairseq_softtopk.sorted_soft_topk_forward(
            meta(rows, n), meta(rows, n), meta(rows, n, dtype=torch.bool), meta(rows, 1), meta(rows, 1),
            meta(rows, k + 1), meta(rows), k, 1e-5, 50, True)
        assert (plan.shape, plan.dtype, plan.device.type) == ((rows, k + 1, n), dtype, "meta")
        assert (n_iter.shape, n_iter.dtype, err.shape, err.dtype) == ((rows,), torch.int32, (rows,), torch.float64)
        grad = torch.ops.fairseq_softtopk.sorted_soft_topk_backward(plan, meta(rows, k + 1, n), meta(rows, 1),
                                                                    meta(rows, dtype=torch.bool))
        assert (grad.shape, grad.dtype, grad.device.type) == ((rows, n), dtype, "meta")


#: the kernels' arguments (pointer types with D for the scores' dtype); the test fails if a kernel's change
_SIGNATURES = {
    "_sorted_forward_kernel": dict(Z="*D", VALID="*u8", EPS="*D", N_VALID="*D", G0="*fp64", FLOOR="*D",
                                   MARGIN="*fp64", WIN="*D", PLAN="*D", N_ITER="*i32", ERR="*fp64", n="i32", k="i32",
                                   tol_hi="fp32", tol_lo="fp32", max_iter="i32", CUT="fp32", RIDGE="fp32"),
    "_sorted_backward_kernel": dict(PLAN="*D", GRAD="*D", EPS="*D", NO_REST="*u8", GRAD_Z="*D", n="i32", k="i32",
                                    RIDGE="fp32"),
}


#: register spills (bytes a thread) of the one-program forward kernel compiled for sm_90 by the oldest supported
#: triton (the GPU machines' 3.6.0; the pinned triton spills nothing), measured with ``ptxas -v``: they must not grow
KNOWN_SPILLS = {("3.6.0", "_sorted_forward_kernel", "fp32", 32): 80, ("3.6.0", "_sorted_forward_kernel", "fp64", 16): 36}


@needs_triton
@pytest.mark.skipif(backend_module.interpreter_requested(), reason="under the interpreter, triton compiles nothing")
@pytest.mark.parametrize("arch, dtype, k", [(90, "fp32", 31), (90, "fp64", 15), (80, "fp32", 15), (80, "fp64", 31),
                                            (90, "fp32", 5), (90, "fp64", 7), (80, "fp32", 7), (80, "fp64", 5)])
def test_every_kernel_compiles_for_the_gpu(arch, dtype, k, monkeypatch, tmp_path):
    """Ahead-of-time compilation to a cubin (no GPU needed), as the launchers compile them: both dtypes on sm_90 and
    sm_80 (float64: the float64 ``tl.dot``), in tiles at both widths (KP 16 and 32, k up to 31) and with the anchors
    unrolled (k = 5 and 7); lowering errors the interpreter lets through fail here, and so does a register spill
    (``ptxas -v``) beyond the known ones (:data:`KNOWN_SPILLS`)."""
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled now, not found in a cache
    module = sorted_soft_topk_op.kernel_module()
    lanes = sorted_soft_topk_op.anchor_lanes(k)
    unrolled_block = sorted_soft_topk_op.block_size(10 ** 6, k, interpret=False, unroll=True)
    backward_options = sorted_soft_topk_op.pass_options(unrolled_block, k)
    anchors = backward_options.pop("K1")
    assert anchors == (k + 1 if k <= 7 else 0)
    for name, signature in _SIGNATURES.items():
        if "HAS_MASK" in getattr(module, name).arg_names:  # the forward: with a mask, on candidate windows
            block = sorted_soft_topk_op.block_size(10 ** 6, k, interpret=False)
            constexprs = dict(BLOCK=block, KP=lanes, K1=anchors, HAS_MASK=True, WMAX=sorted_soft_topk_op.WINDOW_MAX)
            options = soft_topk_op._launch_options(block * lanes)
        else:
            constexprs = dict(BLOCK=unrolled_block, KP=lanes, K1=anchors)
            options = backward_options
        known = KNOWN_SPILLS.get((triton.__version__, name, dtype, lanes), 0) if arch == 90 else 0
        compile_without_spills(getattr(module, name), signature, constexprs, arch, dtype, options, tmp_path, name,
                               known)


@kernel_test
@pytest.mark.parametrize("old, new, k", [
    ("K = tl.where(ri == ci, diagonal, -off)", "K = tl.where(ri == ci, diagonal, off)", 4),  # the Hessian's sign
    # the backward's implicit term dropped (the passes' file): in (BLOCK, KP) tiles (k + 1 > 8 anchors), unrolled
    ("Pu = tl.sum(P * u, axis=1)", "Pu = 0.0 * tl.sum(P * u, axis=1)", 9),
    ("Pu += P[r] * u_lanes[r]", "Pu += 0.0 * P[r] * u_lanes[r]", 4),
], ids=["hessian-sign", "backward-implicit-tiles", "backward-implicit-unrolled"])
def test_kernel_mutant_fails_the_comparison(rng, monkeypatch, tmp_path, old, new, k):
    x, _ = _scores(rng, 2, 200, torch.float32)
    assert_matches_torch(x, k, rng, epsilon=0.2)  # the kernels as they are pass
    if old in sorted_soft_topk_op.PASSES_FILE.read_text():
        load_shared_mutant(sorted_soft_topk_op.PASSES_FILE, "_evaluate", [sorted_soft_topk_op], monkeypatch, tmp_path,
                           old, new)
    else:
        load_mutant(sorted_soft_topk_op, monkeypatch, tmp_path, old, new)
    with pytest.raises(AssertionError):
        assert_matches_torch(x, k, rng, epsilon=0.2)


@kernel_test
def test_kernel_path_names_its_profiler_ranges_as_the_torch_path(rng):
    """bench_train and bench_attention attribute launches by these ranges: the kernels' backward has the torch path's."""
    leaf = torch.randn(2, 300, generator=rng).to(DEVICE).requires_grad_()
    names = {}
    for backend in ("torch", "triton"):
        with torch.profiler.profile() as prof:
            sorted_soft_topk(leaf, 3, backend=backend).sum().backward()
        names[backend] = {e.name for e in prof.events() if e.name.startswith("softtopk::")}
    assert names["triton"] == names["torch"] == {"softtopk::sorted_soft_topk", "softtopk::sorted_soft_topk_backward"}


@kernel_test
@pytest.mark.parametrize("fixed_iterations", [False, True])
def test_kernel_beam_search_step_selects_as_the_torch_path(rng, fixed_iterations, monkeypatch):
    """select_beams with ``backend="triton"`` on the dense operator (the adaptive window, ``window_width=0``, and
    the fixed-iteration search): the same candidates, beam weights and gradients as the torch path. (The default
    search's static window has its own kernels: tests/test_triton_sorted_soft_topk_window.py.)"""
    from fairseq_softtopk.modules.beam_search_config import BeamSearchConfig
    from fairseq_softtopk.modules.beam_selection import select_beams

    launched, kernel = [], sorted_soft_topk_op.sorted_soft_topk_kernel
    monkeypatch.setattr(sorted_soft_topk_op, "sorted_soft_topk_kernel",
                        lambda *args: launched.append(1) or kernel(*args))

    scores = (3.0 * torch.randn(2, 90, generator=rng)).log_softmax(-1).to(DEVICE)
    weights = torch.randn(2, 90, 3, generator=rng).to(DEVICE)
    results = {}
    for backend in ("torch", "triton"):
        leaf = scores.clone().requires_grad_()
        config = BeamSearchConfig(beam=3, epsilon=0.1, tol=1e-5, max_iter=30, fixed_iterations=fixed_iterations,
                                  backend=backend, selection_grad="full", window_width=0)
        selection = select_beams(leaf, 3, config, leaf.detach().topk(4).values[:, -1:])
        dense = torch.zeros(2, 90, 3, device=DEVICE).scatter_add(
            1, selection.candidates.unsqueeze(-1).expand(-1, -1, 3), selection.weights)
        grad, = torch.autograd.grad((dense * weights).sum(), leaf)
        results[backend] = (dense.detach().cpu(), grad.cpu())
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=0, atol=2e-6)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], rtol=1e-4, atol=1e-4)
    assert results["torch"][1].abs().max() > 1e-2  # the selection's gradient is there to compare
    assert launched == [1]  # the torch path's call did not launch, the kernels' did


@kernel_test
def test_kernel_sync_free_solve_never_waits_and_launches_a_few_operations(rng):
    """The kernels' claim, counted as tests/test_dispatch_count.py counts the torch path: with
    ``fixed_iterations=True`` forward and backward read nothing on the host (the default checks read a few
    values), and the solve is a handful of dispatched operations where the torch path's is over 15 per
    iteration."""
    from fairseq_softtopk.dispatch_count import DispatchCounter

    scores = torch.randn(6, 40, generator=rng).to(DEVICE).requires_grad_()
    grad = torch.randn(6, 40, 3, generator=rng).to(DEVICE)
    counts = {}
    for backend in ("torch", "triton"):
        for fixed in (False, True):
            with DispatchCounter() as counter:
                A = sorted_soft_topk(scores, 3, epsilon=0.1, max_iter=15, fixed_iterations=fixed, warn=False,
                                     backend=backend)
                (A * grad).sum().backward()
            counts[backend, fixed] = (counter.total("syncs"), counter.total("launches", inside="sorted_soft_topk"),
                                      counter.total("launches", inside="sorted_soft_topk_backward"))
    assert counts["triton", True][0] == 0 and counts["torch", True][0] == 0
    assert counts["triton", False][0] > 0  # the data checks of the default call
    assert counts["triton", True][1] < 40 < counts["torch", True][1]  # one kernel launch among the preparation's
    assert counts["triton", True][2] == counts["triton", False][2] == 1 < counts["torch", True][2]  # one launch
