"""DispatchCounter: the launches and host synchronisations a GPU would see, counted on the CPU."""

import pytest
import torch
from torch.profiler import record_function

from builders import build_criterion, build_model, make_sample
from conftest import script_module, word_dictionary
from triton_harness import DEVICE, interpreter_runner, kernel_test, run_under_the_interpreter

from fairseq_softtopk.dispatch_count import DispatchCounter
from fairseq_softtopk.ops.kernels import loading, sorted_soft_topk_op
from fairseq_softtopk.modules.beam_search import unroll_beam_search
from fairseq_softtopk.ops import sorted_soft_topk


def test_counts_kernels_and_host_reads_of_known_code():
    with DispatchCounter() as counter:
        a = torch.ones(4)  # 1 launch (a fill)
        b = a * 2 + 1  # 2 launches
        b.view(2, 2).t()  # views: none
        torch.empty(3)  # an uninitialised allocation: none
        float(b.sum())  # 1 launch (sum), 1 sync (the host reads the value)
        b[b > 2]  # 2 launches (gt, index), 1 sync (the number of True entries decides the output size)
        b.tolist()  # 1 sync (a copy to the host)
        b.cpu().to("cpu").cpu()  # 1 sync: the first copy; the tensor it returns is on the host already
        b.nonzero()  # 1 launch, 1 sync
        b.new_tensor(1.0)  # 1 sync: on a GPU, a copy of Python data from pageable host memory waits
        torch.tensor([1.0, 2.0])  # 1 sync, as above
        torch.as_tensor(b)  # already a tensor: none
    assert counter.total("launches") == 7
    assert counter.total("syncs") == 7
    assert set(counter.counts["launches"]) == {("other",)}  # outside any range, in the forward pass
    assert counter.ops["syncs"][(("other",), "_local_scalar_dense.default")] == 1


def test_attributes_counts_to_the_open_package_ranges_and_the_backward_pass():
    x = torch.randn(5, requires_grad=True)
    with DispatchCounter() as counter:
        with record_function("softtopk::outer"):
            y = x * 3  # 1 launch in ("outer",)
            with record_function("softtopk::inner"), record_function("not_ours"):
                z = y.exp()  # 1 launch in ("outer", "inner"): other ranges are not part of the path
            int(z.argmax())  # 1 launch, 1 sync in ("outer",)
        z.sum().backward()
    assert counter.counts["launches"][("outer",)] == 2 and counter.counts["syncs"][("outer",)] == 1
    assert counter.counts["launches"][("outer", "inner")] == 1
    assert counter.total("launches", inside="outer") == 3
    assert counter.total("launches", innermost="inner") == 1
    assert counter.total("launches", innermost="backward") > 0  # the sum's, exp's and mul's backward
    assert counter.total("launches", innermost="other") >= 1  # sum, outside the ranges
    assert counter.by_innermost("launches")["outer"] == 2
    assert sum(counter.by_innermost("launches").values()) == counter.total("launches")


