"""scripts/bench/gpu_check.py (make gpu-check): its CPU dry run, as CI runs it, so that the GPU command cannot rot."""

import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from conftest import script_module

gpu_check = script_module("bench/gpu_check.py")


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_one_report(tmp_path, repo_root):
    report = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "scripts/bench/gpu_check.py", "--dry-run", "--out", str(report)],
                          cwd=repo_root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = report.read_text()
    for key in ("device", "torch", "CUDA (torch build)", "fairseq", "commit"):
        assert re.search(rf"^\| {re.escape(key)} \| .+ \|$", text, re.M), key
    assert f"| torch | {torch.__version__} |" in text
    names = ("cuda_tests", "kernel_tests", "bench_ops", "bench_ops_beam_shape", "bench_ops_window",
             "bench_ops_window_row", "bench_ops_sparse", "bench_train", "bench_attention")
    steps = dict(re.findall(rf"^\| ({'|'.join(names)}) \| (\S+) \|", text, re.M))
    assert steps == {name: "ok" for name in names}
    tests = re.search(r"^\| cuda_tests \| ok \| \d+ \| (\d+) passed", text, re.M)
    assert tests and int(tests.group(1)) >= 50 and "failed" not in text.split("## cuda_tests")[0]
    # the benchmarks' tables, the launch and sync counts included
    assert "| sorted n=3e+03 k=5 eps=0.03 linear batch=8 | ours_fixed |" in text
    assert "| beam_soft_fixed |" in text and "launches/step" in text and "syncs/step" in text
    assert "| sorted n=2e+03 k=5 eps=0.1 linear batch=1 | sparse |" in text
    # the static window beside the dense operator: its width and overflowing rows in the note, the log-probability
    # rows covered, the standard normal ones flagged
    for case, note in [("n=3e+03 k=5 eps=0.03 linear batch=8 logprobs", "W=64 of 3000; .*; overflow 0 of 8 rows"),
                       ("n=3e+03 k=5 eps=0.1 linear batch=8", "W=512 of 3000; .*; OVERFLOW 8 of 8 rows"),
                       ("n=5e+03 k=5 eps=0.1 linear batch=1 logprobs", "W=512 of 5000; .*; overflow 0 of 1 rows")]:
        assert re.search(rf"^\| sorted {re.escape(case)} \| ours_window \| [0-9.]+ \|.*{note}", text, re.M), case
        assert f"| sorted {case} | ours |" in text and f"| sorted {case} | topk |" in text
    for case, method in [("sorted n=3e+03 k=5 eps=0.03 linear batch=8", "ours_triton"),
                         ("sorted n=3e+03 k=5 eps=0.03 linear batch=8 logprobs", "ours_window_triton"),
                         ("sorted n=5e+03 k=5 eps=0.03 linear batch=1 logprobs", "ours_window_triton"),
                         ("sorted n=2e+03 k=5 eps=0.1 linear batch=1", "sparse_triton")]:
        assert f"| {case} | {method} | skipped: CUDA only" in text or re.search(
            rf"^\| {re.escape(case)} \| {method} \|.*skipped: CUDA only", text, re.M), method
    assert "| beam_soft:triton | skipped: CUDA only" in text and "| sparse_topk:triton | skipped: CUDA only" in text
    for step in names:
        log = (tmp_path / f"report.{step}.log").read_text()
        assert log and str(repo_root) not in log and sys.executable not in log  # no paths of this machine
        assert not re.search(re.escape(tempfile.gettempdir()) + r"/tmp\w+", log)
    assert str(repo_root) not in text and sys.executable not in text


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_training_benchmarks_measure_the_kernel_rows(dry_run):
    """On the GPU bench_train and bench_attention time the Triton kernels (--triton) beside the torch path; the
    dry run lists the same rows (skipped on the CPU). Each command's arguments parse as the script's own."""
    steps = {name: command for name, command, _ in gpu_check.plan(dry_run)}
    device = "cpu" if dry_run else "cuda"
    for name in ("bench_train", "bench_attention"):
        command = steps[name]
        assert command[1] == f"scripts/bench/{name}.py" and "--triton" in command
        assert command[command.index("--device") + 1] == device
    assert list(steps)[-2:] == ["bench_train", "bench_attention"]
    opts = script_module("bench/bench_train.py").build_parser().parse_args(steps["bench_train"][2:])
    assert opts.triton and {"beam_soft", "beam_soft_fixed"} <= set(opts.configs.split(","))
    attention = steps["bench_attention"]
    assert {"soft_topk", "sparse_topk"} <= set(attention[attention.index("--normalizers") + 1].split(","))


def test_the_window_steps_time_the_beam_shape_and_one_long_row_on_both_paths():
    """On the GPU the static window is timed beside the dense operator and torch.topk, torch path and kernels, at the
    beam search's shape (64 x 38,840, k = 5, epsilon 0.03 and 0.1) and on one row of 100,000, on log-probability
    rows and standard normal ones; the dry run runs the same methods, small. The arguments parse as bench_ops'."""
    bench_ops = script_module("bench/bench_ops.py")
    for dry_run in (False, True):
        steps = {name: command for name, command, _ in gpu_check.plan(dry_run)}
        names = list(steps)
        assert names.index("bench_ops_beam_shape") + 1 == names.index("bench_ops_window")
        assert names.index("bench_ops_window") + 1 == names.index("bench_ops_window_row")
        for name, shape in (("bench_ops_window", ([38840], 64) if not dry_run else ([3000], 8)),
                            ("bench_ops_window_row", ([100000], 1) if not dry_run else ([5000], 1))):
            assert steps[name][1] == "scripts/bench/bench_ops.py"
            opts = bench_ops.build_parser().parse_args(steps[name][2:])
            assert (opts.n, opts.batch) == shape and opts.device == ("cpu" if dry_run else "cuda")
            assert opts.ops == ["sorted_soft_topk"] and opts.k == [5] and opts.eps == [0.03, 0.1]
            assert opts.cost == "linear" and opts.window and opts.triton and opts.window_width is None
            assert opts.scores == ["logprobs", "normal"]
            assert opts.fixed_iterations is None and opts.compile is None  # bench_ops_beam_shape times those


