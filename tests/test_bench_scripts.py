"""Smoke tests of the benchmark scripts (tiny problems and models; numbers checked for sense, not speed)."""

import re

import pytest
import torch

import bench_train  # scripts/ is on sys.path (conftest)


def test_criterion_args_per_config():
    assert bench_train.criterion_args("teacher_forcing", 5, 0.1, 50, 0.8)[-2:] == ["--teacher-forcing-ratio", "1.0"]
    assert "hard" in bench_train.criterion_args("beam_hard", 5, 0.1, 50, 0.8)
    pool = bench_train.criterion_args("beam_soft_pool", 5, 0.1, 50, 0.8)
    assert pool[pool.index("--candidate-pool") + 1] == "50"
    with pytest.raises(ValueError, match="beam_medium"):
        bench_train.criterion_args("beam_medium", 5, 0.1, 50, 0.8)


def test_summarize_takes_the_fastest_run_of_each_update():
    def update(seconds, topk):
        return {"seconds": seconds, "tokens": 10, "topk_fwd": topk, "topk_bwd": 0.0, "select": topk,
                "topk_calls": 2.0, "newton_iters": 2.0 * seconds}

    runs = [{"updates": [update(2.0, 1.0), update(1.0, 0.5)], "peak_mib": 100.0, "growth_mib": 10.0},
            {"updates": [update(1.0, 0.25), update(3.0, 3.0)], "peak_mib": 120.0, "growth_mib": 5.0}]
    summary = bench_train.summarize(runs)
    assert summary["ms_per_update"] == pytest.approx(1000.0)  # (1.0 + 1.0) / 2 updates
    assert summary["tokens_per_s"] == pytest.approx(10.0)
    assert summary["topk_fwd_share"] == pytest.approx(0.75 / 2.0)
    assert summary["newton_per_call"] == pytest.approx(1.0)  # (2 + 2) iterations / (2 + 2) calls
    assert summary["peak_mib"] == 120.0 and summary["growth_mib"] == 10.0


def test_timer_restores_the_operator():
    from fairseq_softtopk.modules import soft_beam_search as search
    from fairseq_softtopk.ops.sorted_soft_topk import SortedSoftTopKFunction

    before = (search.sorted_soft_topk, search._select, SortedSoftTopKFunction.__dict__["backward"])
    with bench_train.TopKTimer("cpu"):
        assert search.sorted_soft_topk is not before[0]
    assert (search.sorted_soft_topk, search._select, SortedSoftTopKFunction.__dict__["backward"]) == before


@pytest.mark.slow
def test_bench_train_prints_a_row_per_config(toy_data_bin, capsys):
    _, data_bin = toy_data_bin
    tiny = ["--data", str(data_bin), "--arch", "softtopk_lstm_tiny", "--updates", "2", "--warmup", "1",
            "--max-tokens", "200", "--threads", "1", "--beam", "3", "--candidate-pool", "10"]
    threads = torch.get_num_threads()
    try:
        assert bench_train.main(tiny + ["--in-process", "--pretrain-updates", "2"]) == 0
    finally:
        torch.set_num_threads(threads)  # main sets it for the whole process
    out = capsys.readouterr().out
    assert out.startswith("command: ")
    assert "pretrained 2 teacher-forced updates" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if re.match(r"\| (teacher_forcing|beam_\w+) \|", line)}
    assert set(rows) == set(bench_train.CONFIGS)
    assert rows["beam_hard"][-1].strip() == "1.00x"
    assert rows["teacher_forcing"][3].strip() == "0.0%"  # no top-k without the beam
    assert float(rows["beam_soft"][3].strip().rstrip("%")) > 0.0
    assert float(rows["beam_soft"][4].strip().rstrip("%")) > 0.0  # backward of the operator was timed
    assert rows["beam_hard"][6].strip() == "-" and float(rows["beam_soft"][6]) >= 0  # Newton iterations per call
    assert "target <= 1.25x" in out

    # one configuration in its own process, as the default (isolated) mode runs them
    result = bench_train.run_isolated(bench_train.build_parser().parse_args(tiny), tiny, "beam_soft")
    assert len(result["updates"]) == 2 and result["peak_mib"] > 0
    assert all(r["topk_fwd"] > 0 for r in result["updates"])


def test_bench_ops_prints_every_method_with_our_solver_converged(capsys):
    import bench_ops

    assert bench_ops.main(["--n", "300", "--k", "3", "--eps", "0.1", "--repeats", "2", "--threads", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| topk n=")
            or line.startswith("| sorted n=")]
    assert [r[1].strip() for r in rows] == ["ours", "paper", "unrolled", "topk"] * 2
    for r in rows:
        median, best = float(r[2]), float(r[4])
        assert 0 < best <= median
        if r[1].strip() == "ours":
            assert float(r[7]) <= 1e-4 and "NOT CONVERGED" not in r[8]
        if r[1].strip() == "topk":
            assert float(r[3]) == 1.0 and float(r[5]) == 1.0
