"""soft_topk's Triton kernels (``backend="triton"``) against the torch path.

On a GPU the kernel tests run here on CUDA tensors. Without one they run on CPU tensors under Triton's
interpreter, which must be chosen before anything imports triton (Triton fixes the mode of its own library at
import, and torch.compile imports it): :func:`test_kernels_under_the_interpreter` runs them in a child pytest
with ``TRITON_INTERPRET=1``, so that no other test's process changes. The interpreter executes the kernels
block by block in Python, so the rows here are a few thousand entries, one or a few blocks long. What it cannot
see (lowering to GPU code) is checked by compiling every kernel ahead of time for sm_90 and sm_80, which needs
no GPU. Tests that need triton skip, with the reason, where it is not installed.
"""

import math

import pytest
import torch

from conftest import script_module
from triton_harness import (DEVICE, IN_PROCESS, interpreter_runner, kernel_test, load_mutant, needs_triton,
                            run_under_the_interpreter)
from fairseq_softtopk.ops import SoftTopKConvergenceWarning, soft_topk
from fairseq_softtopk.ops.kernels import (KernelFallbackWarning, backend as backend_module, fallback_counts,
                                          reset_fallback_counts, resolve_backend)
from fairseq_softtopk.ops.kernels import soft_topk_op



@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """Every kernel test of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "not test_kernels_under_the_interpreter and not compiles_for_the_gpu"
                                                   " and not after_triton_was_imported")


def _run(x, k, backend, weights, **kwargs):
    leaf = x.detach().clone().to(DEVICE).requires_grad_()
    weights = weights.to(DEVICE)
    if kwargs.get("mask") is not None:
        kwargs["mask"] = kwargs["mask"].to(DEVICE)
    out, info = soft_topk(leaf, k, backend=backend, return_info=True, warn=False, **kwargs)
    grad, = torch.autograd.grad((out * weights).sum(), leaf)
    return out.detach().cpu(), grad.cpu(), info


def assert_matches_torch(x, k, rng, **kwargs):
    """The kernels give the torch path's values, gradients and info on ``x`` (float64: to rounding; float32:
    values to 1e-6), and float32 results lie as close to the float64 solution as the tolerance allows."""
    weights = torch.randn(x.shape, generator=rng, dtype=torch.float64).to(x.dtype)
    out_t, grad_t, info_t = _run(x, k, "torch", weights, **kwargs)
    out_k, grad_k, info_k = _run(x, k, "triton", weights, **kwargs)
    assert all(isinstance(v, torch.Tensor) for v in (info_k.n_iter, info_k.marginal_error, info_k.converged))
    assert out_k.shape == x.shape and out_k.dtype == x.dtype
    if x.dtype == torch.float64:
        torch.testing.assert_close(out_k, out_t, rtol=0, atol=1e-12)
        torch.testing.assert_close(grad_k, grad_t, rtol=0, atol=1e-10 * float(grad_t.abs().max()))
        assert int(info_k.n_iter) == info_t.n_iter and bool(info_k.converged) == info_t.converged
        assert float(info_k.marginal_error) == pytest.approx(info_t.marginal_error, rel=1e-6, abs=1e-13)
        return
    n = x.shape[kwargs.get("dim", -1)]
    denom = max(1, min(k, n - k))  # a marginal error e moves an entry by at most e * denom
    tol = kwargs.get("tol", 1e-5)
    torch.testing.assert_close(out_k, out_t, rtol=0, atol=1e-6)
    # the torch path sums float32 in float32, the kernels in float64: at k = n - 1 its gradient moves by 6e-5
    torch.testing.assert_close(grad_k, grad_t, rtol=0, atol=1e-4 * float(grad_t.abs().max()))
    assert bool(info_k.converged) and info_t.converged and float(info_k.marginal_error) <= tol
    assert abs(int(info_k.n_iter) - info_t.n_iter) <= 2
    exact = soft_topk(x.double(), k, warn=False, **dict(kwargs, tol=1e-12))
    torch.testing.assert_close(out_k.double(), exact, rtol=0, atol=max(1e-6, 2 * denom * tol))


def _scores(rng, rows, n, dtype, largest=True, excluded=0, masked=0):
    """Standard normal scores; row 0's first ``excluded`` entries are the losing infinity, row 1's first
    ``masked`` entries masked. Returns ``(scores, mask or None)``."""
    x = torch.randn(rows, n, generator=rng, dtype=torch.float64).to(dtype)
    x[0, :excluded] = -math.inf if largest else math.inf
    mask = None
    if masked:
        mask = torch.zeros(rows, n, dtype=torch.bool)
        mask[1, :masked] = True
    return x, mask


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masks_and_infinities_match_the_torch_path(rng, dtype):
    x, mask = _scores(rng, 3, 3000, dtype, excluded=50, masked=100)
    assert_matches_torch(x, 5, rng, epsilon=0.1, mask=mask)


@kernel_test
@pytest.mark.parametrize("k, epsilon", [(1, 1e-3), (1999, 3.0)], ids=["k=1,small-eps", "k=n-1,large-eps"])
def test_extreme_k_and_epsilon_match_the_torch_path(rng, k, epsilon):
    x, _ = _scores(rng, 2, 2000, torch.float32)
    assert_matches_torch(x, k, rng, epsilon=epsilon)


@kernel_test
def test_full_rows_and_smallest_match_the_torch_path(rng):
    """Row 1 keeps exactly k valid entries (every one selected, no threshold exists); largest=False excludes
    ``+inf``."""
    x, mask = _scores(rng, 3, 1500, torch.float64, largest=False, excluded=30, masked=500)
    assert_matches_torch(x, 1000, rng, epsilon=0.05, mask=mask, largest=False)


@kernel_test
def test_ties_match_the_torch_path(rng):
    x = torch.randint(0, 20, (2, 2500), generator=rng).float()
    assert_matches_torch(x, 37, rng, epsilon=0.05)


@kernel_test
def test_rows_longer_than_a_block_match_the_torch_path(rng, monkeypatch):
    """Six blocks of 512 per pass, the last one partly outside the row."""
    monkeypatch.setattr(soft_topk_op, "INTERPRETER_MAX_BLOCK", 512)
    monkeypatch.setattr(soft_topk_op, "MAX_BLOCK", 512)
    assert soft_topk_op.block_size(3000, interpret=DEVICE == "cpu") == 512
    x, mask = _scores(rng, 2, 3000, torch.float32, excluded=10, masked=700)
    assert_matches_torch(x, 20, rng, epsilon=0.02, mask=mask)


@kernel_test
def test_other_dims_costs_and_half_precision_match_the_torch_path(rng):
    x = torch.randn(2, 700, 3, generator=rng, dtype=torch.float64)
    assert_matches_torch(x, 6, rng, epsilon=0.2, dim=1, cost="paper")
    half = torch.randn(2, 900, generator=rng).to(DEVICE, torch.bfloat16)
    out_t = soft_topk(half, 4, epsilon=0.3)
    out_k = soft_topk(half, 4, epsilon=0.3, backend="triton")
    assert out_k.dtype == torch.bfloat16
    torch.testing.assert_close(out_k, out_t, rtol=0, atol=4e-3)  # bf16 rounding of the same float32 results


@kernel_test
def test_gradcheck_float64(rng):
    x = torch.randn(2, 8, generator=rng, dtype=torch.float64).to(DEVICE).requires_grad_()
    mask = torch.zeros(2, 8, dtype=torch.bool, device=DEVICE)
    mask[1, :2] = True
    assert torch.autograd.gradcheck(
        lambda v: soft_topk(v, 3, epsilon=0.3, tol=1e-13, mask=mask, backend="triton"), (x,))


@kernel_test
def test_the_ops_pass_opcheck(rng):
    from fairseq_softtopk.ops._common import oriented_rows, prepare_scores

    x, mask = _scores(rng, 3, 200, torch.float64, masked=20)
    x = x.to(DEVICE).requires_grad_()
    prep = prepare_scores(x, 4, -1, True, 0.3, mask.to(DEVICE), "linear", 1)
    args = (oriented_rows(x, -1, prep), prep.z, prep.valid, prep.eps, prep.grad_eps, prep.top, prep.n_valid,
            4, 1e-10, 50, True)
    torch.library.opcheck(torch.ops.fairseq_softtopk.soft_topk_forward.default, args)
    logits = soft_topk_op.soft_topk_forward(*args)[1]
    grad = torch.randn(3, 200, generator=rng, dtype=torch.float64).to(DEVICE)
    torch.library.opcheck(torch.ops.fairseq_softtopk.soft_topk_backward.default, (logits, grad, prep.grad_eps))


@kernel_test
def test_the_sync_free_call_compiles_as_one_graph(rng):
    """fixed_iterations=True with the kernels: torch.compile(fullgraph=True) (no graph break) gives the eager
    values and gradients."""
    x = torch.randn(2, 500, generator=rng).to(DEVICE)
    weights = torch.randn(2, 500, generator=rng).to(DEVICE)

    def select(v):
        return soft_topk(v, 4, epsilon=0.05, tol=1e-6, max_iter=30, fixed_iterations=True, backend="triton")

    torch._dynamo.reset()
    results = []
    for fn in (select, torch.compile(select, fullgraph=True, backend="aot_eager")):
        v = x.clone().requires_grad_()
        out = fn(v)
        (out * weights).sum().backward()
        results.append((out.detach(), v.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
    torch._dynamo.reset()


@kernel_test
def test_info_tensors_warnings_and_input_errors_are_the_torch_paths(rng):
    """A missed tolerance warns as the torch path does (info as tensors); bad data raises the same errors; an
    empty batch gives an empty result."""
    x = torch.randn(3, 500, generator=rng).to(DEVICE)
    with pytest.warns(SoftTopKConvergenceWarning):
        _, info = soft_topk(x, 5, epsilon=1.0, max_iter=1, return_info=True, backend="triton")
    assert not bool(info.converged) and int(info.n_iter) == 1 and float(info.marginal_error) > 1e-5
    bad = x.clone()
    bad[1, 3] = math.nan
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match="scores contain NaN"):
            soft_topk(bad, 5, backend=backend)
        with pytest.raises(ValueError, match=r"k=501 exceeds the number of valid"):
            soft_topk(x, 501, backend=backend)
    assert soft_topk(torch.empty(0, 5, device=DEVICE), 2, backend="triton").shape == (0, 5)
    one = torch.randn(3, 1, generator=rng).to(DEVICE).requires_grad_()  # rows of one entry: selected, no gradient
    out = soft_topk(one, 1, backend="triton")
    out.sum().backward()
    assert out.tolist() == [[1.0]] * 3 and one.grad.tolist() == [[0.0]] * 3


@kernel_test
def test_rows_the_kernels_cannot_take_fall_back_to_the_torch_path_and_are_reported(rng, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernels ran")

    monkeypatch.setattr(soft_topk_op, "MAX_ROW_LENGTH", 400)
    monkeypatch.setattr(soft_topk_op, "soft_topk_kernel", no_kernel)
    reset_fallback_counts()
    x = torch.randn(2, 401, generator=rng).to(DEVICE)
    with pytest.warns(KernelFallbackWarning, match="rows longer than"):
        out = soft_topk(x, 3, backend="triton")
    # backend torch: on CUDA the default (auto) would send it to the kernels, and count a second fallback
    torch.testing.assert_close(out, soft_topk(x, 3, backend="torch"), rtol=0, atol=0)
    assert fallback_counts() == {"row_length": 1}
    reset_fallback_counts()


#: the kernels' arguments (pointer types with D for the scores' dtype); the test fails if a kernel's change
_SIGNATURES = {
    "_soft_topk_threshold_kernel": dict(Z="*D", VALID="*u8", EPS="*D", TOP="*D", N_VALID="*D", S="*D", OUT="*D",
                                        N_ITER="*i32", ERR="*fp64", n="i32", top_cols="i32", k="i32", tol_hi="fp32",
                                        tol_lo="fp32", max_iter="i32"),
    "_soft_topk_backward_kernel": dict(LOGITS="*D", GRAD="*D", EPS="*D", GRAD_Z="*D", n="i32"),
    "_soft_topk_short_rows_kernel": dict(Z="*D", VALID="*u8", EPS="*D", TOP="*D", N_VALID="*D", S="*D", OUT="*D",
                                         N_ITER="*i32", ERR="*fp64", rows="i32", n="i32", top_cols="i32", k="i32",
                                         tol_hi="fp32", tol_lo="fp32", max_iter="i32"),
    "_soft_topk_short_backward_kernel": dict(LOGITS="*D", GRAD="*D", EPS="*D", GRAD_Z="*D", rows="i32", n="i32"),
}


@needs_triton
@pytest.mark.skipif(backend_module.interpreter_requested(), reason="under the interpreter, triton compiles nothing")
@pytest.mark.parametrize("arch", [90, 80])
def test_every_kernel_compiles_for_the_gpu(arch, monkeypatch, tmp_path):
    """Ahead-of-time compilation to a cubin for sm_90 / sm_80 (no GPU needed): lowering errors the interpreter
    lets through (types of loop-carried values, float64 math, scalar masked loads) fail here."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled now, not found in a cache
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    module = soft_topk_op.kernel_module()
    for name, signature in _SIGNATURES.items():
        kernel = getattr(module, name)
        constexprs = {"BLOCK": soft_topk_op.MAX_BLOCK}
        if "ROWS" in kernel.arg_names:  # the short-row kernels: 64 rows of 32 entries
            constexprs = {"BLOCK": 32, "ROWS": soft_topk_op.SHORT_TILE // 32}
        if "HAS_MASK" in kernel.arg_names:
            constexprs.update(HAS_MASK=True, LIMIT=80.0, RESOLUTION=1e-6)
        assert set(kernel.arg_names) == set(signature) | set(constexprs), name
        # Triton turns integer arguments equal to 1 into constants at launch: rows of one entry (n = k = 1)
        ones = {arg: 1 for arg in ("rows", "n", "k", "top_cols", "max_iter") if arg in signature}
        for dtype, constants in (("fp32", constexprs), ("fp64", constexprs), ("fp32", dict(constexprs, **ones))):
            types = {arg: kind.replace("D", dtype) for arg, kind in signature.items()}
            types.update({arg: "constexpr" for arg in constants})
            compiled = triton_compile(ASTSource(fn=kernel, signature=types, constexprs=constants),
                                      target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=8, enable_fp_fusion=True))
            assert compiled.asm["cubin"], (name, dtype, constants)


