"""Smoke tests of the benchmark scripts (tiny problems and models; numbers checked for sense, not speed)."""

import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import compiles_fixed_solve, script_module
from fairseq_softtopk.experiments.bench_passes import kernel_calls

bench_train = script_module("bench/bench_train.py")


def test_criterion_args_per_config():
    assert bench_train.criterion_args("teacher_forcing", 5, 0.1, 50, 0.8)[-2:] == ["--teacher-forcing-ratio", "1.0"]
    assert "hard" in bench_train.criterion_args("beam_hard", 5, 0.1, 50, 0.8)
    pool = bench_train.criterion_args("beam_soft_pool", 5, 0.1, 50, 0.8)
    assert pool[pool.index("--topk-candidate-pool") + 1] == "50"
    adaptive = bench_train.criterion_args("beam_soft_adaptive", 5, 0.1, 50, 0.8)
    assert adaptive == bench_train.criterion_args("beam_soft", 5, 0.1, 50, 0.8) + ["--topk-window-width", "0"]
    with pytest.raises(ValueError, match="beam_medium"):
        bench_train.criterion_args("beam_medium", 5, 0.1, 50, 0.8)


def test_compiled_config_is_the_fixed_search_under_torch_compile_and_runs_only_on_request():
    fixed = bench_train.criterion_args("beam_soft_fixed", 5, 0.1, 50, 0.8)
    assert bench_train.criterion_args("beam_soft_compiled", 5, 0.1, 50, 0.8) == fixed + ["--topk-compile", "default"]
    assert "beam_soft_compiled" in bench_train.CONFIGS and "beam_soft_compiled" not in bench_train.DEFAULT_CONFIGS


def test_risk_configs_build_the_criteria_of_the_risk_ablation(toy_data_bin):
    """risk_hard / risk_soft are the ablation's hard_risk / soft_risk arms (the same criterion and search);
    risk_beamgrad its beamgrad_mrt arm; none runs without being asked for."""
    from fairseq_softtopk.experiments.bench_harness import build_training_parts

    _, data_bin = toy_data_bin
    assert not {"risk_hard", "risk_soft", "risk_beamgrad"} & set(bench_train.DEFAULT_CONFIGS)
    for config, mode in (("risk_hard", "hard"), ("risk_soft", "soft")):
        flags = ["--arch", "softtopk_lstm_tiny", *bench_train.criterion_args(config, 3, None, 10, 0.23)]
        _, _, criterion = build_training_parts(data_bin, flags, 1)
        assert type(criterion).__name__ == "SoftBeamSearchCriterion"
        assert criterion.beam_loss == "risk" and criterion.search.mode == mode and criterion.search.beam == 3
    beamgrad = bench_train.criterion_args("risk_beamgrad", 3, None, 10, 0.23)
    assert beamgrad[:2] == ["--criterion", "beamgrad_risk"] and "--topk-mode" not in beamgrad


def test_beam_sparse_is_the_sparse_arm_and_its_operator_time_is_counted(toy_data_bin, capsys):
    """beam_sparse builds the sparse ablation arm's criterion (quadratic, lambda --sparse-lambda whatever
    --epsilon says), not by default; its top-k columns read the sparse operator's named ranges, forward
    inside the selection, and its launch table books the sparse solve as ``solve``."""
    from fairseq_softtopk.experiments.bench_harness import build_training_parts

    _, data_bin = toy_data_bin
    assert "beam_sparse" in bench_train.CONFIGS and "beam_sparse" not in bench_train.DEFAULT_CONFIGS
    flags = ["--arch", "softtopk_lstm_tiny", *bench_train.criterion_args("beam_sparse", 3, 0.03, 10, 0.8,
                                                                         sparse_lambda=0.2)]
    _, _, criterion = build_training_parts(data_bin, flags, 1)
    assert criterion.search.regularizer == "quadratic" and criterion.search.epsilon == 0.2
    assert criterion.search.mode == "soft" and criterion.search.beam == 3
    tiny = ["--data", str(data_bin), "--arch", "softtopk_lstm_tiny", "--updates", "2", "--warmup", "1",
            "--max-tokens", "200", "--threads", "1", "--beam", "3", "--configs", "beam_hard,beam_sparse",
            "--in-process", "--pretrain-updates", "2", "--sparse-lambda", "0.5"]
    threads = torch.get_num_threads()
    try:
        assert bench_train.main(tiny) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "sparse_lambda=0.5" in out
    timing, counting = out.split("launches (dispatched ATen operations)")
    row = next(line for line in timing.splitlines() if line.startswith("| beam_sparse |")).split("|")[2:-1]
    fwd, bwd, select, mix = (float(row[i].strip().rstrip("%")) for i in (5, 6, 7, 8))
    assert 0 < fwd < select < 100 and 0 < bwd < 100 and 0 < mix < 100
    header = next(line for line in counting.splitlines() if line.startswith("| config |"))
    names = [cell.strip() for cell in header.split("|")[2:-1]]
    counts = dict(zip(names, next(line for line in counting.splitlines()
                                  if line.startswith("| beam_sparse |")).split("|")[2:-1]))
    assert float(counts["solve"]) > 0 and float(counts["solve bwd"]) > 0


INDUCTOR_CODE = """
from torch._inductor.select_algorithm import extern_kernels
cpp_fused_add_0 = async_compile.cpp_pybinding(['float*'], 'extern "C" void kernel(...)')

def call(args):
    arg0_1, arg1_1 = args
    buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
    cpp_fused_add_0(arg0_1, buf0)
    buf1 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
    extern_kernels.bmm(buf0, arg1_1, out=buf1)
    triton_poi_fused_mul_1.run(buf1, buf0, 16, stream=stream0)
    buf2 = aten.topk.default(buf0, 3)
    del buf1
    return (buf0, buf2)


def benchmark_compiled_module(times=10, repeat=10):
    cpp_fused_add_0(arg0_1, buf0)
"""


