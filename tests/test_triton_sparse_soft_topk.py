"""sparse_soft_topk's Triton kernels (``backend="triton"``) against the torch path, for p = 2 and p = 4/3.

As in test_triton_soft_topk.py: on a GPU the kernel tests run here on CUDA tensors; without one they run on CPU
tensors in a child pytest under ``TRITON_INTERPRET=1`` (:func:`test_kernels_under_the_interpreter`), with rows of
a few hundred to a few thousand entries (one or a few blocks: the interpreter's cost is per block iteration).
Lowering to GPU code is checked by compiling every kernel for sm_90 and sm_80 (no GPU needed). Tests that need
triton skip, with the reason, where it is not installed.

The threshold is exact on both paths, so the comparison is strict: the same exact zeros and ones, the other
values within a few float32 units of the float64 solution (the kernel sums in float64: it is closer to it than
the torch path, whose float32 sums are off by up to 1e-4 at k = n - 100), float64 values within 1e-13.
"""

import math
import warnings

import pytest
import torch

from triton_harness import DEVICE, interpreter_runner, kernel_test, load_mutant, needs_triton, run_under_the_interpreter
from device_check import package_device_check
from fairseq_softtopk.ops import sparse_soft_topk
from fairseq_softtopk.ops.kernels import (KernelFallbackWarning, backend as backend_module, fallback_counts,
                                          reset_fallback_counts)
from fairseq_softtopk.ops.kernels import sparse_soft_topk_op
from fairseq_softtopk.ops.sparse_rows import sparse_rows

P = pytest.mark.parametrize("p", [2, 4 / 3], ids=["p=2", "p=4/3"])
F32 = torch.finfo(torch.float32).eps


