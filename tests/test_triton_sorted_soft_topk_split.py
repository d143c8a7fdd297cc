"""sorted_soft_topk's many-programs-a-row kernels (few long rows: ``sorted_soft_topk_split_op``) against the torch
path: values, gradients, solver info, the sync-free mode (no host read, a fixed number of rounds), a float64
gradcheck, mutants that must fail, ``opcheck``, and the ahead-of-time compile for sm_90 and sm_80 without register
spills. On a CPU the kernel tests run under Triton's interpreter in a child pytest; there the rows are a few hundred
entries cut into chunks of 128 (two blocks of 64), so that every pass runs on several programs a row."""

import math

import pytest
import torch

from triton_harness import (DEVICE, compile_without_spills, interpreter_runner, kernel_test, load_mutant,
                            load_shared_mutant, needs_triton, run_under_the_interpreter)
from fairseq_softtopk.ops import sorted_soft_topk
from fairseq_softtopk.ops.kernels import backend as backend_module, soft_topk_op, sorted_soft_topk_op
from fairseq_softtopk.ops.kernels import sorted_soft_topk_split_op as split_op
# the one-program kernels' comparison with the torch path (values, gradients, converged, info tensors), opcheck
from test_triton_sorted_soft_topk import assert_matches_torch, opcheck_plan_ops


@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """Every kernel test of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "test_kernel_")


@pytest.fixture
def split(monkeypatch):
    """Rows of 100 entries or more, in calls of up to 8 rows, run on the split kernels in chunks of 128 entries
    (blocks of 32 with the anchors unrolled, of 64 or 32 in (BLOCK, KP) tiles); returns the list of the split
    forward's launches (each the ``sync_free`` flag)."""
    monkeypatch.setattr(split_op, "SPLIT_MIN_LENGTH", 100)
    monkeypatch.setattr(split_op, "SPLIT_MAX_ROWS", 8)
    monkeypatch.setattr(split_op, "CHUNK", 128)
    monkeypatch.setattr(split_op, "INTERPRETER_CHUNK", 128)
    monkeypatch.setattr(sorted_soft_topk_op, "MAX_TILE", 1024)
    monkeypatch.setattr(sorted_soft_topk_op, "INTERPRETER_MAX_TILE", 1024)
    monkeypatch.setattr(sorted_soft_topk_op, "UNROLLED_BLOCK", 32)
    monkeypatch.setattr(sorted_soft_topk_op, "INTERPRETER_UNROLLED_BLOCK", 32)
    calls, forward = [], split_op.launch_split_forward

    def counted(*args):
        calls.append(args[-1])
        return forward(*args)

    monkeypatch.setattr(split_op, "launch_split_forward", counted)
    return calls


def _scores(rng, rows, n, dtype):
    """Standard normal scores: row 0's first 40 entries ``-inf``, a mask over row 1's first 100."""
    x = torch.randn(rows, n, generator=rng, dtype=torch.float64).to(dtype)
    x[0, :40] = -math.inf
    mask = torch.zeros(rows, n, dtype=torch.bool)
    mask[1, :100] = True
    return x, mask


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("epsilon", [0.05, 0.3])
def test_kernel_masks_and_infinities_match_the_torch_path(rng, split, dtype, epsilon):
    """Three rows of 300 entries (three chunks, the last partly outside the row) at a beam search's epsilon and
    at the paper's."""
    x, mask = _scores(rng, 3, 300, dtype)
    assert_matches_torch(x, 5, rng, epsilon=epsilon, mask=mask)
    assert split == [False]  # the torch path's call did not launch; the default reads on the host


@kernel_test
def test_kernel_ties_and_extreme_k_match_the_torch_path(rng, split):
    """Ties at the (k+1)-th best, k = 1, rows with exactly k valid entries (no rest anchor) or k + 1, and k = 20."""
    ties = torch.randint(0, 6, (2, 260), generator=rng).double()
    assert_matches_torch(ties, 4, rng, epsilon=0.3)
    x, _ = _scores(rng, 2, 200, torch.float32)
    assert_matches_torch(x, 1, rng, epsilon=0.05)
    x = torch.randn(3, 200, generator=rng, dtype=torch.float64)
    mask = torch.ones(3, 200, dtype=torch.bool)
    mask[0, 150:] = False  # 50 valid entries
    mask[1, 190:] = False  # 10 valid entries: k + 1
    mask[2, 191:] = False  # 9: exactly k, no rest anchor (a full soft sort)
    assert_matches_torch(x, 9, rng, epsilon=0.2, mask=mask)
    assert_matches_torch(x, 20, rng, epsilon=0.5)  # 21 anchors: the wider tile (KP 32)
    assert len(split) == 4