def test_kernel_calls_counts_the_kernels_that_inductor_code_calls():
    assert kernel_calls(INDUCTOR_CODE) == 4  # inside call(): not the benchmark's, not allocations
    assert kernel_calls("x = 1") == 0


def test_summarize_takes_the_fastest_run_of_each_update():
    def update(seconds, newton):
        return {"seconds": seconds, "tokens": 10, "newton_iters": newton, "solves": 2.0}

    def profile(seconds, fwd):
        return {"profiled_seconds": seconds, "topk_fwd": fwd, "topk_bwd": 0.1, "select": 2 * fwd, "mix": 0.2}

    runs = [{"updates": [update(2.0, 8.0), update(1.0, 2.0)], "peak_mib": 100.0, "growth_mib": 10.0,
             "profile": profile(4.0, 1.0)},
            {"updates": [update(1.0, 4.0), update(3.0, 6.0)], "peak_mib": 120.0, "growth_mib": 5.0,
             "profile": profile(2.0, 1.0)}]
    summary = bench_train.summarize(runs)
    assert summary["ms_per_update"] == pytest.approx(1000.0)  # (1.0 + 1.0) / 2 updates
    assert summary["tokens_per_s"] == pytest.approx(10.0)
    assert summary["newton_per_call"] == pytest.approx(1.5)  # (4 + 2) iterations / (2 + 2) solves
    assert summary["topk_fwd_share"] == pytest.approx(0.5)  # the faster profiled pass: 1.0 of 2.0 s
    assert summary["select_share"] == pytest.approx(1.0)
    assert summary["mix_share"] == pytest.approx(0.1)
    assert summary["peak_mib"] == 120.0 and summary["growth_mib"] == 10.0


def test_summarize_reports_the_median_and_the_slowest_update():
    # one slow update among fast ones (a kernel compiled while timed) lifts the mean, not the median
    seconds = [0.1, 0.1, 2.5, 0.1, 0.2]
    run = {"updates": [{"seconds": s, "tokens": 10, "newton_iters": 0.0, "solves": 0.0} for s in seconds],
           "peak_mib": 1.0, "growth_mib": 0.0,
           "profile": {"profiled_seconds": 1.0, "topk_fwd": 0.0, "topk_bwd": 0.0, "select": 0.0, "mix": 0.0}}
    summary = bench_train.summarize([run])
    assert summary["ms_per_update"] == pytest.approx(600.0)  # 3.0 s / 5
    assert summary["median_ms"] == pytest.approx(100.0)
    assert summary["slowest_ms"] == pytest.approx(2500.0)