@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """Every kernel test of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "not test_kernels_under_the_interpreter and not compiles_for_the_gpu"
                                                   " and not meta_tensors")


def _run(x, k, backend, weights, **kwargs):
    """``(mask, gradient of sum(mask * weights))`` on ``DEVICE``, in the package's device check; for
    ``"triton"``, a call that ran on the torch path fails."""
    leaf = x.detach().clone().to(DEVICE).requires_grad_()
    if kwargs.get("mask") is not None:
        kwargs["mask"] = kwargs["mask"].to(DEVICE)
    reset_fallback_counts()
    with warnings.catch_warnings(), package_device_check():
        warnings.simplefilter("error", KernelFallbackWarning)
        out = sparse_soft_topk(leaf, k, backend=backend, **kwargs)
        grad, = torch.autograd.grad((out * weights.to(DEVICE)).sum(), leaf)
    assert fallback_counts() == {}
    return out.detach().cpu(), grad.cpu()


def assert_matches_torch(x, k, rng, **kwargs):
    """The kernels' mask and gradient on ``x`` are the torch path's: the same exact zeros and ones; float64 values
    to 1e-13 and gradients to 1e-11 (relative); float32 values within 4 units of rounding of the float64 solution
    (and as close to it as the torch path, to 2 units), gradients within 1e-5 (relative) of the float64 solution's
    (and of the torch path's, beyond the torch path's own error: 1e-4 at k = n - 1 for p = 4/3)."""
    weights = torch.randn(x.shape, generator=rng, dtype=torch.float64).to(x.dtype)
    out_t, grad_t = _run(x, k, "torch", weights, **kwargs)
    out_k, grad_k = _run(x, k, "triton", weights, **kwargs)
    assert out_k.shape == x.shape and out_k.dtype == x.dtype and grad_k.dtype == x.dtype
    assert torch.equal(out_k == 0, out_t == 0) and torch.equal(out_k == 1, out_t == 1)
    scale = float(grad_t.abs().max()) or 1.0
    if x.dtype == torch.float64:
        torch.testing.assert_close(out_k, out_t, rtol=0, atol=1e-13)
        torch.testing.assert_close(grad_k, grad_t, rtol=0, atol=1e-11 * scale)
        return
    exact, exact_grad = _run(x.double(), k, "torch", weights.double(), **kwargs)
    kernel_error = (out_k.double() - exact).abs().max()
    assert kernel_error <= 4 * F32, kernel_error
    assert kernel_error <= (out_t.double() - exact).abs().max() + 2 * F32
    grad_error = (grad_k.double() - exact_grad).abs().max()
    assert grad_error <= 1e-5 * scale, grad_error
    torch.testing.assert_close(grad_k.double(), grad_t.double(), rtol=0,
                               atol=float((grad_t.double() - exact_grad).abs().max()) + 1e-5 * scale)


def _scores(rng, rows, n, dtype, largest=True, excluded=0, masked=0):
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
@P
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masks_and_infinities_match_the_torch_path(rng, dtype, p):
    x, mask = _scores(rng, 3, 2000, dtype, excluded=50, masked=100)
    assert_matches_torch(x, 20, rng, regularization=0.3, p=p, mask=mask)


@kernel_test
@P
def test_k_1_n_minus_1_and_n_match_the_torch_path(rng, p):
    """k = 1, k = n - 1 (float32: the torch path's sums are off by 1e-5 there, the kernel's are not) and k = n
    (every entry 1: no threshold search); a row with exactly k valid entries."""
    x, _ = _scores(rng, 2, 600, torch.float32)
    assert_matches_torch(x, 1, rng, regularization=0.2, p=p)
    assert_matches_torch(x, 599, rng, regularization=0.05, p=p)
    assert_matches_torch(x, 600, rng, regularization=0.5, p=p)
    x, mask = _scores(rng, 3, 500, torch.float64, excluded=100, masked=300)
    assert_matches_torch(x, 200, rng, regularization=0.5, p=p, mask=mask)  # row 1: 200 valid entries


@kernel_test
@P
@pytest.mark.parametrize("regularization", [1.0, 0.5, 2.0])
def test_ties_match_the_torch_path(rng, p, regularization):
    """Integer scores: many ties, and breakpoints (z and z - 1 in units of lambda) that coincide with entries (with
    lambda = 2 the first trial threshold, -1/2, is one: entries at d = 0 and d = 1 on both sides)."""
    x = torch.randint(0, 12, (3, 700), generator=rng).double()
    assert_matches_torch(x, 37, rng, regularization=regularization, p=p)
    assert_matches_torch(x.float(), 300, rng, regularization=regularization, p=p)


@kernel_test
@P
def test_rows_longer_than_a_block_match_the_torch_path(rng, monkeypatch, p):
    """Six blocks of 512 per pass, the last one partly outside the row."""
    monkeypatch.setattr(sparse_soft_topk_op, "INTERPRETER_MAX_BLOCK", 512)
    monkeypatch.setattr(sparse_soft_topk_op, "MAX_BLOCK", 512)
    assert sparse_soft_topk_op.block_size(3000, interpret=DEVICE == "cpu") == 512
    x, mask = _scores(rng, 2, 3000, torch.float32, excluded=10, masked=700)
    assert_matches_torch(x, 40, rng, regularization=0.4, p=p, mask=mask)


@kernel_test
@P
def test_other_dims_smallest_and_half_precision_match_the_torch_path(rng, p):
    x, mask = _scores(rng, 2, 400, torch.float64, largest=False, excluded=30, masked=50)
    assert_matches_torch(x, 10, rng, regularization=0.3, p=p, mask=mask, largest=False)
    x = torch.randn(2, 300, 3, generator=rng, dtype=torch.float64)
    assert_matches_torch(x, 6, rng, regularization=0.2, p=p, dim=1)
    half = torch.randn(2, 500, generator=rng).to(DEVICE, torch.bfloat16)
    out_t = sparse_soft_topk(half, 4, regularization=0.3, p=p)
    out_k = sparse_soft_topk(half, 4, regularization=0.3, p=p, backend="triton")
    assert out_k.dtype == torch.bfloat16
    torch.testing.assert_close(out_k, out_t, rtol=0, atol=4e-3)  # bf16 rounding of the same float32 results


@kernel_test
@P
def test_extreme_magnitudes_match_the_torch_path(rng, p):
    """Scores of 1e7 with lambda 1 in float32 (spacing 1 there: the prepared rows keep the differences exact),
    spreads of 1e-30 with lambda 3e-31, and lambda far below the gaps (the hard top-k, from the gap rule)."""
    x = 1e7 + torch.randint(-20, 20, (2, 800), generator=rng).float() + torch.randn(2, 800, generator=rng).round()
    assert_matches_torch(x, 30, rng, regularization=1.0, p=p)
    tiny, _ = _scores(rng, 2, 800, torch.float64)
    assert_matches_torch(tiny * 1e-30, 25, rng, regularization=3e-31, p=p)
    assert_matches_torch((tiny * 1e-30).float(), 25, rng, regularization=3e-31, p=p)
    out, grad = _run(tiny, 25, "triton", torch.ones_like(tiny), regularization=1e-9, p=p)
    assert torch.equal(out, sparse_soft_topk(tiny, 25, hard=True)) and not grad.any()


@kernel_test
def test_the_search_takes_few_passes_and_returns_the_threshold(rng):
    """The exact threshold in a few passes over the row (none for the hard top-k), as tensors; the mask is
    ``clip(z - tau, 0, 1)`` of the returned threshold and sums to k."""
    x, _ = _scores(rng, 4, 2000, torch.float64)
    x[3, :50] += 10  # a gap >= 1 unit of lambda after the 50 best: the hard top-k
    for power in (1, 3):
        prep = sparse_rows(x.to(DEVICE), 50, -1, True, 0.5, None, sorted_ranks=False)
        out, base, tau, n_iter = sparse_soft_topk_op.sparse_soft_topk_forward(
            prep.z, prep.z, prep.valid, prep.top, prep.eps, 50, power, False)
        assert n_iter.dtype == torch.int32 and tau.dtype == torch.float64 and base.shape == (4, 2000 * (power == 3))
        assert n_iter[:3].max() <= 10 and n_iter[3] == 0, n_iter
        torch.testing.assert_close(out, (prep.z - tau[:, None]).clamp(0, 1) ** power, rtol=0, atol=1e-15)
        torch.testing.assert_close(out.sum(-1), torch.full_like(tau, 50), rtol=0, atol=1e-12)


@kernel_test
@P
def test_gradcheck_float64(rng, p):
    """Against finite differences (fast mode: a few random directions, each launch is slow under the
    interpreter), with a masked entry and entries at 0, inside and at 1."""
    x = torch.randn(2, 8, generator=rng, dtype=torch.float64).to(DEVICE).requires_grad_()
    mask = torch.zeros(2, 8, dtype=torch.bool, device=DEVICE)
    mask[1, :2] = True
    lam = 1.5 if p == 2 else 1.0
    out = sparse_soft_topk(x, 3, regularization=lam, p=p, mask=mask, backend="triton")
    assert ((out > 0) & (out < 1)).sum() >= 4 and (out == 0).sum() >= 3
    reset_fallback_counts()
    assert torch.autograd.gradcheck(
        lambda v: sparse_soft_topk(v, 3, regularization=lam, p=p, mask=mask, backend="triton"), (x,),
        fast_mode=True)
    assert fallback_counts() == {}  # the kernels ran


@kernel_test
def test_the_ops_pass_opcheck(rng):
    """torch.library.opcheck (schema, autograd registration, fake tensors, AOT dispatch) of the forward (p = 4/3:
    both outputs) and of the backward for both powers."""
    x, mask = _scores(rng, 2, 40, torch.float64, masked=10)
    x = x.to(DEVICE).requires_grad_()
    prep = sparse_rows(x.detach(), 4, -1, True, 0.3, mask.to(DEVICE), sorted_ranks=False)
    lam = torch.full_like(prep.eps, 0.3)
    args = (x, prep.z, prep.valid, prep.top, lam, 4, 3, True)
    torch.library.opcheck(torch.ops.fairseq_softtopk.sparse_soft_topk_forward.default, args)
    out, base, _, _ = sparse_soft_topk_op.sparse_soft_topk_forward(*args)
    grad = torch.randn(2, 40, generator=rng, dtype=torch.float64).to(DEVICE)
    for power, s in ((3, base), (1, base.clamp(0, 1))):
        torch.library.opcheck(torch.ops.fairseq_softtopk.sparse_soft_topk_backward.default, (s, grad, lam, power))


@pytest.mark.parametrize("power", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_ops_on_meta_tensors_take_their_device_and_dtype(power, dtype):
    """The fake implementations (what torch.compile traces): shapes, dtypes and device of the real ones, every
    tensor made on the inputs' device (the package's device check); a bad power is named."""
    z = torch.empty(3, 50, dtype=dtype, device="meta")
    valid = torch.empty(3, 50, dtype=torch.bool, device="meta")
    top, lam = torch.empty(3, 5, dtype=dtype, device="meta"), torch.empty(3, 1, dtype=dtype, device="meta")
    with package_device_check():
        out, base, tau, n_iter = sparse_soft_topk_op.sparse_soft_topk_forward(z, z, valid, top, lam, 4, power, True)
        grad_z = sparse_soft_topk_op.sparse_soft_topk_backward(out if power == 1 else base, z, lam, power)
    assert [t.device.type for t in (out, base, tau, n_iter, grad_z)] == ["meta"] * 5
    assert (out.shape, base.shape, tau.shape, n_iter.shape, grad_z.shape) == (
        (3, 50), (3, 50 if power == 3 else 0), (3,), (3,), (3, 50))
    assert (out.dtype, base.dtype, tau.dtype, n_iter.dtype, grad_z.dtype) == (
        dtype, dtype, torch.float64, torch.int32, dtype)
    with pytest.raises(ValueError, match=r"power must be 1 \(p = 2\) or 3 \(p = 4/3\), got 2"):
        sparse_soft_topk_op.sparse_soft_topk_forward(z, z, valid, top, lam, 4, 2, True)


@kernel_test
@P
def test_a_scaled_loss_scales_the_gradient_exactly(rng, p):
    """Loss scaling (mixed precision): the loss times 2**16 gives the gradient times 2**16, bit for bit, and the
    same mask."""
    x, mask = _scores(rng, 2, 500, torch.float32, masked=40)
    weights = torch.randn(2, 500, generator=rng)
    out, grad = _run(x, 12, "triton", weights, regularization=0.5, p=p, mask=mask)
    out_scaled, grad_scaled = _run(x, 12, "triton", weights * 2 ** 16, regularization=0.5, p=p, mask=mask)
    assert torch.equal(out, out_scaled) and torch.equal(grad * 2 ** 16, grad_scaled) and grad.abs().max() > 0


@kernel_test
def test_calls_the_kernels_cannot_take_run_the_torch_path(rng, monkeypatch):
    """Rows too long for the kernels' offsets fall back, counted and warned; hard=True and backend='torch' never
    reach the kernels; bad data raises the torch path's errors."""
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernels ran")

    monkeypatch.setattr(sparse_soft_topk_op, "MAX_ROW_LENGTH", 400)
    monkeypatch.setattr(sparse_soft_topk_op, "sparse_soft_topk_kernel", no_kernel)
    reset_fallback_counts()
    x = torch.randn(2, 401, generator=rng).to(DEVICE)
    with pytest.warns(KernelFallbackWarning, match="sparse_soft_topk: .*rows longer than"):
        out = sparse_soft_topk(x, 3, backend="triton")
    torch.testing.assert_close(out, sparse_soft_topk(x, 3, backend="torch"), rtol=0, atol=0)
    assert fallback_counts() == {"row_length": 1}
    small = x[:, :300]
    assert torch.equal(sparse_soft_topk(small, 3, hard=True, backend="triton"), sparse_soft_topk(small, 3, hard=True))
    sparse_soft_topk(small, 3, backend="torch")
    assert fallback_counts() == {"row_length": 1}
    reset_fallback_counts()
    bad = small.clone()
    bad[1, 3] = math.nan
    with pytest.raises(ValueError, match="scores contain NaN"):
        sparse_soft_topk(bad, 5, backend="triton")