@kernel_test
def test_kernel_other_dims_smallest_and_the_papers_cost_match_the_torch_path(rng, split):
    x = torch.randn(2, 150, 3, generator=rng, dtype=torch.float64)
    assert_matches_torch(x.movedim(1, -1), 3, rng, epsilon=0.3, largest=False, cost="paper")


@kernel_test
def test_kernel_matches_the_one_program_kernels(rng, split):
    """The same rows through both kernel families give the same plan to float64 rounding."""
    x, mask = _scores(rng, 3, 300, torch.float64)
    outs = {}
    for family, min_length in (("split", 100), ("one", 10 ** 9)):
        split_op.SPLIT_MIN_LENGTH = min_length
        outs[family] = sorted_soft_topk(x.to(DEVICE), 4, epsilon=0.1, mask=mask.to(DEVICE), tol=1e-12,
                                        backend="triton").cpu()
    assert len(split) == 1
    torch.testing.assert_close(outs["split"], outs["one"], rtol=0, atol=1e-12)


@kernel_test
def test_kernel_gradcheck_float64(rng, split):
    x = torch.randn(2, 130, generator=rng, dtype=torch.float64).to(DEVICE).requires_grad_()
    mask = torch.zeros(2, 130, dtype=torch.bool, device=DEVICE)
    mask[1, :7] = True
    assert torch.autograd.gradcheck(
        lambda v: sorted_soft_topk(v, 3, epsilon=0.4, tol=1e-13, mask=mask, backend="triton"), (x,), fast_mode=True)
    assert split and not any(split)


@kernel_test
def test_kernel_sync_free_solve_reads_nothing_and_runs_its_rounds(rng, split):
    """``fixed_iterations=True``: no host read, forward and backward; the rounds are ``sync_free_rounds(max_iter)``
    (an evaluation and a step each) and the plan's launch, the backward three launches; the result is the
    default call's. The default call reads and stops early."""
    from fairseq_softtopk.dispatch_count import DispatchCounter

    x = torch.randn(3, 300, generator=rng).to(DEVICE).requires_grad_()
    weights = torch.randn(3, 300, 4, generator=rng).to(DEVICE)
    results, counts = {}, {}
    for fixed in (True, False):
        launched = []
        with DispatchCounter() as counter:
            from fairseq_softtopk.ops.kernels.loading import watching_launches

            with watching_launches(launched.append):
                out = sorted_soft_topk(x, 4, epsilon=0.1, max_iter=12, fixed_iterations=fixed, backend="triton")
                grad, = torch.autograd.grad((out * weights).sum(), x)
        results[fixed] = (out.detach(), grad)
        counts[fixed] = (counter.total("syncs"), launched)
    assert split == [True, False]
    assert counts[True][0] == 0 and counts[False][0] > 0
    rounds = split_op.sync_free_rounds(12)
    assert counts[True][1] == (["_split_evaluate_kernel", "_split_step_kernel"] * rounds + ["_split_plan_kernel"]
                               + ["_split_backward_sums_kernel", "_split_backward_solve_kernel",
                                  "_split_backward_grad_kernel"])
    assert len(counts[False][1]) < len(counts[True][1])  # the default stopped when every row had
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0)
    torch.testing.assert_close(results[True][1], results[False][1], rtol=0, atol=0)


@kernel_test
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN slice:RuntimeWarning")
def test_kernel_budget_too_small_and_nan_rows_are_reported(rng, split):
    """One iteration at a small epsilon: unconverged, one iteration, the error as the torch path reports; a
    sync-free solve whose rounds run out keeps the point reached and says so; NaN data gives NaN in its row."""
    x = torch.randn(3, 200, generator=rng).to(DEVICE)
    with pytest.warns(Warning, match="stopped above its tolerance"):
        _, info = sorted_soft_topk(x, 4, epsilon=0.02, max_iter=1, return_info=True, backend="triton")
    assert not bool(info.converged) and int(info.n_iter) == 1 and float(info.marginal_error) > 1e-5
    _, info_t = sorted_soft_topk(x.cpu(), 4, epsilon=0.02, max_iter=1, return_info=True, backend="torch",
                                 warn=False)
    assert float(info.marginal_error) == pytest.approx(float(info_t.marginal_error), rel=1e-4)
    _, info = sorted_soft_topk(x, 4, epsilon=0.02, max_iter=1, fixed_iterations=True, return_info=True,
                               backend="triton")
    assert not bool(info.converged) and float(info.marginal_error) > 1e-5
    x[1, 7] = math.nan
    out, info = sorted_soft_topk(x, 4, max_iter=5, fixed_iterations=True, return_info=True, backend="triton")
    assert out.isnan().flatten(1).any(1).tolist() == [False, True, False] and not bool(info.converged)


