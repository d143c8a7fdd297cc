"""The Triton kernels of sorted_soft_topk_window (one forward launch after torch.topk, one backward launch after a
zero fill) against its torch path: values, flags, gradients with and without the fused row cap, the cap's
observed norms; a float64 gradcheck; mutants that must fail; the ahead-of-time compile for sm_90 and sm_80 without
register spills. On a CPU the kernel tests run under Triton's interpreter, in a child pytest."""

import math

import pytest
import torch

from triton_harness import (DEVICE, compile_without_spills, interpreter_runner, kernel_test, load_mutant, needs_triton,
                            run_under_the_interpreter)
from fairseq_softtopk.ops import sorted_soft_topk_window
from fairseq_softtopk.ops.kernels import backend as backend_module, soft_topk_op, sorted_soft_topk_op
from fairseq_softtopk.ops.kernels import sorted_soft_topk_window_op


@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """Every kernel test of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "test_kernel_")


def _rows(rng, dtype):
    """Six rows of 300 log-probability-like scores: row 1 with 5 finite candidates (k = 3: a rest anchor), row 2
    with exactly 3 (no rest anchor), row 3 with 2 (fewer than k: flagged), row 4 flat (its window overflows)."""
    x = (torch.randn(6, 300, generator=rng, dtype=torch.float64) * 12).log_softmax(-1)
    x[1, :295] = -math.inf
    x[2, :297] = -math.inf
    x[3, :298] = -math.inf
    x[4] = -torch.rand(300, generator=rng, dtype=torch.float64) * 0.01
    return x.to(dtype)


def _run(x, backend, upstream, **kwargs):
    leaf = x.clone().to(DEVICE if backend == "triton" else "cpu").requires_grad_()
    norms = []
    ranks, index, info = sorted_soft_topk_window(leaf, 3, return_info=True, backend=backend,
                                                 grad_observer=norms.append, **kwargs)
    loss = (ranks * upstream.to(leaf.device)).sum()
    if info.scale_probe is not None:
        loss = 4.0 * (loss + info.scale_probe)  # a loss scale: the cap and the norms follow it
    grad, = torch.autograd.grad(loss, leaf)
    return (ranks.detach().cpu(), index.cpu(), grad.cpu(), info.overflow.cpu(), norms[0].double().cpu(),
            info.row_iterations.cpu())


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad_cap", [math.inf, 0.05])
def test_kernel_window_is_the_torch_path(rng, dtype, grad_cap):
    """Values, window, flags, the scores' gradient (capped per row, in units of a scaled loss's gradient) and the
    norms the observer sees: the torch path's, on rows with and without a rest anchor, with too few candidates,
    and flat."""
    x = _rows(rng, dtype)
    upstream = torch.randn(6, 32, 3, generator=rng, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    kwargs = dict(epsilon=0.1, width=32, tol=tol, max_iter=40, grad_cap=grad_cap)
    ranks_t, index_t, grad_t, flags_t, norms_t, _ = _run(x, "torch", upstream, **kwargs)
    ranks_k, index_k, grad_k, flags_k, norms_k, iterations = _run(x, "triton", upstream, **kwargs)
    assert flags_t.tolist() == flags_k.tolist() == [False, False, False, True, True, False]
    assert torch.equal(index_t, index_k)
    ok = ~flags_t  # a flagged row's plan is none the caller may use
    atol = 1e-9 if dtype == torch.float64 else 2e-6
    assert float((ranks_t[ok] - ranks_k[ok]).abs().max()) < atol
    scale = float(grad_t[ok].abs().max())
    assert float((grad_t[ok] - grad_k[ok]).abs().max()) < (1e-6 if dtype == torch.float64 else 1e-4) * scale
    assert float(((norms_t - norms_k)[ok]).abs().max()) < 1e-4 * float(norms_t[ok].max())
    if math.isfinite(grad_cap):  # the cap bites: each row's gradient is at most the cap times the loss scale
        assert float(norms_t[ok].max()) > grad_cap
        assert float(grad_k[ok].norm(dim=-1).max()) <= 4.0 * grad_cap * (1 + 1e-6)
    assert int(iterations[ok].max()) <= 40


@kernel_test
def test_kernel_gradient_passes_gradcheck_in_float64(rng):
    """The backward kernel is the forward kernel's derivative (finite differences, float64), zero outside: the
    fast mode's random directions, three of them (the full Jacobian, 180 x 144, took minutes of the suite under the
    interpreter)."""
    x = (torch.randn(3, 60, generator=rng, dtype=torch.float64) * 2).log_softmax(-1).to(DEVICE).requires_grad_()

    def ranks(scores):
        return sorted_soft_topk_window(scores, 3, epsilon=0.2, width=16, tol=1e-12, max_iter=60,
                                       backend="triton")[0]

    for seed in range(3):
        torch.manual_seed(seed)
        assert torch.autograd.gradcheck(ranks, (x,), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


@kernel_test
@pytest.mark.parametrize("old, new", [
    ("floor = kth - depth.to(kth.dtype)", "floor = kth - 2.0 * depth.to(kth.dtype)"),  # the floor twice as deep
    ("(outside > float(\"-inf\")) & (outside >= floor)", "(outside > float(\"-inf\")) & (outside > floor + 1.0)"),
    ("overflow = (n_valid < kf).to(tl.uint8)", "overflow = (n_valid < 0.0).to(tl.uint8)"),  # too few finite ones
    ("factor = tl.minimum(tl.cast(max_norm, tl.float64) * scale", "factor = tl.minimum(tl.cast(max_norm, tl.float64)"),
], ids=["floor-depth", "floor-compare", "too-few", "cap-unscaled"])
def test_kernel_mutant_fails_the_comparison(rng, monkeypatch, tmp_path, old, new):
    """Each mutant of the kernels (a certificate that flags other rows than the torch path's, a cap that ignores
    the loss scale) fails a comparison the kernels as they are pass (:func:`test_kernel_flags_match_at_the_floor`,
    :func:`test_kernel_window_is_the_torch_path`)."""
    load_mutant(sorted_soft_topk_window_op, monkeypatch, tmp_path, old, new)
    with pytest.raises(AssertionError):
        _compare_flags(8)
        test_kernel_window_is_the_torch_path(rng, torch.float64, 0.05)


def _floor_rows(width, k=3, n=200, epsilon=0.5, tol=1e-5):
    """Rows whose (W + 1)-th best lies at set distances from the certificate's floor (``candidate_window``'s,
    ``D`` = its depth times epsilon under the (k + 1)-th best): half a depth below (certified; a floor twice as
    deep flags it), half a nat above and two nats above (flagged; a floor compared with a nat's slack passes the
    first), three depths below; and a row with fewer than k finite candidates (flagged)."""
    depth = (math.log(100.0 * n / tol) + math.log(2.0 * (k + 1) ** 2)) * epsilon
    head = [0.0, -0.1, -0.2, -0.3][: k + 1]
    floor = head[k] - depth
    rows = []
    for outside in (floor - 0.5 * depth, floor + 0.5, floor + 2.0, floor - 3 * depth):
        between = torch.linspace(head[-1] - 0.1, outside + 0.01, width - k - 1, dtype=torch.float64)
        tail = outside - 0.01 * torch.arange(n - width, dtype=torch.float64)
        rows.append(torch.cat([torch.tensor(head, dtype=torch.float64), between, tail]))
    few = torch.full((n,), -math.inf, dtype=torch.float64)
    few[: k - 1] = torch.tensor(head[: k - 1], dtype=torch.float64)
    return torch.stack(rows + [few]), [False, True, True, False, True]


def _compare_flags(width):
    """The flags of both paths on :func:`_floor_rows`: the documented ones."""
    x, expected = _floor_rows(width)
    flags = {}
    for backend in ("torch", "triton"):
        leaf = x.to(DEVICE if backend == "triton" else "cpu")
        flags[backend] = sorted_soft_topk_window(leaf, 3, epsilon=0.5, width=width, return_info=True,
                                                 backend=backend)[2].overflow.cpu().tolist()
    assert flags["torch"] == flags["triton"] == expected, flags


@kernel_test
def test_kernel_flags_match_at_the_floor():
    """Windows of 8 and 32 whose next candidate lies on either side of the floor: both paths flag the documented
    rows."""
    for width in (8, 32):
        _compare_flags(width)


#: the kernels' arguments (D: the scores' dtype)
_SIGNATURES = {
    "_window_forward_kernel": dict(TOP="*D", Z="*D", VALID="*u8", PLAN="*D", OVERFLOW="*u8", NO_REST="*u8",
                                   N_ITER="*i32", ERR="*fp64", PROBE="*D", W="i32", top_stride="i32", k="i32", eps_hi="fp32",
                                   eps_lo="fp32", depth_hi="fp32", depth_lo="fp32", tol_hi="fp32", tol_lo="fp32",
                                   max_iter="i32", CUT="fp32", RIDGE="fp32"),
    "_window_backward_kernel": dict(PLAN="*D", GRAD="*D", IDS="*i64", NO_REST="*u8", SCALE="*D", GRAD_SCORES="*D",
                                    NORMS="*fp64", W="i32", ids_stride="i32", n="i32", k="i32", eps_hi="fp32",
                                    eps_lo="fp32", max_norm="fp32", RIDGE="fp32"),
}


@needs_triton
@pytest.mark.skipif(backend_module.interpreter_requested(), reason="under the interpreter, triton compiles nothing")
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_every_window_kernel_compiles_for_the_gpu_without_spills(arch, dtype, monkeypatch, tmp_path):
    """Ahead-of-time compilation to a cubin (no GPU needed) at the widest tile (KP 16, MAX_TILE entries), every
    variant; its PTX assembled again with ``ptxas -v`` (Triton's bundled one) reports no register spill."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    module = sorted_soft_topk_window_op.kernel_module()
    lanes = 16
    for name, signature in _SIGNATURES.items():
        variants = ([{"HAS_OUT": True}, {"HAS_OUT": False}] if name == "_window_forward_kernel" else
                    [{"HAS_SCALE": True, "CAPPED": True, "ZBLOCK": sorted_soft_topk_window_op.ZERO_BLOCK},
                     {"HAS_SCALE": False, "CAPPED": False, "ZBLOCK": sorted_soft_topk_window_op.ZERO_BLOCK}])
        for flags in variants:
            constexprs = {"BLOCK": sorted_soft_topk_op.MAX_TILE // lanes, "KP": lanes, **flags}
            compile_without_spills(getattr(module, name), signature, constexprs, arch, dtype,
                                   soft_topk_op._launch_options(sorted_soft_topk_op.MAX_TILE), tmp_path, name)