def test_the_fixed_iteration_solve_never_waits_on_the_device_and_the_adaptive_one_does():
    """The claim behind --topk-fixed-iterations: no host synchronisation, forward or backward (its
    backward inside the operator's own named range); the adaptive solve reads its convergence."""
    scores = torch.randn(6, 40, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grad = torch.randn(6, 40, 3, generator=torch.Generator().manual_seed(1))
    syncs = {}
    for fixed in (False, True):
        with DispatchCounter() as counter:
            A = sorted_soft_topk(scores, 3, epsilon=0.1, max_iter=15, fixed_iterations=fixed, warn=False)
            (A * grad).sum().backward()
        syncs[fixed] = counter.total("syncs")
        assert counter.total("launches", innermost="sorted_soft_topk") > 15  # at least one per iteration
        assert counter.total("launches", innermost="sorted_soft_topk_backward") > 0
    assert syncs[True] == 0
    assert syncs[False] > 0


@pytest.mark.parametrize("pool", [0, 12])
def test_the_sync_free_beam_unroll_has_no_host_synchronisation_forward_or_backward(rng, pool):
    """The CPU counterpart of tests/test_cuda.py's sync debug mode test: --topk-fixed-iterations' whole
    unroll (every step's scores, selection, solve and mixing, then the backward pass) reads nothing on the
    host; the adaptive window (a pool, or --topk-window-width 0) does, once per step at least (its solves'
    convergence), and the default static window once per batch (its steps' certificates and NaN counts)."""
    dictionary = word_dictionary(13)
    model = build_model(dictionary, scale=3.0)
    sample = make_sample(dictionary, rng, [5, 3, 4])
    syncs = {}
    for fixed in (False, True):
        criterion = build_criterion(dictionary, topk_fixed_iterations=fixed, topk_max_iter=12, topk_candidate_pool=pool,
                                    teacher_forcing_ratio=0.0, topk_window_width=0)
        encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
        with DispatchCounter() as counter:
            beam = unroll_beam_search(model.decoder, encoder_out, model.encoder.reorder_encoder_out, sample["target"],
                                      dictionary.pad(), dictionary.eos(), criterion.search)
            (beam.gold_lprobs.sum() + beam.scale_probe).backward()
        syncs[fixed] = counter.total("syncs")
        assert counter.total("launches", inside="sorted_soft_topk") > 0
    assert syncs[True] == 0
    assert syncs[False] >= sample["target"].shape[1]
    if not pool:  # the default: the static window
        criterion = build_criterion(dictionary, topk_max_iter=12, teacher_forcing_ratio=0.0)
        encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
        with DispatchCounter() as counter:
            beam = unroll_beam_search(model.decoder, encoder_out, model.encoder.reorder_encoder_out, sample["target"],
                                      dictionary.pad(), dictionary.eos(), criterion.search)
            (beam.gold_lprobs.sum() + beam.scale_probe).backward()
        assert counter.total("launches", inside="sorted_soft_topk_window") > 0
        # the target's check before the search, the certificates and NaN counts after it
        assert counter.total("syncs") == 2 and counter.total("syncs", inside="beam_step") == 0


@interpreter_runner
def test_kernels_under_the_interpreter(repo_root):
    """The kernel tests of this file, in a child pytest started with ``TRITON_INTERPRET=1``."""
    run_under_the_interpreter(__file__, repo_root, "test_kernel_")


class _NoKernel:
    """A kernel that does nothing when launched (named as the one it stands for)."""

    def __init__(self, kernel):
        self.fn = getattr(kernel, "fn", kernel)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@kernel_test
def test_kernel_launches_count_once_each_with_the_work_around_them_and_none_of_the_interpreters(rng, monkeypatch):
    """The Triton path of ``sorted_soft_topk``, forward and backward: each kernel launch counts once, by name,
    with the ATen operations the custom ops run around them (their warm start, allocations); the kernel's own
    work (under the interpreter, host copies of its arguments) counts for nothing: the same calls with kernels
    that do nothing count the same."""
    x = torch.randn(4, 300, generator=rng, dtype=torch.float64).to(DEVICE).requires_grad_()
    grad = torch.randn(4, 300, 3, generator=rng, dtype=torch.float64).to(DEVICE)

    def count():
        with DispatchCounter() as counter:
            out = sorted_soft_topk(x, 3, epsilon=0.1, backend="triton", fixed_iterations=True)
            torch.autograd.grad((out * grad).sum(), x)
        return counter

    counted = count()
    launches = {op: n for (_, op), n in counted.ops["launches"].items() if op.endswith("_kernel")}
    assert launches == {"_sorted_forward_kernel": 1, "_sorted_backward_kernel": 1}
    assert counted.total("launches", innermost="sorted_soft_topk_backward") == 1  # the backward kernel alone
    inside_forward_op = counted.total("launches", innermost="sorted_soft_topk")
    monkeypatch.setattr(sorted_soft_topk_op, "launch",
                        lambda kernel, grid, *args, **kwargs: loading.launch(_NoKernel(kernel), grid))
    assert count().ops["launches"] == counted.ops["launches"]
    # the op's setup is counted: more than the kernel and the calls around the op
    monkeypatch.setattr(sorted_soft_topk_op, "hard_start", lambda top, *args: top.new_zeros(top.shape))
    assert count().total("launches", innermost="sorted_soft_topk") < inside_forward_op


@kernel_test
def test_kernel_rows_of_bench_train_are_counted_on_the_cpu(toy_data_bin, capsys):
    """``bench_train --triton``'s kernel rows on a CPU under the interpreter: not timed, but counted (what CI can
    check without a GPU): the backward of each step's selection is the backward kernel alone, and the forward solve
    a kernel with its setup, far fewer launches than the torch path's iterations."""
    if DEVICE == "cuda":
        pytest.skip("on a GPU the kernel rows are timed: tests/test_bench_scripts.py")
    bench_train = script_module("bench/bench_train.py")
    threads = torch.get_num_threads()
    try:
        assert bench_train.main(["--data", str(toy_data_bin[1]), "--arch", "softtopk_lstm_tiny", "--updates", "1",
                                 "--warmup", "0", "--max-tokens", "200", "--threads", "1", "--beam", "3",
                                 "--profile-updates", "1", "--count-updates", "1", "--in-process",
                                 "--configs", "beam_soft_fixed,beam_soft_fixed:triton"]) == 0
    finally:
        torch.set_num_threads(threads)
    counting = capsys.readouterr().out.split("launches (dispatched ATen operations)")[1]
    header = next(line for line in counting.splitlines() if line.startswith("| config |"))
    columns = [c.strip() for c in header.split("|")[2:-1]]
    rows = {}
    for line in counting.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells and cells[0] in ("beam_soft_fixed", "beam_soft_fixed:triton"):
            rows[cells[0]] = dict(zip(columns, cells[1:]))
    torch_path, kernels = rows["beam_soft_fixed"], rows["beam_soft_fixed:triton"]
    assert float(kernels["solve bwd"]) == 1.0 and float(torch_path["solve bwd"]) > 10
    assert 1 <= float(kernels["solve"]) < float(torch_path["solve"]) / 10
    assert float(kernels["syncs/step"]) == 0.0  # the fixed-iteration search waits for nothing, kernels included


@kernel_test
def test_kernel_default_soft_search_launches_at_most_hards_plus_ten_a_step(rng):
    """The default soft search on the kernels (the static window: ``torch.topk`` and one launch forward, a zero fill
    and one launch backward) against hard mode's search on the same model and batch: at most 10 more launches a
    decoding step, forward and backward together, and no host read inside a step (the issue's CPU-countable
    target; benchmarks/bench_train_multi30k_lstm_window_cpu.md counts the Multi30k LSTM). The model's scores are
    peaked (scale 3), so that no row overflows its window (an overflow searches the batch again)."""
    dictionary = word_dictionary(13)
    model = build_model(dictionary, scale=3.0).to(DEVICE)
    sample = make_sample(dictionary, rng, [5, 3, 4])
    sample = {"net_input": {key: value.to(DEVICE) for key, value in sample["net_input"].items()},
              "target": sample["target"].to(DEVICE)}
    per_step = {}
    for mode in ("soft", "hard"):
        criterion = build_criterion(dictionary, topk_mode=mode, topk_backend="triton", teacher_forcing_ratio=0.0)
        encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
        with DispatchCounter() as counter:
            beam = unroll_beam_search(model.decoder, encoder_out, model.encoder.reorder_encoder_out, sample["target"],
                                      dictionary.pad(), dictionary.eos(), criterion.search)
            loss = beam.gold_lprobs.sum()
            (loss if beam.scale_probe is None else loss + beam.scale_probe).backward()  # hard mode: no cap probe
        assert counter.total("syncs", inside="beam_step") == 0
        if mode == "soft":
            kernels = {op: n for (_, op), n in counter.ops["launches"].items() if op.endswith("_kernel")}
            steps = sample["target"].shape[1]
            # one forward launch a step (no retry); a backward launch for each step whose selection the loss reaches
            assert set(kernels) == {"_window_forward_kernel", "_window_backward_kernel"}
            assert kernels["_window_forward_kernel"] == steps and 0 < kernels["_window_backward_kernel"] <= steps
        per_step[mode] = counter.total("launches") / sample["target"].shape[1]
    assert per_step["soft"] <= per_step["hard"] + 10, per_step