def _attention_rows(rng, dtype, rows=70, n=37):
    """Rows like top-k attention's: ``rows`` (not a multiple of a program's rows) of ``n`` keys; row 0 with 10
    keys at -inf, row 1 with 30 masked, row 2 with exactly 4 unmasked (k = 4: every valid key selected), rows
    3.. causal-style masks (row i keeps its first 4 + i % 33 keys), the last rows at a large scale."""
    x = torch.randn(rows, n, generator=rng, dtype=torch.float64)
    x[-5:] *= 30.0
    x[0, :10] = -math.inf
    mask = torch.arange(n).expand(rows, n) >= (4 + torch.arange(rows) % 33).unsqueeze(1)
    mask[0] = False
    mask[1] = False
    mask[1, :30] = True
    mask[2] = True
    mask[2, :4] = False
    return x.to(dtype), mask


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("epsilon", [0.01, 0.1, 1.0])
def test_short_rows_match_the_torch_path_and_the_one_row_kernels(rng, monkeypatch, dtype, epsilon):
    """Rows of at most SHORT_MAX_LENGTH entries run several to a program, each row's scores in registers: the torch
    path's values, gradients and info, and exactly (bit for bit) what the one-row kernels give."""
    x, mask = _attention_rows(rng, dtype)
    # tol 1e-6: at the default 1e-5 a float32 row may stop one iteration apart on the two paths (the kernels sum in
    # float64, the torch path in float32), its entries then 1.5e-5 apart, both within the tolerance's 2 k tol
    assert_matches_torch(x, 4, rng, epsilon=epsilon, mask=mask, tol=1e-6)
    assert soft_topk_op.rows_per_program(70, soft_topk_op.block_size(37, False)) == 32  # three programs, one partial
    weights = torch.randn(x.shape, generator=rng, dtype=torch.float64).to(dtype)
    short = _run(x, 4, "triton", weights, epsilon=epsilon, mask=mask)
    monkeypatch.setattr(soft_topk_op, "SHORT_MAX_LENGTH", 0)
    one_row = _run(x, 4, "triton", weights, epsilon=epsilon, mask=mask)
    for a, b in zip(short[:2], one_row[:2]):  # values, gradients
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (int(short[2].n_iter), float(short[2].marginal_error)) == (int(one_row[2].n_iter),
                                                                      float(one_row[2].marginal_error))