@kernel_test
def test_kernel_ops_pass_opcheck(rng, split):
    x, mask = _scores(rng, 2, 160, torch.float64)
    for sync_free in (False, True):
        opcheck_plan_ops(torch.ops.fairseq_softtopk.sorted_soft_topk_split_forward.default,
                         torch.ops.fairseq_softtopk.sorted_soft_topk_split_backward.default,
                         x.to(DEVICE).requires_grad_(), mask.to(DEVICE), rng, 30, sync_free)


@kernel_test
@pytest.mark.parametrize("old, new", [
    ("        counts += tl.load(part + lane)\n", "        counts += tl.where(c == 0, tl.load(part + lane), 0.0)\n"),
    ("tl.store(scalars + ERR_AT, err)", "tl.store(scalars + ERR_AT, err * 0.0)"),
    ("_backward_sums(PLAN, GRAD, first, first + CHUNK,", "_backward_sums(PLAN, GRAD, first, first + CHUNK // 2,"),
], ids=["reduce-first-chunk-only", "error-not-kept-between-rounds", "backward-sums-half-chunk"])
def test_kernel_mutant_fails_the_comparison(rng, split, monkeypatch, tmp_path, old, new):
    x, _ = _scores(rng, 2, 300, torch.float32)
    assert_matches_torch(x, 4, rng, epsilon=0.2)  # the kernels as they are pass
    load_mutant(split_op, monkeypatch, tmp_path, old, new)
    with pytest.raises(AssertionError):
        assert_matches_torch(x, 4, rng, epsilon=0.2)


@kernel_test
@pytest.mark.parametrize("old, new", [
    ("added = added + (b_lanes[r] + (PG[r]", "added = added + (b_lanes[r] - (PG[r]"),
    ("return _lane(tl.reshape(y_eps2, (KP,)), K1 - 2, KP), shifts",
     "return 1.5 * _lane(tl.reshape(y_eps2, (KP,)), K1 - 2, KP), shifts"),
    ("((ri == r) & (ci == s)) | ((ri == s) & (ci == r))", "((ri == r) & (ci == s))"),
    ("added = added + (counts[r] + P[r].to(tl.float64),)", "added = added + (counts[r] + P[K1 - 1 - r].to(tl.float64),)"),
], ids=["backward-rhs-sign", "anchor-slope", "gram-one-triangle", "counts-anchors-reversed"])
def test_kernel_unrolled_pass_mutant_fails_the_comparison(rng, split, monkeypatch, tmp_path, old, new):
    """The passes with the anchors unrolled (k + 1 <= 8; sorted_soft_topk_passes_triton's device functions, which
    every sorted kernel family imports): a mutant of each fails the torch path's comparison."""
    assert sorted_soft_topk_op.unrolled_anchors(4) == 5
    x, _ = _scores(rng, 2, 300, torch.float32)
    assert_matches_torch(x, 4, rng, epsilon=0.2)  # the kernels as they are pass
    load_shared_mutant(sorted_soft_topk_op.PASSES_FILE, "_evaluate", [sorted_soft_topk_op, split_op], monkeypatch,
                       tmp_path, old, new)
    with pytest.raises(AssertionError):
        assert_matches_torch(x, 4, rng, epsilon=0.2)


@kernel_test
def test_kernel_one_long_row_at_the_papers_epsilon(rng, monkeypatch):
    """One row of 100,000 scores at the shipped sizes (chunks of 2048 entries where compiled; under the
    interpreter the row in chunks of 16,384), epsilon 0.3: the torch path's values and gradients."""
    monkeypatch.setattr(split_op, "INTERPRETER_CHUNK", 16384)
    assert split_op.use_split_kernels(1, 100_000)
    x = torch.randn(1, 100_000, generator=rng)
    assert_matches_torch(x, 5, rng, epsilon=0.3)