def test_without_a_gpu_it_asks_for_the_dry_run(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        gpu_check.main([])
    err = capsys.readouterr().err
    assert "no GPU" in err and "--dry-run" in err


def test_tables_of_keeps_the_tables_and_their_introductions():
    output = "noise\n# intro line\n| a | b |\n|---|---|\n| 1 | 2 |\nmore noise\nsecond table:\n| c |\n|---|\n"
    assert gpu_check.tables_of(output) == "# intro line\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nsecond table:\n\n| c |\n|---|"


def test_a_step_past_its_time_limit_is_stopped_with_its_children(tmp_path):
    """A hung step (a deadlocked test, say) must not take the GPU lease with it: it is killed, its
    children too, its output so far is kept, and its row says TIMED OUT."""
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print('started', flush=True)\n"
              "time.sleep(60)\n")
    start = time.perf_counter()
    result = gpu_check.run_step("hung", [sys.executable, "-c", script], {}, tmp_path / "hung.log", timeout=3)
    assert time.perf_counter() - start < 30
    assert result.returncode == gpu_check.TIMED_OUT
    log = (tmp_path / "hung.log").read_text()
    assert log.startswith("started") and "time limit of 3 s" in log
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is asynchronous: give the child a moment to go
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {child} outlived the step")
    report = tmp_path / "report.md"
    gpu_check.write_report(report, {"device": "test"}, [result], True, [])
    assert "| hung | TIMED OUT (" in report.read_text()


def test_steps_run_in_the_order_given_and_the_budget_skips_the_rest(tmp_path, monkeypatch):
    ran = []

    def fake_run_step(name, command, env, log, timeout=None):
        ran.append((name, timeout))
        return gpu_check.StepResult(name, command, 0, 0.0, "", log)

    monkeypatch.setattr(gpu_check, "run_step", fake_run_step)
    monkeypatch.setattr(gpu_check, "environment", lambda: {"device": "test"})
    report = tmp_path / "report.md"
    code = gpu_check.main(["--dry-run", "--out", str(report), "--steps", "bench_train,cuda_tests",
                           "--test-workers", "2", "--step-timeout", "100"])
    assert code == 0 and [name for name, _ in ran] == ["bench_train", "cuda_tests"]
    assert all(timeout == 100 for _, timeout in ran)
    assert gpu_check.plan(True, 2)[0][1][-3:] == ["-n", "2", "tests"] and "-n" not in gpu_check.plan(True)[0][1]
    ran.clear()
    code = gpu_check.main(["--dry-run", "--out", str(report), "--steps", "bench_ops", "--budget", "30"])
    assert code == 1 and ran == [] and "Not run (the --budget of 30 s was spent): bench_ops" in report.read_text()


def test_the_kernel_tests_step_runs_every_kernel_test_file(repo_root):
    assert gpu_check.KERNEL_TEST_FILES == sorted(str(p.relative_to(repo_root))
                                                 for p in (repo_root / "tests").glob("test_triton_*.py"))


def test_the_test_steps_report_pytests_summary():
    def summary(name, output):
        return gpu_check.summary_of(gpu_check.StepResult(name, [], 0, 1.0, output, None))

    assert summary("kernel_tests", "....\n106 passed, 3 skipped in 20.1s\n") == "106 passed, 3 skipped"
    assert summary("kernel_tests", "sss\n21 skipped, 5 deselected in 1.2s\n") == "21 skipped, 5 deselected"
    assert summary("cuda_tests", "==== 2 failed, 130 passed in 99.0s ====\n") == "2 failed, 130 passed"
    assert summary("bench_ops", "| case | method |\n| a | ours |\n") == "1 table rows"



def test_the_callers_commit_comes_before_the_checkouts(monkeypatch):
    """A checkout copied to a GPU machine can carry a stale .git (an H200 check reported a commit two behind):
    GPU_CHECK_COMMIT, where given, is the report's commit; without it, git's HEAD."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=gpu_check.REPO, capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.setenv("GPU_CHECK_COMMIT", "abc1234")
    assert gpu_check.environment()["commit"] == "abc1234"
    # the benchmarks gpu_check runs inherit it: their header names it too (an H100 check's bench_train said
    # "ba12a94-dirty", the copied .git's, for a tree at 5578db5)
    from fairseq_softtopk.experiments.bench_harness import header

    assert "\ncommit: abc1234 (given by GPU_CHECK_COMMIT)\n" in header([], 1, "cpu")
    monkeypatch.delenv("GPU_CHECK_COMMIT")
    assert gpu_check.environment()["commit"].split(" ")[0] == (head or "unknown")
    assert "(given by GPU_CHECK_COMMIT)" not in header([], 1, "cpu")