@kernel_test
def test_short_rows_of_extreme_k_and_one_row_match_the_torch_path(rng):
    x = torch.randn(5, 20, generator=rng, dtype=torch.float64)
    assert_matches_torch(x, 1, rng, epsilon=0.05)
    assert_matches_torch(x, 19, rng, epsilon=0.5)
    assert_matches_torch(x[:1], 3, rng, epsilon=0.1)


@kernel_test
@pytest.mark.parametrize("old, new, n", [
    ("sig = tl.where(inside, sig, 0.0)", "sig = tl.where(inside, sig, 1e-3)", 1000),  # the tail of a row counted
    ("_div(w, eps) * (g - mean_row)", "_div(w, eps) * g", 1000),  # the threshold's dependence on z forgotten
    # the short rows' kernels (rows of at most SHORT_MAX_LENGTH): a solve stopped early, the backward's mean dropped
    ("done = tl.where(going, t_done, done)", "done = tl.where(going, t_done | (n_iter > 1), done)", 200),
    ("(g - mean_g.to(g.dtype)[:, None])", "g", 200),
], ids=["forward-tail-mask", "backward-mean", "short-rows-stop-early", "short-rows-backward-mean"])
def test_a_wrong_kernel_fails_the_comparison(rng, monkeypatch, tmp_path, old, new, n):
    x, _ = _scores(rng, 2, n, torch.float32)
    assert_matches_torch(x, 5, rng, epsilon=0.1)  # the kernels as they are pass
    load_mutant(soft_topk_op, monkeypatch, tmp_path, old, new)
    with pytest.raises(AssertionError):
        assert_matches_torch(x, 5, rng, epsilon=0.1)