@kernel_test
@pytest.mark.parametrize("epsilon", [0.03, 0.3])
def test_kernel_real_beam_steps_match_the_torch_path(rng, monkeypatch, epsilon):
    """Four real rows of the shipped Multi30k Transformer's beam search (tests/fixtures/beam_steps_multi30k_transformer
    .npz: each row's 4,096 best candidates, log-probabilities), shuffled, in chunks of 1,024: the torch path's values
    and gradients at the beam search's epsilon and at the paper's."""
    import numpy as np
    from pathlib import Path

    monkeypatch.setattr(split_op, "SPLIT_MIN_LENGTH", 4096)
    monkeypatch.setattr(split_op, "INTERPRETER_CHUNK", 1024)
    monkeypatch.setattr(split_op, "CHUNK", 1024)
    data = np.load(Path(__file__).parent / "fixtures" / "beam_steps_multi30k_transformer.npz")
    rows = torch.from_numpy(data["scores"][[0, 40, 80, 120]].copy())
    rows = rows[:, torch.randperm(rows.shape[1], generator=rng)]  # the kernels see no order
    assert split_op.use_split_kernels(*rows.shape)
    assert_matches_torch(rows, 5, rng, epsilon=epsilon)


def test_the_split_kernels_take_few_long_rows():
    assert split_op.use_split_kernels(1, split_op.SPLIT_MIN_LENGTH)
    assert split_op.use_split_kernels(split_op.SPLIT_MAX_ROWS, 10 ** 6)
    assert not split_op.use_split_kernels(split_op.SPLIT_MAX_ROWS + 1, 10 ** 6)
    assert not split_op.use_split_kernels(1, split_op.SPLIT_MIN_LENGTH - 1)
    assert not split_op.use_split_kernels(0, 10 ** 6)
    with split_op.split_for_long_rows():
        assert split_op.use_split_kernels(split_op.SPLIT_MAX_ROWS + 1, split_op.SPLIT_MIN_LENGTH)
        assert not split_op.use_split_kernels(10 ** 4, split_op.SPLIT_MIN_LENGTH - 1)
        with split_op.one_program_a_row():
            assert not split_op.use_split_kernels(1, 10 ** 6)
        assert split_op.use_split_kernels(10 ** 4, 10 ** 6)
    assert not split_op.use_split_kernels(split_op.SPLIT_MAX_ROWS + 1, 10 ** 6)
    assert split_op.sync_free_rounds(10) == 21


def test_fake_implementations_give_shapes_and_dtypes_on_the_meta_device():
    z = torch.empty(2, 50, device="meta", dtype=torch.float64)
    plan, n_iter, err = split_op.sorted_soft_topk_split_forward(
        z, z, torch.empty(2, 50, dtype=torch.bool, device="meta"), z.new_empty(2, 1), z.new_empty(2, 1),
        z.new_empty(2, 4), z.new_empty(2), 3, 1e-6, 20, False, True)
    assert (plan.shape, plan.dtype, n_iter.dtype, err.dtype) == ((2, 4, 50), torch.float64, torch.int32,
                                                                 torch.float64)
    grad_z = split_op.sorted_soft_topk_split_backward(plan, plan, z.new_empty(2, 1),
                                                      torch.empty(2, dtype=torch.bool, device="meta"))
    assert grad_z.shape == (2, 50) and grad_z.device.type == "meta"


@needs_triton
@pytest.mark.skipif(backend_module.interpreter_requested(), reason="under the interpreter, triton compiles nothing")
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("k", [5, 7, 15, 31], ids=["unrolled-k5", "unrolled-k7", "tiles-KP16", "tiles-KP32"])
def test_every_split_kernel_compiles_for_the_gpu_without_spills(arch, dtype, k, monkeypatch, tmp_path):
    """Ahead-of-time compilation to a cubin (no GPU needed) as the launcher compiles them: the passes with the
    anchors unrolled (the beam search's k = 5, and the most anchors unrolled) and in (BLOCK, KP) tiles at both widths
    (k up to 31), with a mask; ``ptxas -v`` (Triton's bundled one) reports no register spill."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    module = split_op.kernel_module()
    lanes = sorted_soft_topk_op.anchor_lanes(k)
    block, chunk, chunks, pass_options = split_op.pass_geometry(10 ** 6, k, interpret=False)
    assert pass_options["K1"] == (k + 1 if k + 1 <= sorted_soft_topk_op.UNROLL_MAX_ANCHORS else 0)
    for name, signature in split_op.KERNEL_SIGNATURES.items():
        kernel = getattr(module, name)
        constexprs = {"KP": lanes}
        options = split_op.row_options(lanes)
        if "BLOCK" in kernel.arg_names:
            options = dict(pass_options)
            constexprs.update(BLOCK=block, CHUNK=chunk, K1=options.pop("K1"))
        if "HAS_MASK" in kernel.arg_names:
            constexprs["HAS_MASK"] = True
        compile_without_spills(kernel, signature, constexprs, arch, dtype, options, tmp_path, name)