#: the kernels' arguments (pointer types with D for the scores' dtype); the test fails if a kernel's change
_SIGNATURES = {
    "_sparse_threshold_kernel": dict(Z="*D", VALID="*u8", TOP="*D", OUT="*D", BASE="*D", TAU="*fp64",
                                     N_ITER="*i32", n="i32", top_cols="i32", k="i32", max_iter="i32"),
    "_sparse_backward_kernel": dict(BASE="*D", GRAD="*D", LAMBDA="*D", GRAD_Z="*D", n="i32"),
}


@needs_triton
@pytest.mark.skipif(backend_module.interpreter_requested(), reason="under the interpreter, triton compiles nothing")
@pytest.mark.parametrize("arch", [90, 80])
def test_every_kernel_compiles_for_the_gpu(arch, monkeypatch, tmp_path):
    """Ahead-of-time compilation to a cubin for sm_90 / sm_80 (no GPU needed): p = 2 and p = 4/3 in float32 and
    float64, and rows of one entry (Triton turns integer arguments equal to 1 into constants)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled now, not found in a cache
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    module = sparse_soft_topk_op.kernel_module()
    for name, signature in _SIGNATURES.items():
        kernel = getattr(module, name)
        ones = {arg: 1 for arg in ("n", "k", "top_cols", "max_iter") if arg in signature}
        for power, dtype, with_ones in ((1, "fp32", False), (1, "fp64", False), (3, "fp32", False),
                                        (3, "fp64", False), (3, "fp32", True)):
            constexprs = {"BLOCK": sparse_soft_topk_op.MAX_BLOCK, "POWER": power}
            if "HAS_MASK" in kernel.arg_names:
                constexprs.update(HAS_MASK=True, GAP_CAP=2.0, RESOLUTION=1e-15)
            assert set(kernel.arg_names) == set(signature) | set(constexprs), name
            constants = dict(constexprs, **ones) if with_ones else constexprs
            types = {arg: kind.replace("D", dtype) for arg, kind in signature.items()}
            types.update({arg: "constexpr" for arg in constants})
            compiled = triton_compile(ASTSource(fn=kernel, signature=types, constexprs=constants),
                                      target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=8, enable_fp_fusion=True))
            assert compiled.asm["cubin"], (name, power, dtype, constants)


@kernel_test
@pytest.mark.parametrize("old, new", [
    ("c0 += tl.sum((valid & (d == 0.0))", "c0 += 0 * tl.sum((valid & (d == 0.0))"),  # the piece left of t wrong
    ("tl.where(free, 3.0 * (s * s), 0.0)", "tl.where(free, 2.0 * (s * s), 0.0)"),  # p = 4/3's weights
    ("_div(w, lam) * (g - mean_row)", "_div(w, lam) * g"),  # the threshold's dependence on z forgotten
], ids=["forward-tie-sides", "backward-cubic-weights", "backward-mean"])
def test_a_wrong_kernel_fails_the_comparison(rng, monkeypatch, tmp_path, old, new):
    x = torch.randint(0, 12, (2, 500), generator=rng).double()
    assert_matches_torch(x, 30, rng, regularization=2.0, p=4 / 3)  # the kernels as they are pass
    load_mutant(sparse_soft_topk_op, monkeypatch, tmp_path, old, new)
    with pytest.raises(AssertionError):
        assert_matches_torch(x, 30, rng, regularization=2.0, p=4 / 3)


@kernel_test
def test_the_kernel_path_names_its_profiler_ranges_as_the_torch_path():
    """bench_train and bench_attention attribute launches by these ranges: the kernels' are the torch path's."""
    leaf = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE).requires_grad_()
    names = {}
    for backend in ("torch", "triton"):
        with torch.profiler.profile() as prof:
            sparse_soft_topk(leaf, 3, backend=backend).sum().backward()
        names[backend] = {e.name for e in prof.events() if e.name.startswith("softtopk::")}
    assert names["triton"] == names["torch"] and "softtopk::sparse_soft_topk" in names["torch"]