def test_the_backend_argument_is_checked_and_the_default_runs_the_torch_path_on_the_cpu(rng, monkeypatch):
    import inspect

    import fairseq_softtopk.ops as ops

    assert {"BACKENDS", "KernelFallbackWarning"} <= set(ops.__all__) and ops.BACKENDS == ("torch", "triton", "auto")
    for operator in (soft_topk, ops.sorted_soft_topk, ops.sparse_soft_topk, ops.sorted_sparse_soft_topk,
                     ops.sorted_sparse_soft_topk_window):
        assert inspect.signature(operator).parameters["backend"].default == "auto", operator.__name__
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernels ran")

    monkeypatch.setattr(soft_topk_op, "soft_topk_kernel", no_kernel)
    x = torch.randn(2, 50, generator=rng)
    for hard in (False, True):
        with pytest.raises(ValueError, match=r"backend must be one of \('torch', 'triton', 'auto'\), got 'cuda'"):
            soft_topk(x, 3, backend="cuda", hard=hard)
    torch.testing.assert_close(soft_topk(x, 3), soft_topk(x, 3, backend="auto"), rtol=0, atol=0)  # CPU: torch


def test_resolve_backend_picks_the_kernels_only_where_they_run(monkeypatch):
    cpu = torch.zeros(1)
    cuda_like = type("CudaTensor", (), {"is_cuda": True, "device": torch.device("cuda", 0)})()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("torch", cuda_like) == "torch"
    assert resolve_backend("auto", cpu) == "torch"
    monkeypatch.setattr(backend_module, "_triton_import_error", "")  # triton imports
    assert resolve_backend("auto", cuda_like) == "triton" and resolve_backend("triton", cuda_like) == "triton"
    with pytest.raises(ValueError, match=r"runs on CUDA tensors \(or CPU tensors under TRITON_INTERPRET=1\), got a "
                                         r"tensor on cpu"):
        resolve_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", cpu) == "triton" and resolve_backend("auto", cpu) == "torch"
    monkeypatch.setattr(backend_module, "_triton_import_error", "ModuleNotFoundError: No module named 'triton'")
    assert resolve_backend("auto", cuda_like) == "torch"
    with pytest.raises(ValueError, match=r"needs the triton package \(pip install triton\), which does not import "
                                         r"here \(ModuleNotFoundError: No module named 'triton'\)"):
        resolve_backend("triton", cuda_like)


