"""sorted_sparse_soft_topk's Triton kernels (``backend="triton"``) against the torch path.

As in test_triton_soft_topk.py: on a GPU the kernel tests run here on CUDA tensors; without one they run on CPU
tensors in a child pytest under ``TRITON_INTERPRET=1`` (:func:`test_kernels_under_the_interpreter`). The kernels'
``(block, k + 1, k + 1)`` tiles are costly in the interpreter, so the rows here are a hundred or two entries and
k is small. Lowering is checked by compiling both kernels for sm_90 and sm_80.

Both paths take Newton steps from the same start (the torch path on a window of each row, the kernels on the whole
row); once the supports are found a step is exact, so solved to a marginal error of 1e-13 the ranks agree to
rounding (float64: 1e-12).
"""

import math
import warnings

import pytest
import torch

from triton_harness import DEVICE, interpreter_runner, kernel_test, load_mutant, needs_triton, run_under_the_interpreter
from device_check import package_device_check
from fairseq_softtopk.ops import sorted_sparse_soft_topk
from fairseq_softtopk.ops.kernels import (KernelFallbackWarning, backend as backend_module, fallback_counts,
                                          reset_fallback_counts)
from fairseq_softtopk.ops.kernels import sorted_sparse_soft_topk_op as op



@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """Every kernel test of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "not test_kernels_under_the_interpreter and not compiles_for_the_gpu"
                                                   " and not meta_tensors")


def _run(x, k, backend, weights, **kwargs):
    """``(ranks, gradient of sum(ranks * weights), info)``; for ``"triton"`` a call that ran on the torch path
    fails."""
    leaf = x.detach().clone().to(DEVICE).requires_grad_()
    if kwargs.get("mask") is not None:
        kwargs["mask"] = kwargs["mask"].to(DEVICE)
    reset_fallback_counts()
    with warnings.catch_warnings(), package_device_check():
        warnings.simplefilter("error", KernelFallbackWarning)
        out, info = sorted_sparse_soft_topk(leaf, k, backend=backend, return_info=True, **kwargs)
        grad, = torch.autograd.grad((out * weights.to(DEVICE)).sum(), leaf)
    assert fallback_counts() == {}
    return out.detach().cpu(), grad.cpu(), info


def assert_matches_torch(x, k, rng, **kwargs):
    """The kernels' ranks and gradients are the torch path's, both solved to a marginal error of 1e-13: ranks to
    1e-12 (float64) or 1e-6 (float32) with the same support, gradients to 1e-7 (float64) or 1e-5 (float32: the
    torch path's backward sums in float32) relative to their largest."""
    weights = torch.randn(x.shape + (k,), generator=rng, dtype=torch.float64).to(x.dtype)
    out_t, grad_t, info_t = _run(x, k, "torch", weights, tol=1e-13, **kwargs)
    out_k, grad_k, info_k = _run(x, k, "triton", weights, tol=1e-13, **kwargs)
    assert out_k.shape == out_t.shape and out_k.dtype == x.dtype
    assert bool(info_k.converged) and float(info_k.marginal_error) <= 1e-13
    scale = float(grad_t.abs().max()) or 1.0
    atol = 1e-12 if x.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(out_k, out_t, rtol=0, atol=atol)
    assert torch.equal(out_k.abs() <= atol, out_t.abs() <= atol)  # the same support
    # the Newton systems carry a ridge of 1e-9 (relative) where groups of anchors are disconnected: their solves
    # keep about 7 digits along those directions, on both paths (LU here, Gauss-Jordan there)
    torch.testing.assert_close(grad_k, grad_t, rtol=0, atol=(1e-7 if x.dtype == torch.float64 else 1e-5) * scale)


def _scores(rng, rows, n, dtype, excluded=0, masked=0):
    x = torch.randn(rows, n, generator=rng, dtype=torch.float64).to(dtype)
    x[0, :excluded] = -math.inf
    mask = None
    if masked:
        mask = torch.zeros(rows, n, dtype=torch.bool)
        mask[1, :masked] = True
    return x, mask


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masks_and_infinities_match_the_torch_path(rng, dtype):
    x, mask = _scores(rng, 3, 100, dtype, excluded=10, masked=40)
    assert_matches_torch(x, 4, rng, regularization=0.3, mask=mask)


@kernel_test
def test_k_1_full_rows_ties_and_smallest_match_the_torch_path(rng):
    """k = 1; a row with exactly k valid entries (no rest anchor); tied scores; largest=False on another dim."""
    x, mask = _scores(rng, 2, 60, torch.float64, masked=57)
    assert_matches_torch(x, 1, rng, regularization=0.5)
    assert_matches_torch(x, 3, rng, regularization=0.5, mask=mask)  # row 1: 3 valid entries
    ties = torch.randint(0, 6, (2, 80), generator=rng).double()
    assert_matches_torch(ties, 3, rng, regularization=0.7)
    assert_matches_torch(torch.randn(2, 50, 2, generator=rng, dtype=torch.float64), 2, rng, regularization=0.2,
                         dim=1, largest=False)


@kernel_test
def test_rows_longer_than_a_block_match_the_torch_path(rng, monkeypatch):
    """Blocks of 8 entries (tiles of 8 x 8 x 8), the last one partly outside the row."""
    monkeypatch.setattr(op, "TILE", 512)
    assert op.block_size(70, 5) == 8
    x, mask = _scores(rng, 2, 70, torch.float64, excluded=7, masked=20)
    assert_matches_torch(x, 5, rng, regularization=0.4, mask=mask)


@kernel_test
def test_fixed_iterations_and_info_tensors(rng):
    """fixed_iterations: no host read in the call; the same ranks; info as tensors (the steps each row took)."""
    x, _ = _scores(rng, 2, 100, torch.float64)
    a = sorted_sparse_soft_topk(x.to(DEVICE), 3, regularization=0.3, fixed_iterations=True, max_iter=20)
    b, info = sorted_sparse_soft_topk(x.to(DEVICE), 3, regularization=0.3, fixed_iterations=True, max_iter=20,
                                      return_info=True, backend="triton")
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    assert info.n_iter.dtype == torch.int32 and 1 <= int(info.n_iter) <= 20 and bool(info.converged)


@kernel_test
def test_gradcheck_float64(rng):
    x = torch.randn(2, 7, generator=rng, dtype=torch.float64).to(DEVICE).requires_grad_()
    reset_fallback_counts()
    assert torch.autograd.gradcheck(
        lambda v: sorted_sparse_soft_topk(v, 2, regularization=1.0, tol=1e-12, backend="triton"), (x,),
        fast_mode=True)
    assert fallback_counts() == {}


@kernel_test
def test_the_ops_pass_opcheck(rng):
    from fairseq_softtopk.ops.sparse_rows import sparse_rows
    from fairseq_softtopk.ops.semi_dual_warm_start import hard_start

    x, mask = _scores(rng, 2, 16, torch.float64, masked=5)
    x = x.to(DEVICE).requires_grad_()
    prep = sparse_rows(x.detach(), 2, -1, True, 0.5, mask.to(DEVICE), sorted_ranks=True)
    b_start = hard_start(prep.top, prep.n_valid == 2, prep.eps, 2)
    lam = torch.full_like(prep.eps, 0.5)
    args = (x, prep.z, prep.valid, b_start, prep.n_valid, lam, 2, 1e-10, 30, False, True)
    torch.library.opcheck(torch.ops.fairseq_softtopk.sorted_sparse_soft_topk_forward.default, args)
    _, b, _, _ = op.sorted_sparse_soft_topk_forward(*args)
    grad = torch.randn(2, 16, 2, generator=rng, dtype=torch.float64).to(DEVICE)
    torch.library.opcheck(torch.ops.fairseq_softtopk.sorted_sparse_soft_topk_backward.default,
                          (prep.z, prep.valid, b, prep.n_valid, grad, lam, True))


def test_the_ops_on_meta_tensors_take_their_device_and_dtype():
    z = torch.empty(2, 40, dtype=torch.float64, device="meta")
    x = torch.empty(2, 40, dtype=torch.float32, device="meta")
    valid = torch.empty(2, 40, dtype=torch.bool, device="meta")
    b_start, n_valid = torch.empty(2, 4, dtype=torch.float64, device="meta"), z[:, 0]
    lam = torch.empty(2, 1, dtype=torch.float64, device="meta")
    with package_device_check():
        ranks, b, err, n_iter = op.sorted_sparse_soft_topk_forward(x, z, valid, b_start, n_valid, lam, 3, 1e-6, 20,
                                                                   False, True)
        grad_z = op.sorted_sparse_soft_topk_backward(z, valid, b, n_valid, ranks, lam, True)
    assert [t.device.type for t in (ranks, b, err, n_iter, grad_z)] == ["meta"] * 5
    assert (ranks.shape, b.shape, err.shape, n_iter.shape, grad_z.shape) == ((2, 40, 3), (2, 4), (2,), (2,), (2, 40))
    assert (ranks.dtype, b.dtype, err.dtype, n_iter.dtype, grad_z.dtype) == (
        torch.float32, torch.float64, torch.float64, torch.int32, torch.float32)


@kernel_test
def test_more_ranks_than_the_kernels_hold_run_the_torch_path_counted(rng, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernels ran")

    monkeypatch.setattr(op, "MAX_K", 2)
    monkeypatch.setattr(op, "sorted_sparse_kernel", no_kernel)
    reset_fallback_counts()
    x = torch.randn(2, 40, generator=rng).to(DEVICE)
    with pytest.warns(KernelFallbackWarning, match=r"sorted_sparse_soft_topk: .*more ranks than the kernels hold in registers \(the sorted operators: k <= 31\)"):
        out = sorted_sparse_soft_topk(x, 3, backend="triton")
    torch.testing.assert_close(out, sorted_sparse_soft_topk(x, 3, backend="torch"), rtol=0, atol=0)
    assert fallback_counts() == {"rank_count": 1}
    reset_fallback_counts()


_SIGNATURES = {
    "_sorted_sparse_kernel": dict(X="*fp64", VALID="*u8", B_START="*fp64", N_VALID="*fp64", RANKS="*D", B="*fp64",
                                  ERR="*fp64", N_ITER="*i32", n="i32", k="i32", tol_hi="fp32", tol_lo="fp32",
                                  max_iter="i32", max_backtrack="i32"),
    "_sorted_sparse_backward_kernel": dict(X="*fp64", VALID="*u8", B="*fp64", N_VALID="*fp64", GRAD="*D",
                                           LAMBDA="*fp64", GRAD_Z="*D", n="i32", k="i32"),
}


@needs_triton
@pytest.mark.skipif(backend_module.interpreter_requested(), reason="under the interpreter, triton compiles nothing")
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_every_kernel_compiles_for_the_gpu(arch, dtype, monkeypatch, tmp_path):
    """Both kernels to a cubin for sm_90 / sm_80 (no GPU needed), k = 5 (tiles of 16 x 8 x 8), float32 and
    float64 ranks."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    module = op.kernel_module()
    for name, signature in _SIGNATURES.items():
        kernel = getattr(module, name)
        constexprs = dict(HAS_MASK=True, RIDGE=1e-9, KP=op.padded_ranks(5), BLOCK=op.block_size(4096, 5))
        if "ARMIJO" in kernel.arg_names:
            constexprs["ARMIJO"] = 1e-4
        assert set(kernel.arg_names) == set(signature) | set(constexprs), name
        variants = [constexprs]
        if name == "_sorted_sparse_kernel" and dtype == "fp32":  # integer arguments equal to 1 are constants
            variants.append(dict(constexprs, n=1, k=1, max_iter=1, max_backtrack=1, KP=2))
        for constants in variants:
            types = {arg: kind.replace("D", dtype) for arg, kind in signature.items()}
            types.update({arg: "constexpr" for arg in constants})
            compiled = triton_compile(ASTSource(fn=kernel, signature=types, constexprs=constants),
                                      target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=4, enable_fp_fusion=True))
            assert compiled.asm["cubin"], (name, dtype, constants)


@kernel_test
@pytest.mark.parametrize("old, new", [
    ("support = (v * c > s - 1.0) & anchor[None, :]", "support = (v * c > s - 0.5) & anchor[None, :]"),  # projection
    ("grad = tl.sum(jgw * y[None, :], axis=1) / lam", "grad = tl.sum(jgw, axis=1) / lam"),  # the anchors forgotten
], ids=["forward-projection", "backward-anchors"])
def test_a_wrong_kernel_fails_the_comparison(rng, monkeypatch, tmp_path, old, new):
    x, _ = _scores(rng, 2, 40, torch.float64)
    assert_matches_torch(x, 3, rng, regularization=0.5, max_iter=6)  # the torch path takes 2 (a mutant: all 6)
    load_mutant(op, monkeypatch, tmp_path, old, new)
    with pytest.raises(AssertionError), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a mutant's solve may miss the tolerance
        assert_matches_torch(x, 3, rng, regularization=0.5, max_iter=6)


@kernel_test
def test_the_kernel_path_names_its_profiler_ranges_as_the_torch_path():
    """bench_train and bench_attention attribute launches by these ranges: the kernels' are the torch path's."""
    leaf = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE).requires_grad_()
    names = {}
    for backend in ("torch", "triton"):
        with torch.profiler.profile() as prof:
            sorted_sparse_soft_topk(leaf, 3, backend=backend).sum().backward()
        names[backend] = {e.name for e in prof.events() if e.name.startswith("softtopk::")}
    assert names["triton"] == names["torch"] and "softtopk::sorted_sparse_soft_topk" in names["torch"]