def test_range_seconds_reads_the_named_ranges_of_a_profile():
    """The package's ranges, as torch.profiler records them, timed against a known sleep."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from fairseq_softtopk.experiments.bench_harness import range_seconds
    from fairseq_softtopk.ops import sorted_soft_topk

    x = torch.randn(3, 50, dtype=torch.float64, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("softtopk::select_beams"):
            time.sleep(0.05)
            A = sorted_soft_topk(x, 3, epsilon=0.1)
        A.sum().backward()
    seconds = range_seconds(prof.events())
    assert 0.05 <= seconds["softtopk::select_beams"] < 0.5
    assert 0 < seconds["softtopk::sorted_soft_topk"] < seconds["softtopk::select_beams"] - 0.05 + 1e-3
    assert seconds["softtopk::sorted_soft_topk_backward"] > 0
    assert seconds["softtopk::mix_beams"] == 0.0


@pytest.mark.slow
def test_bench_train_has_transformer_rows(toy_data_bin, capsys):
    """--arch takes a Transformer: the search drives its decoder step by step; the table has its rows, the mixing
    of its caches is inside the mix range, and hard mode solves nothing."""
    _, data_bin = toy_data_bin
    argv = ["--data", str(data_bin), "--arch", "softtopk_transformer_tiny", "--updates", "1", "--warmup", "0",
            "--max-tokens", "200", "--threads", "1", "--beam", "3", "--profile-updates", "1", "--count-updates", "1",
            "--configs", "teacher_forcing,beam_hard,beam_soft", "--in-process"]
    threads = torch.get_num_threads()
    try:
        assert bench_train.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    timing, counting = capsys.readouterr().out.split("launches (dispatched ATen operations)")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in timing.splitlines()
            if re.match(r"\| (teacher_forcing|beam_\w+) \|", line)}
    assert set(rows) == {"teacher_forcing", "beam_hard", "beam_soft"}
    assert float(rows["beam_soft"][8].rstrip("%")) > 0 and float(rows["beam_hard"][8].rstrip("%")) > 0  # mix
    assert float(rows["beam_soft"][5].rstrip("%")) > 0 and rows["beam_hard"][5] == "0.0%"  # top-k forward
    assert float(rows["beam_soft"][1]) > float(rows["teacher_forcing"][1])


@pytest.mark.slow
def test_bench_train_prints_a_row_per_config(toy_data_bin, capsys):
    _, data_bin = toy_data_bin
    tiny = ["--data", str(data_bin), "--arch", "softtopk_lstm_tiny", "--updates", "2", "--warmup", "1",
            "--max-tokens", "200", "--threads", "1", "--beam", "3", "--candidate-pool", "10",
            "--window-width", "100000"]
    threads = torch.get_num_threads()
    try:
        assert bench_train.main(tiny + ["--in-process", "--pretrain-updates", "2"]) == 0
    finally:
        torch.set_num_threads(threads)  # main sets it for the whole process
    out = capsys.readouterr().out
    assert out.startswith("command: ")
    assert "pretrained 2 teacher-forced updates" in out
    timing, counting = out.split("launches (dispatched ATen operations)")

    def table(text):
        return {line.split("|")[1].strip(): line.split("|")[2:-1] for line in text.splitlines()
                if re.match(r"\| (teacher_forcing|beam_\w+) \|", line)}

    rows = table(timing)
    assert set(rows) == set(bench_train.DEFAULT_CONFIGS)  # the compiled config only on request
    ms = {name: float(row[1]) for name, row in rows.items()}
    for name, row in rows.items():  # the ratio column is the table's own ms/update over hard's
        ratio = ms[name] / ms["beam_hard"]
        # up to the printed roundings: 0.05 ms on each time (a tiny model's ms are small), 0.005 on the ratio
        rounding = ratio * (0.05 / ms[name] + 0.05 / ms["beam_hard"]) + 0.005
        assert float(row[-1].strip().rstrip("x")) == pytest.approx(ratio, abs=rounding + 1e-9)
    assert ms["teacher_forcing"] < ms["beam_hard"]  # no search at all
    for row in rows.values():  # median and slowest update beside the mean
        assert float(row[2]) <= float(row[3]) and float(row[1]) <= float(row[3])
    share = {name: [float(row[i].strip().rstrip("%")) for i in (5, 6, 7, 8)] for name, row in rows.items()}
    assert share["teacher_forcing"] == [0.0, 0.0, 0.0, 0.0]  # no top-k and no mixing without the beam
    assert share["beam_hard"][:2] == [0.0, 0.0] and share["beam_hard"][2] > 0  # hard: topk only
    for name in ("beam_hard", "beam_soft", "beam_soft_adaptive", "beam_soft_pool", "beam_soft_fixed"):
        assert 0 < share[name][3] < 100  # every beam step mixes its next inputs and states
    for name in ("beam_soft", "beam_soft_adaptive", "beam_soft_pool", "beam_soft_fixed"):
        fwd, bwd, select, _ = share[name]
        assert 0 < fwd < select < 100 and 0 < bwd < 100  # the selection contains the operator's forward
        assert float(rows[name][9]) >= 1  # Newton iterations per solve, from the criterion's logging
    assert rows["beam_hard"][9].strip() == "-" and rows["teacher_forcing"][9].strip() == "-"
    assert float(rows["beam_soft_fixed"][9]) == 15  # exactly --fixed-iter (default 15) per solve
    assert "target <= 1.25x" in out
    for name, value in ms.items():  # each run's times printed as it ended (a stopped benchmark keeps them)
        line = next(line for line in out.splitlines() if line.startswith(f"run 1/1 of {name}: "))
        assert float(line.split(": ")[1].split(" ms/update")[0]) == pytest.approx(value, abs=0.051)

    # launches and syncs per decoding step (columns as format_count_table's header)
    header = next(line for line in counting.splitlines() if line.startswith("| config |"))
    names = [cell.strip() for cell in header.split("|")[2:-1]]
    counts = {name: dict(zip(names, row)) for name, row in table(counting).items()}
    assert set(counts) == set(bench_train.DEFAULT_CONFIGS)
    value = {name: {col: float(cell.strip().rstrip("x")) for col, cell in row.items()} for name, row in counts.items()}
    parts = ["step", "select", "solve", "mix", "solve bwd", "other bwd", "per batch"]
    for name, v in value.items():
        assert sum(v[part] for part in parts) == pytest.approx(v["launches/step"], abs=4)  # up to the roundings
        assert v["vs hard"] == pytest.approx(v["launches/step"] / value["beam_hard"]["launches/step"], abs=0.01)
        assert v["fused vs hard"] == pytest.approx(v["fused solve"] / value["beam_hard"]["launches/step"], abs=0.01)
        assert v["fused solve"] == pytest.approx(v["launches/step"] - v["solve"] - v["solve bwd"]
                                                 + 2 * (v["solve"] > 0), abs=2)
    for name in ("teacher_forcing", "beam_hard"):
        assert value[name]["solve"] == value[name]["solve bwd"] == 0  # no soft top-k
    assert value["teacher_forcing"]["launches/step"] < value["beam_hard"]["launches/step"]
    for name in ("beam_soft", "beam_soft_adaptive", "beam_soft_pool", "beam_soft_fixed"):
        assert value[name]["solve"] > 0 and value[name]["solve bwd"] > 0
        assert value[name]["launches/step"] > value["beam_hard"]["launches/step"]
    assert value["beam_soft_adaptive"]["syncs/step"] > 0  # the adaptive solve reads its convergence on the host
    for name in ("beam_soft", "beam_soft_fixed"):  # the sync-free searches: none in a step, none in backward
        assert value[name]["syncs/step"] == 0, name  # (beam_soft's window holds every candidate: never overflows)
    # every fixed-iteration solve runs its whole budget: more launches than the adaptive solve's
    assert value["beam_soft_fixed"]["solve"] > value["beam_soft_pool"]["solve"]

    # one configuration in its own process, as the default (isolated) mode runs them
    result = bench_train.run_isolated(bench_train.build_parser().parse_args(tiny), tiny, "beam_soft")
    assert len(result["updates"]) == 2 and result["peak_mib"] > 0
    assert all(r["newton_iters"] >= r["solves"] > 0 for r in result["updates"])
    assert 0 < result["profile"]["topk_fwd"] < result["profile"]["select"] < result["profile"]["profiled_seconds"]
    assert 0 < result["profile"]["mix"] < result["profile"]["profiled_seconds"]


def test_bench_ops_prints_every_method_with_our_solver_converged(capsys):
    bench_ops = script_module("bench/bench_ops.py")

    assert bench_ops.main(["--n", "300", "--k", "3", "--eps", "0.1", "--repeats", "2", "--threads", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| topk n=")
            or line.startswith("| sorted n=")]
    assert [r[1].strip() for r in rows] == ["ours", "paper", "unrolled", "topk"] * 2
    medians = {(r[0].strip(), r[1].strip()): float(r[2]) for r in rows}
    for r in rows:
        case, method, median, best = r[0].strip(), r[1].strip(), float(r[2]), float(r[4])
        assert 0 < best <= median
        if method != "topk":  # "vs topk" is the median over torch.topk's: topk cancels between two rows
            vs_topk_paper = float(next(o for o in rows if o[0] == r[0] and o[1].strip() == "paper")[3])
            assert float(r[3]) / vs_topk_paper == pytest.approx(median / medians[(case, "paper")], rel=0.05)
        if method == "ours":
            assert float(r[7]) <= 1e-4 and "NOT CONVERGED" not in r[8]
            faster = float(re.search(r"([0-9.]+)x faster", r[8]).group(1))
            assert faster == pytest.approx(medians[(case, "paper")] / median, rel=0.1)
        if method == "unrolled":  # autograd keeps every Sinkhorn iteration; ours keeps one plan
            assert float(r[6]) > float(next(o for o in rows if o[0] == r[0] and o[1].strip() == "ours")[6])


def test_bench_ops_warms_up_every_method_before_the_first_timed_case(monkeypatch, capsys):
    """On a GPU the first call initialises CUDA (seconds), which the first timed case measured."""
    bench_ops = script_module("bench/bench_ops.py")

    calls = []
    real = bench_ops.bench_case

    def recorded(n, k, eps, sorted_op, repeats, tol, device, **options):
        calls.append((n, sorted_op, repeats))
        return real(n, k, eps, sorted_op, repeats, tol, device, **options)

    monkeypatch.setattr(bench_ops, "bench_case", recorded)
    assert bench_ops.main(["--n", "300", "--k", "2", "--eps", "0.1", "--repeats", "2", "--threads", "1"]) == 0
    # untimed warm-up of both operators (every method runs inside bench_case) first, then the cases
    assert calls == [(1000, False, 1), (1000, True, 1), (300, False, 2), (300, True, 2)]


@compiles_fixed_solve
def test_bench_ops_times_the_fixed_iteration_solve_plain_and_compiled(monkeypatch, capsys):
    """--fixed-iterations adds the sync-free solve; --compile the same call under
    torch.compile(fullgraph=True) (here the aot_eager backend: inductor's C++ build takes a minute
    per case), which must give the fixed solve's output."""
    bench_ops = script_module("bench/bench_ops.py")

    compiled = []
    real_compile = torch.compile

    def compile_traced(fn, **options):
        compiled.append(options)
        return real_compile(fn, fullgraph=options["fullgraph"], dynamic=options["dynamic"], backend="aot_eager")

    monkeypatch.setattr(bench_ops.torch, "compile", compile_traced)
    torch._dynamo.reset()
    assert bench_ops.main(["--n", "300", "--k", "3", "--eps", "0.1", "--repeats", "2", "--threads", "1",
                           "--fixed-iterations", "12", "--compile", "reduce-overhead"]) == 0
    torch._dynamo.reset()
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| topk n=")
            or line.startswith("| sorted n=")]
    assert [r[1].strip() for r in rows] == ["ours", "ours_fixed", "ours_compiled", "paper", "unrolled", "topk"] * 2
    assert compiled and all(o["fullgraph"] and o["mode"] == "reduce-overhead" for o in compiled)
    for r in rows:
        if r[1].strip() == "ours_fixed":  # 12 iterations, converged, the marginal error reached
            assert "12 it" in r[8] and "NOT CONVERGED" not in r[8] and float(r[7]) <= 1e-4
        if r[1].strip() == "ours_compiled":  # err: the largest difference from ours_fixed's output
            assert float(r[7]) <= 1e-5 and "x faster" in r[8]