def test_bench_ops_lists_the_kernels_row_and_skips_it_off_cuda(monkeypatch, capsys):
    bench_ops = script_module("bench/bench_ops.py")
    monkeypatch.setattr(bench_ops, "MIN_TIMED_SECONDS", 0.0)
    assert bench_ops.main(["--device", "cpu", "--n", "300", "--k", "3", "--eps", "0.1", "--repeats", "1",
                           "--threads", "1", "--cost", "linear", "--batch", "2", "--triton", "--sparse"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| topk n=", "| sorted n="))]
    methods = [r[1].strip() for r in rows]
    # every operator, unsorted then sorted, and its sparse counterpart, each beside its kernels
    assert methods == ["ours", "ours_triton", "paper", "unrolled", "sparse", "sparse_triton", "topk"] * 2
    for triton_row in (r for r in rows if r[1].strip().endswith("_triton")):
        assert triton_row[8].strip() == "skipped: CUDA only (on the CPU the kernels run under Triton's interpreter)"


@kernel_test
def test_bench_ops_times_the_kernels(monkeypatch):
    """The ours_triton row's time, marginal error and iterations (here under the interpreter, its skip lifted)."""
    bench_ops = script_module("bench/bench_ops.py")
    monkeypatch.setattr(bench_ops, "MIN_TIMED_SECONDS", 0.0)
    monkeypatch.setattr(bench_ops, "triton_skip_reason", lambda device: "")
    for sorted_op in (False, True):
        rows = {r["method"]: r for r in bench_ops.bench_case(300, 3, 0.1, sorted_op, 1, 1e-5, DEVICE, cost="linear",
                                                             batch=2, triton=True, sparse=True)}
        assert rows["ours_triton"]["seconds"] > 0 and rows["ours_triton"]["err"] <= 1e-5
        assert rows["ours_triton"]["note"] == rows["ours"]["note"]  # the same iterations, converged
        assert rows["sparse_triton"]["seconds"] > 0 and rows["sparse_triton"]["note"] == rows["sparse"]["note"]


@needs_triton
@pytest.mark.skipif(IN_PROCESS, reason="needs a process whose triton was imported without the interpreter")
def test_asking_for_the_interpreter_after_triton_was_imported_is_named(rng, monkeypatch):
    import importlib

    importlib.import_module("triton")  # without TRITON_INTERPRET, as torch.compile would

    monkeypatch.setattr(soft_topk_op, "_kernel_modules", {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="set it before anything imports triton"):
        soft_topk(torch.randn(2, 30, generator=rng), 3, backend="triton")


@pytest.mark.parametrize("name", ["sorted_sparse_soft_topk_window"])
def test_operators_without_a_kernel_run_the_torch_path_and_count_the_calls_sent_to_the_kernels(name, rng,
                                                                                               monkeypatch):
    import fairseq_softtopk.ops as ops

    operator = getattr(ops, name)
    x = torch.randn(3, 40, generator=rng, dtype=torch.float64)
    expected = operator(x, 4, backend="torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # "triton" resolves to the kernels on CPU tensors
    monkeypatch.setattr(backend_module, "_triton_import_error", "")
    reset_fallback_counts()
    with pytest.warns(KernelFallbackWarning, match=rf"{name}: the Triton kernels cannot take this call \(this "
                                                   r"operator has no Triton kernel yet\); it ran on the torch path"):
        got = operator(x, 4, backend="triton")
    assert fallback_counts() == {"no_kernel": 1}
    for a, b in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    operator(x, 4, backend="auto")  # CPU tensors: the torch path, not a fallback
    assert fallback_counts() == {"no_kernel": 1}
    with pytest.raises(ValueError, match=r"backend must be one of \('torch', 'triton', 'auto'\), got 'gpu'"):
        operator(x, 4, backend="gpu")
    reset_fallback_counts()


@kernel_test
def test_the_kernel_path_names_its_profiler_ranges_as_the_torch_path(rng):
    """bench_train and bench_attention attribute launches by these ranges: the kernels' backward has the torch path's."""
    leaf = torch.randn(2, 300, generator=rng).to(DEVICE).requires_grad_()
    names = {}
    for backend in ("torch", "triton"):
        with torch.profiler.profile() as prof:
            soft_topk(leaf, 3, backend=backend).sum().backward()
        names[backend] = {e.name for e in prof.events() if e.name.startswith("softtopk::")}
    assert names["triton"] == names["torch"] == {"softtopk::soft_topk", "softtopk::soft_topk_backward"}