def test_bench_ops_refuses_compile_without_a_fixed_iteration_budget(capsys):
    bench_ops = script_module("bench/bench_ops.py")

    with pytest.raises(SystemExit):
        bench_ops.main(["--n", "300", "--compile", "default"])
    assert "--compile needs --fixed-iterations" in capsys.readouterr().err


def test_bench_ops_times_batches_of_the_linear_cost_without_the_paper_baselines(capsys):
    bench_ops = script_module("bench/bench_ops.py")

    assert bench_ops.main(["--ops", "sorted_soft_topk", "--n", "200", "--k", "20", "--eps", "0.1", "--cost", "linear",
                           "--batch", "3", "--tol", "1e-5", "--repeats", "2", "--threads", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| sorted")]
    assert [r[0].strip() for r in rows] == ["sorted n=2e+02 k=20 eps=0.1 linear batch=3"] * 4
    by = {r[1].strip(): r for r in rows}
    assert "skipped" in by["paper"][8] and "skipped" in by["unrolled"][8]
    assert float(by["ours"][7]) <= 1e-5 and "NOT CONVERGED" not in by["ours"][8]
    assert float(by["ours"][3]) > 1.0 and float(by["topk"][3]) == 1.0  # ratios to torch.topk's median


def test_bench_ops_times_the_sparse_operators_with_their_support(capsys):
    """--sparse adds the quadratically regularised operators to each case (linear cost): converged, with the
    support the note reports equal to the operator's nonzero entries recomputed here."""
    from fairseq_softtopk.ops import sorted_sparse_soft_topk, sparse_soft_topk

    bench_ops = script_module("bench/bench_ops.py")
    assert bench_ops.main(["--n", "300", "--k", "3", "--eps", "0.1", "--repeats", "2", "--threads", "1",
                           "--cost", "linear", "--sparse"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| topk n=")
            or line.startswith("| sorted n=")]
    assert [r[1].strip() for r in rows] == ["ours", "paper", "unrolled", "sparse", "topk"] * 2
    x = torch.randn(1, 300, generator=torch.Generator(device="cpu").manual_seed(303))  # bench_case's scores
    for r in rows:
        if r[1].strip() != "sparse":
            continue
        support = float(re.search(r"support ([0-9.]+) of 300", r[8]).group(1))
        if r[0].startswith(" sorted"):
            assert "NOT CONVERGED" not in r[8] and float(r[7]) <= 1e-4
            assert support == int((sorted_sparse_soft_topk(x, 3, regularization=0.1).sum(-1) > 0).sum())
        else:
            assert support == int((sparse_soft_topk(x, 3, regularization=0.1) > 0).sum())
        assert 3 <= support < 300


def test_bench_ops_refuses_sparse_without_the_linear_cost(capsys):
    with pytest.raises(SystemExit):
        script_module("bench/bench_ops.py").main(["--n", "300", "--sparse"])
    assert "--sparse needs --cost linear" in capsys.readouterr().err


WINDOW_NOTE = re.compile(r"^(\d+) it; W=(\d+) of (\d+); rows need (\d+) median, (\d+) max; (OVERFLOW|overflow) (\d+) of "
                         r"(\d+) rows")


def test_bench_ops_times_the_static_window_with_its_width_and_overflow(capsys):
    """--window adds sorted_soft_topk_window (sorted operator, linear cost), timed forward + backward on its ranks;
    its note gives the window's width and the rows it does not cover, as a direct call on the case's scores finds
    them: every standard normal row overflows the default window at epsilon 0.1, no log-probability row does, and
    a width of 16 leaves three of the four log-probability rows flagged. The kernel row is skipped off CUDA."""
    from fairseq_softtopk.ops import sorted_soft_topk_window

    bench_ops = script_module("bench/bench_ops.py")
    common = ["--n", "2000", "--k", "3", "--eps", "0.1", "--cost", "linear", "--batch", "4", "--repeats", "2",
              "--threads", "1", "--device", "cpu", "--window"]
    assert bench_ops.main([*common, "--ops", "sorted_soft_topk", "soft_topk", "--scores", "normal", "logprobs",
                           "--triton"]) == 0
    assert bench_ops.main([*common, "--ops", "sorted_soft_topk", "--scores", "logprobs", "--window-width", "16"]) == 0
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| topk n=") or line.startswith("| sorted n=")]
    cases = [case for i, case in enumerate(r[0] for r in rows) if i == 0 or rows[i - 1][0] != case]
    assert cases == ["sorted n=2e+03 k=3 eps=0.1 linear batch=4", "sorted n=2e+03 k=3 eps=0.1 linear batch=4 logprobs",
                     "topk n=2e+03 k=3 eps=0.1 linear batch=4", "topk n=2e+03 k=3 eps=0.1 linear batch=4 logprobs",
                     "sorted n=2e+03 k=3 eps=0.1 linear batch=4 logprobs"]
    methods = ["ours", "ours_triton", "ours_window", "ours_window_triton", "paper", "unrolled", "topk"]
    assert [r[1] for r in rows] == methods * 4 + ["ours", "ours_window", "paper", "unrolled", "topk"]
    windows = [r for r in rows if r[1] == "ours_window"]
    for r in windows[2:4]:  # the unsorted operator's cases
        assert r[2:8] == ["-"] * 6 and r[8] == "skipped: the sorted operator with the linear cost only"
    expected = []  # (scores, width, flagged rows) of the sorted cases, from the operator itself
    for scores, width in (("normal", None), ("logprobs", None), ("logprobs", 16)):
        x = bench_ops.make_scores(2000, 3, 4, scores)
        ranks, _, info = sorted_soft_topk_window(x, 3, epsilon=0.1, width=width, tol=1e-4, return_info=True)
        expected.append((ranks.shape[1], int(info.n_overflow)))
    assert expected == [(512, 4), (512, 0), (16, 3)]
    for r, (width, flagged) in zip(windows[:2] + windows[4:], expected):
        median, best, mbytes, err = float(r[2]), float(r[4]), float(r[6]), float(r[7])
        assert 0 < best <= median < float("inf") and 0 < mbytes and err <= 1e-4
        note = WINDOW_NOTE.match(r[8])
        assert note, r[8]
        assert int(note.group(1)) == 16 and int(note.group(2)) == width and note.group(3) == "2000"
        assert int(note.group(7)) == flagged and note.group(8) == "4"
        assert note.group(6) == ("OVERFLOW" if flagged else "overflow")
        need_median, need_max = int(note.group(4)), int(note.group(5))
        assert need_median <= need_max and (need_max > width) == (flagged > 0)  # a row needing more than W: flagged
    for r in rows:
        if r[1] == "ours_window_triton":
            assert r[8] in ("skipped: CUDA only (on the CPU the kernels run under Triton's interpreter)",
                            "skipped: the sorted operator with the linear cost only")


def test_bench_ops_window_kernel_row_asks_for_the_kernels_with_the_skip_lifted(monkeypatch, capsys):
    """With the CUDA-only skip lifted the ours_window_triton row is timed and its call asks for backend="triton"
    (the operators are spied on and run on the torch path: the kernels' own tests are tests/test_triton_*.py)."""
    bench_ops = script_module("bench/bench_ops.py")
    asked = {}

    def spy(name):
        real = getattr(bench_ops, name)

        def call(*args, backend, **options):
            asked.setdefault(name, []).append(backend)
            return real(*args, backend="torch", **options)
        return call

    monkeypatch.setattr(bench_ops, "triton_skip_reason", lambda device: "")
    for name in ("sorted_soft_topk", "sorted_soft_topk_window"):
        monkeypatch.setattr(bench_ops, name, spy(name))
    assert bench_ops.main(["--ops", "sorted_soft_topk", "--n", "2000", "--k", "3", "--eps", "0.03", "--cost", "linear",
                           "--batch", "2", "--scores", "logprobs", "--repeats", "1", "--threads", "1", "--device",
                           "cpu", "--window", "--triton"]) == 0
    rows = {r[1]: r for r in ([c.strip() for c in line.split("|")[1:-1]]
                              for line in capsys.readouterr().out.splitlines() if line.startswith("| sorted n="))}
    assert float(rows["ours_window_triton"][2]) > 0
    assert WINDOW_NOTE.match(rows["ours_window_triton"][8]).group(2) == "64"
    assert set(asked["sorted_soft_topk_window"]) == {"torch", "triton"}


def test_bench_ops_times_both_kernel_families_on_long_rows(monkeypatch, capsys):
    """A call the split kernels take (few long rows of the sorted operator) gets a second kernel row,
    ``ours_triton_rows``, whose call runs under ``one_program_a_row``; a call of more rows as long gets
    ``ours_triton_split``, under ``split_for_long_rows``. The operator is spied on and runs on the torch path (the
    kernels' own tests are tests/test_triton_*.py)."""
    from fairseq_softtopk.ops.kernels import sorted_soft_topk_split_op

    bench_ops = script_module("bench/bench_ops.py")
    asked, real = [], bench_ops.sorted_soft_topk

    def spy(*args, backend, **options):
        asked.append((backend, sorted_soft_topk_split_op.use_split_kernels(1, 2000),
                      sorted_soft_topk_split_op.use_split_kernels(3, 2000)))
        return real(*args, backend="torch", **options)

    monkeypatch.setattr(bench_ops, "triton_skip_reason", lambda device: "")
    monkeypatch.setattr(bench_ops, "sorted_soft_topk", spy)
    monkeypatch.setattr(sorted_soft_topk_split_op, "SPLIT_MIN_LENGTH", 1000)
    monkeypatch.setattr(sorted_soft_topk_split_op, "SPLIT_MAX_ROWS", 2)
    common = ["--ops", "sorted_soft_topk", "--n", "2000", "--k", "3", "--eps", "0.1", "--cost", "linear", "--repeats",
              "1", "--threads", "1", "--device", "cpu", "--triton", "--batch"]
    assert bench_ops.main([*common, "2"]) == 0
    assert bench_ops.main([*common, "3"]) == 0
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| sorted n=")]
    assert [r[1] for r in rows] == ["ours", "ours_triton", "ours_triton_rows", "paper", "unrolled", "topk",
                                    "ours", "ours_triton", "ours_triton_split", "paper", "unrolled", "topk"]
    assert rows[1][8].endswith("; split kernels") and rows[2][8].endswith("; one program a row")
    assert rows[7][8].endswith(" it") and rows[8][8].endswith("; split kernels")
    # as the calls were made: the default (few rows split, more not), one program forced, split forced
    assert {("triton", True, False), ("triton", False, False), ("triton", True, True)} <= set(asked)
    assert not sorted_soft_topk_split_op.use_split_kernels(3, 2000)  # the forcing ended with its block


def test_bench_ops_refuses_the_window_without_the_linear_cost(capsys):
    bench_ops = script_module("bench/bench_ops.py")
    with pytest.raises(SystemExit):
        bench_ops.main(["--n", "300", "--window"])
    assert "--window needs --cost linear" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_ops.main(["--n", "300", "--cost", "linear", "--window-width", "8"])
    assert "--window-width needs --window" in capsys.readouterr().err


def test_bench_ops_logprob_scores_are_log_probabilities_of_the_normal_rows():
    bench_ops = script_module("bench/bench_ops.py")
    z = bench_ops.make_scores(500, 5, 3)
    assert torch.equal(z, torch.randn(3, 500, generator=torch.Generator(device="cpu").manual_seed(505)))
    x = bench_ops.make_scores(500, 5, 3, "logprobs")
    assert torch.allclose(x.logsumexp(-1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(x - x[:, :1], bench_ops.LOGPROB_SCALE * (z - z[:, :1]), atol=1e-4)


def test_selection_support_counts_the_exact_support_and_draws_a_step(tmp_path):
    """scripts/diagnostics/selection_support.py on steps with known gaps: 1 nat between the best six candidates,
    the rest 25 nats below. At 0.1 the quadratic support is the beam's 5 exactly (a hard step), while the entropic
    selection gives the sixth, half a nat below its rank boundary, e^-5 (above 1e-4); at 5 the quadratic support
    takes the sixth too and nothing of the rest, the entropic weights reach every candidate; the figure is written."""
    support = script_module("diagnostics/selection_support.py")
    scores = torch.full((200,), -30.0, dtype=torch.float64)
    scores[:6] = -torch.arange(6, dtype=torch.float64)
    steps = [scores, scores.flip(0)]
    results = support.measure(steps, 5, [0.1, 5.0])
    sharp = results["quadratic"][0.1]
    assert sharp["mean_support"] == 5 and sharp["hard_share"] == 1.0 and sharp["sharpness"] == 1.0
    assert results["entropic"][0.1]["mean_support"] == 6 and results["entropic"][0.1]["sharpness"] < 1.0
    wide = results["quadratic"][5.0]
    assert wide["mean_support"] == 6 and wide["hard_share"] == 0.0 and wide["sharpness"] < 0.5
    assert results["entropic"][5.0]["mean_support"] == 200
    table = support.format_table(results, 5, 200)
    assert "| quadratic (nonzero weight (exact)) | 5 |" in table
    png = tmp_path / "step.png"
    support.plot_step(scores, 5, 0.5, 8, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _table_rows(text: str, names) -> dict:
    """``{first cell: [the other cells]}`` of the markdown rows of ``text`` whose first cell is in ``names``."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if line.startswith("| ") and cells and cells[0] in names:
            rows[cells[0]] = cells[1:]
    return rows


TINY_TRAIN = ["--arch", "softtopk_lstm_tiny", "--updates", "1", "--warmup", "0", "--max-tokens", "200", "--threads",
              "1", "--beam", "3", "--profile-updates", "1", "--count-updates", "1", "--in-process"]


def test_bench_train_lists_the_kernel_rows_and_skips_them_off_cuda():
    def backend(config, given=None):
        args = bench_train.criterion_args(config, 3, None, 10, 0.8, backend=given)
        return args[args.index("--topk-backend") + 1] if "--topk-backend" in args else None

    assert backend("beam_soft:triton") == "triton" and backend("beam_sparse", "torch") == "torch"
    assert backend("beam_soft") is None and backend("beam_hard", "torch") is None  # hard mode runs no operator
    assert bench_train.with_kernel_rows(["teacher_forcing", "beam_soft", "beam_hard", "beam_sparse"]) == [
        "teacher_forcing", "beam_soft", "beam_soft:triton", "beam_hard", "beam_sparse", "beam_sparse:triton"]
    # on the CPU nothing of a kernel row runs: it is listed in both tables, skipped
    opts = bench_train.build_parser().parse_args(["--device", "cpu", "--triton"])
    summary = bench_train.run_benchmark(opts, [], ["beam_soft:triton"])
    skipped = "skipped: CUDA only (on the CPU the kernels run under Triton's interpreter)"
    assert summary == {"beam_soft:triton": {"skipped": skipped}}
    for table in (bench_train.format_table(summary, "memory"), bench_train.format_count_table(summary)):
        row = _table_rows(table, ["beam_soft:triton"])["beam_soft:triton"]
        assert row[0] == skipped and set(row[1:]) == {"-"}
        header = next(line for line in table.splitlines() if line.startswith("| config |"))
        assert len(row) + 1 == header.count("|") - 1  # as many cells as columns
    assert "CUDA launches/step and CUDA syncs/step: n/a (not on CUDA)" in bench_train.format_count_table(summary)


bench_attention = script_module("bench/bench_attention.py")
TINY_ATTENTION = ["--updates", "1", "--warmup", "0", "--repeats", "1", "--max-tokens", "200"]


def test_bench_attention_lists_the_kernel_rows_and_skips_them_off_cuda(toy_data_bin, capsys):
    assert bench_attention.main(["--data", str(toy_data_bin[1]), *TINY_ATTENTION, "--normalizers",
                                 "softmax,sparse_topk", "--triton"]) == 0
    out = capsys.readouterr().out
    assert "clock=cpu device=cpu" in out
    rows = _table_rows(out, ("softmax", "sparse_topk", "sparse_topk:triton"))
    assert list(rows) == ["softmax", "sparse_topk", "sparse_topk:triton"]
    assert rows["sparse_topk:triton"][0] == "skipped: CUDA only (on the CPU the kernels run under Triton's interpreter)"
    for name in ("softmax", "sparse_topk"):  # launches, CUDA launches, CUDA syncs, fallbacks per update
        assert int(rows[name][4]) > 0 and rows[name][5:] == ["n/a", "n/a", "0"]
    assert int(rows["sparse_topk"][4]) > int(rows["softmax"][4])  # the operator's solve and its backward


def _lift_the_kernel_skip(monkeypatch, module, op_module, dispatch) -> list:
    """The kernel rows computed on the CPU, on the torch path: TRITON_INTERPRET=1 lets ``backend="triton"`` take
    CPU tensors, and the operator's kernel dispatch ``op_module.dispatch`` is replaced by a spy that records the
    backend it is asked for and declines (the interpreter runs the beam search's or the attention's thousands of
    small rows far too slowly for a test; the kernels themselves are tested in tests/test_triton_*.py). ``triton``
    is kept from being imported here (under the interpreter it would stay so for the rest of this process).
    Returns the list of backends the dispatch was asked for."""
    from fairseq_softtopk.ops.kernels import backend

    monkeypatch.setattr(module, "triton_skip_reason", lambda device: "")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "triton_import_error", lambda: "")
    monkeypatch.setitem(sys.modules, "triton", None)
    asked = []

    def spy(backend_name, *args):
        asked.append(backend_name)
        return False

    monkeypatch.setattr(op_module, dispatch, spy)
    return asked


def test_bench_train_computes_the_kernel_row_with_the_skip_lifted(toy_data_bin, monkeypatch, capsys):
    from fairseq_softtopk.ops.kernels import sorted_soft_topk_op

    window_module = sys.modules["fairseq_softtopk.ops.sorted_soft_topk_window"]  # the module, not the function

    asked = _lift_the_kernel_skip(monkeypatch, bench_train, sorted_soft_topk_op, "use_sorted_soft_topk_kernel")

    def window_spy(backend_name, *args):  # the default search's window operator asks too
        asked.append(backend_name)
        return False

    monkeypatch.setattr(window_module, "use_window_kernel", window_spy)
    threads = torch.get_num_threads()
    try:
        assert bench_train.main(["--data", str(toy_data_bin[1]), *TINY_TRAIN, "--configs", "beam_soft:triton"]) == 0
    finally:
        torch.set_num_threads(threads)
    timing, counting = capsys.readouterr().out.split("launches (dispatched ATen operations)")
    names = ["beam_soft:triton"]
    assert float(_table_rows(timing, names)["beam_soft:triton"][1]) > 0  # ms/update
    header = next(line for line in counting.splitlines() if line.startswith("| config |"))
    counts = {name: dict(zip([c.strip() for c in header.split("|")[2:-1]], row))
              for name, row in _table_rows(counting, names).items()}
    assert all(float(c["solve"]) > 0 and float(c["solve bwd"]) > 0 for c in counts.values())
    assert "CUDA launches/step and CUDA syncs/step: n/a (not on CUDA)" in counting
    assert asked and set(asked) == {"triton"}  # every solve of the row asked for the kernels


def test_bench_attention_computes_the_kernel_row_with_the_skip_lifted(toy_data_bin, monkeypatch, capsys):
    from fairseq_softtopk.ops.kernels import soft_topk_op

    asked = _lift_the_kernel_skip(monkeypatch, bench_attention, soft_topk_op, "use_soft_topk_kernel")
    assert bench_attention.main(["--data", str(toy_data_bin[1]), *TINY_ATTENTION, "--normalizers",
                                 "soft_topk:triton"]) == 0
    row = _table_rows(capsys.readouterr().out, ["soft_topk:triton"])["soft_topk:triton"]
    # ms, launches, CUDA launches and syncs (n/a off CUDA), fallbacks per update
    assert float(row[1]) > 0 and int(row[4]) > 0 and row[5:] == ["n/a", "n/a", "0"]
    assert asked and set(asked) == {"triton"}  # every attention call asked for the kernels


def test_kernel_specialisations_names_the_variants_triton_compiles():
    """scripts/diagnostics/kernel_specialisations.py: a variant is (block, n % 16 == 0, n == 1, windowed), the block
    the row length's next power of two within [16, MAX_TILE / KP] (64 at k = 5, 32 at k = 20 where KP = 32)."""
    diag = script_module("diagnostics/kernel_specialisations.py")
    assert diag.specialisation(40, 5) == (64, False, False, False)
    assert diag.specialisation(48, 5) == (64, True, False, False)
    assert diag.specialisation(20, 5) == (32, False, False, False)
    assert diag.specialisation(9, 5) == (16, False, False, False)
    assert diag.specialisation(1, 5) == (16, False, True, False)
    assert diag.specialisation(5000, 5) == (64, False, False, True)
    assert diag.specialisation(100, 20) == (32, False, False, False)
    per_update = [({(64, False, False, False)}, [40, 41]), ({(64, False, False, False)}, [41]),
                  ({(32, True, False, False), (64, False, False, False)}, [32, 40])]
    table = diag.variants_table(per_update, warmup=1)
    assert "| 2 | yes | 2 | 32-40 | 2 | (32, True, False, False) |" in table and "| 1 | yes | 1 | 41-41 | 1 |  |" in table
    assert table.endswith("2 variants in all; updates timed after 1 untimed that first need one: 2")


def test_kernel_specialisations_records_every_solve_of_each_update_and_restores_the_search():
    diag = script_module("diagnostics/kernel_specialisations.py")
    from fairseq_softtopk.modules import beam_selection

    solve = beam_selection.sorted_soft_topk
    opts = diag.bench_train.build_parser().parse_args(["--arch", "softtopk_lstm_tiny", "--max-tokens", "200",
                                                       "--beam", "3", "--threads", "1", "--updates", "1",
                                                       "--warmup", "1"])
    with tempfile.TemporaryDirectory() as tmp:
        opts.data = diag.binarize_generated_corpus(Path(tmp), splits=diag.bench_train.TOY_SPLITS,
                                                   joined_dictionary=True)
        per_update = diag.record_variants(opts, "beam_soft")
    assert beam_selection.sorted_soft_topk is solve
    assert len(per_update) == 2 and all(lengths for _, lengths in per_update)  # a solve per decoding step
    for variants, lengths in per_update:
        assert variants == {diag.specialisation(n, 3) for n in lengths}


def test_main_loop_takes_the_longest_backward_branch_and_drops_predicates_and_modifiers():
    instructions = script_module("bench/kernel_instructions.py")
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   FFMA R2, R3, R4, R5 ;",
        "        /*0020*/               @P0 MUFU.EX2 R6, R2 ;",
        "        /*0030*/              @!P1 LDG.E R7, [R8.64] ;",
        "        /*0040*/              @!P2 BRA 0x10 ;",           # the loop: 0x10 to 0x40, 4 instructions
        "        /*0050*/                   FADD R2, R2, R2 ;",
        "        /*0060*/                   BRA 0x50 ;",             # a shorter one (2)
        "        /*0070*/                   BRA 0x90 ;",             # forward: no loop
        "        /*0080*/                   EXIT ;"])
    assert instructions.main_loop(sass) == ["FFMA", "MUFU", "LDG", "BRA"]
    assert instructions.main_loop("        /*0000*/                   EXIT ;") == []


def test_kernel_instructions_counts_fewer_instructions_an_entry_with_the_anchors_unrolled(tmp_path, capsys):
    """The split kernels' passes at the beam search's k = 5, compiled for sm_90: each pass with the anchors unrolled
    issues fewer warp instructions an entry than the (BLOCK, KP) tiles, and none spills."""
    pytest.importorskip("triton")
    instructions = script_module("bench/kernel_instructions.py")
    if not instructions._tool("cuobjdump").is_file():
        pytest.skip("triton bundles no cuobjdump here")
    out = tmp_path / "table.md"
    assert instructions.main(["--k", "5", "--dtype", "fp32", "--out", str(out)]) == 0
    assert capsys.readouterr().out == out.read_text()
    assert "`python scripts/bench/kernel_instructions.py --k 5 --dtype fp32 --out " in out.read_text().splitlines()[0]
    lines = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| forward")
             or line.startswith("| backward")]
    rows = [dict(zip(["pass", "k", "dtype", "path", "BLOCK", "warps", "regs", "spill", "loop", "per_warp", "per_entry"],
                     (c.strip() for c in cells))) | {"ratio": cells[-1].strip()} for cells in lines]
    assert [(r["pass"], r["path"]) for r in rows] == [
        (label, path) for label, _ in instructions.PASSES for path in ("unrolled", "tiles KP 16")]
    for unrolled, tiles in zip(rows[::2], rows[1::2]):
        assert unrolled["spill"] == tiles["spill"] == "0"
        assert (unrolled["BLOCK"], unrolled["warps"], unrolled["per_warp"]) == ("128", "4", "32")
        assert float(tiles["per_entry"]) > 2 * float(unrolled["per_entry"])
        assert float(tiles["ratio"]) == pytest.approx(float(tiles["per_entry"]) / float(unrolled["per_entry"]),
                                                      rel=0.02)
        assert int(unrolled["loop"]) / 32 == pytest.approx(float(unrolled["per_entry"]), abs=0.01)
