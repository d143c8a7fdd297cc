#!/usr/bin/env python
"""Does it work on this GPU, and how fast: the cuda tests and both benchmarks, in one report.

``make gpu-check`` (after README's setup on a GPU machine; meant to take under 10 minutes on one GPU) runs, each as
its own process with its output kept:

1. ``pytest -m cuda tests``: the operators and the criterion on CUDA against the CPU, the sync-free
   search under CUDA's sync debug mode, and fairseq-train / fairseq-generate with --fp16 and --amp (not
   --bf16: fairseq 0.12 trains in bfloat16 on TPUs only);
2. ``pytest tests/test_triton_*.py``: the Triton kernels on CUDA tensors against the torch path
   (without a GPU they run under Triton's interpreter in the suite);
3. ``scripts/bench/bench_ops.py``: the operators' forward + backward against ``torch.topk`` (the target case and
   the beam-search shape; plain, sync-free, in CUDA graphs and on the Triton kernels; the static window
   (``--window``, the soft beam search's selection) beside the dense operator, each on both paths, at the
   beam-search shape (64 x 38,840, k = 5, epsilon 0.03 and 0.1) and on one row of 100,000, on log-probability
   rows and on standard normal ones (which overflow the window: the rows say how many); and the sparse
   operators beside the entropic ones, on both paths);
4. ``scripts/bench/bench_train.py``: updates per second of teacher forcing, hard and soft beam search (adaptive
   and fixed iterations), each soft search also with ``--topk-backend triton`` (the Triton kernels, ``--triton``),
   with the launch and sync counts per decoding step (the candidate pool and the compiled solve, timed on the
   first two GPUs, are left out to keep the check inside one lease: ``bench_train.py --configs`` runs them);
5. ``scripts/bench/bench_attention.py``: training speed of the Transformer with each attention normaliser, the
   top-k ones also with ``--attention-topk-backend triton``, with the launches and syncs per update,

and writes one markdown report (``--out``, default ``results/gpu_check/<device>.md``): the device, torch,
CUDA and fairseq versions, the commit, each command with its status and time, and the tables the
benchmarks printed; each step's whole output goes next to it (``<report>.<step>.log``). The exit status
is non-zero when a step failed (the report still lists every step).

``--dry-run`` runs the same steps on the CPU with small sizes (``make gpu-check-dry-run``; the suite runs
it, so that this command cannot rot where no GPU is): the cuda tests with the CPU in the GPU's place
(tests/test_cuda.py), tiny benchmarks, the compiled config left out (inductor's C++ build takes minutes).
"""

import argparse
import datetime
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Sequence

REPO = Path(__file__).resolve().parents[2]  # the checkout (scripts/bench/ is two levels down)

#: the benchmarks' arguments on a GPU: the Multi30k-sized model on the toy corpus, the beam-search shape
GPU_STEPS = {
    "bench_ops": ["--device", "cuda", "--n", "100000", "1000000", "--k", "5", "--eps", "0.01", "--fixed-iterations",
                  "15", "--compile", "reduce-overhead", "--triton"],
    "bench_ops_beam_shape": ["--device", "cuda", "--ops", "sorted_soft_topk", "--n", "38840", "--k", "5", "--eps",
                             "0.03", "--cost", "linear", "--batch", "64", "--fixed-iterations", "15", "--compile",
                             "reduce-overhead", "--triton"],
    # the static window beside the dense operator, torch path and kernels (no fixed or compiled solve: the step
    # above times those): four cases (two epsilons, two score distributions) at the beam shape, four on one row,
    # five methods timed in each
    "bench_ops_window": ["--device", "cuda", "--ops", "sorted_soft_topk", "--n", "38840", "--k", "5", "--eps", "0.03",
                         "0.1", "--cost", "linear", "--batch", "64", "--scores", "logprobs", "normal", "--window",
                         "--triton"],
    "bench_ops_window_row": ["--device", "cuda", "--ops", "sorted_soft_topk", "--n", "100000", "--k", "5", "--eps",
                             "0.03", "0.1", "--cost", "linear", "--scores", "logprobs", "normal", "--window",
                             "--triton"],
    "bench_ops_sparse": ["--device", "cuda", "--cost", "linear", "--sparse", "--n", "1000", "10000", "100000",
                         "1000000", "--k", "5", "50", "--eps", "0.1", "--triton"],
    # 20 untimed updates and 30 timed: on an H200, 10 updates after 2 held the kernels' compiles for the adaptive
    # window's new widths (2.4x slower than the torch path; 15% faster on an H100 after 20); the profiled and
    # counted passes shortened to fit a lease (five rows: about 5 minutes on an H100)
    "bench_train": ["--device", "cuda", "--arch", "softtopk_lstm_multi30k", "--updates", "30", "--warmup", "20",
                    "--profile-updates", "1", "--count-updates", "1", "--configs", "beam_hard,beam_soft,beam_soft_fixed",
                    "--triton"],
    "bench_attention": ["--device", "cuda", "--arch", "softtopk_transformer_multi30k", "--updates", "10", "--warmup",
                        "2", "--repeats", "1", "--normalizers", "fairseq,softmax,soft_topk,sparse_topk", "--triton"],
}
#: the same steps on the CPU, small enough for the test suite
DRY_RUN_STEPS = {
    "bench_ops": ["--device", "cpu", "--n", "2000", "--k", "5", "--eps", "0.1", "--repeats", "1", "--threads", "1",
                  "--fixed-iterations", "15", "--triton"],
    "bench_ops_beam_shape": ["--device", "cpu", "--ops", "sorted_soft_topk", "--n", "3000", "--k", "5", "--eps", "0.03",
                             "--cost", "linear", "--batch", "8", "--repeats", "1", "--threads", "1",
                             "--fixed-iterations", "15", "--triton"],
    "bench_ops_window": ["--device", "cpu", "--ops", "sorted_soft_topk", "--n", "3000", "--k", "5", "--eps", "0.03",
                         "0.1", "--cost", "linear", "--batch", "8", "--scores", "logprobs", "normal", "--repeats", "1",
                         "--threads", "1", "--window", "--triton"],
    "bench_ops_window_row": ["--device", "cpu", "--ops", "sorted_soft_topk", "--n", "5000", "--k", "5", "--eps",
                             "0.03", "0.1", "--cost", "linear", "--scores", "logprobs", "normal", "--repeats", "1",
                             "--threads", "1", "--window", "--triton"],
    "bench_ops_sparse": ["--device", "cpu", "--cost", "linear", "--sparse", "--n", "2000", "--k", "5", "--eps", "0.1",
                         "--repeats", "1", "--threads", "1", "--triton"],
    "bench_train": ["--device", "cpu", "--arch", "softtopk_lstm_tiny", "--updates", "2", "--warmup", "1",
                    "--max-tokens", "200", "--beam", "3", "--candidate-pool", "10", "--threads", "1", "--in-process",
                    "--configs", "beam_hard,beam_soft,beam_soft_fixed", "--triton"],
    "bench_attention": ["--device", "cpu", "--updates", "1", "--warmup", "0", "--repeats", "1", "--max-tokens", "200",
                        "--normalizers", "softmax,soft_topk,sparse_topk", "--triton"],
}


#: the Triton kernels' tests (on a GPU on CUDA tensors; in the suite under the interpreter)
KERNEL_TEST_FILES = ["tests/test_triton_soft_topk.py", "tests/test_triton_sorted_soft_topk.py",
                     "tests/test_triton_sorted_soft_topk_split.py", "tests/test_triton_sorted_soft_topk_window.py",
                     "tests/test_triton_sorted_sparse_soft_topk.py", "tests/test_triton_sparse_soft_topk.py"]


class StepResult(NamedTuple):
    name: str
    command: List[str]
    returncode: int
    seconds: float
    output: str
    log: Path


def environment() -> Dict[str, str]:
    """Device, versions and commit, for the report's header."""
    import torch

    info = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
            "torch": torch.__version__, "CUDA (torch build)": str(torch.version.cuda),
            "cuDNN": str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible)"
        info["NVIDIA driver"] = _nvidia_smi_field("driver_version") or "n/a"
    else:
        info["device"] = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (no GPU)"
    try:
        import fairseq

        info["fairseq"] = fairseq.__version__
    except ImportError:
        info["fairseq"] = "not installed"
    if os.environ.get("GPU_CHECK_COMMIT"):  # the caller's word first: a copied checkout's .git can be stale
        info["commit"] = os.environ["GPU_CHECK_COMMIT"]
        return info
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True)
    except OSError:  # no git on the GPU machine: the commit can still be given by the caller
        info["commit"] = "unknown (no git)"
        return info
    info["commit"] = ((commit.stdout.strip() or "unknown")
                      + (" (with uncommitted changes)" if dirty.stdout.strip() else ""))
    return info


def _nvidia_smi_field(field: str) -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def plan(dry_run: bool, test_workers: int = 1) -> List[tuple]:
    """``(name, command, extra environment)`` of each step; ``test_workers`` > 1 runs the tests in that many
    processes (pytest-xdist)."""
    python = sys.executable
    steps = DRY_RUN_STEPS if dry_run else GPU_STEPS
    test_env = {"SOFTTOPK_CUDA_TESTS_DEVICE": "cpu"} if dry_run else {}
    workers = ["-n", str(test_workers)] if test_workers > 1 else []
    if test_workers > 1:  # each worker on its own share of the cores (at 12 workers x 16 threads, tests timed out)
        test_env = dict(test_env, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // test_workers)))
    return [
        ("cuda_tests", [python, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *workers, "tests"],
         test_env),
        # on a GPU every kernel test runs on CUDA tensors; the dry run leaves out the interpreter and the
        # ahead-of-time compiles (the suite runs them: about 20 s)
        ("kernel_tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TEST_FILES,
                          *(["-k", "not interpreter and not compiles"] if dry_run else [])], {}),
        ("bench_ops", [python, "scripts/bench/bench_ops.py", *steps["bench_ops"]], {}),
        ("bench_ops_beam_shape", [python, "scripts/bench/bench_ops.py", *steps["bench_ops_beam_shape"]], {}),
        ("bench_ops_window", [python, "scripts/bench/bench_ops.py", *steps["bench_ops_window"]], {}),
        ("bench_ops_window_row", [python, "scripts/bench/bench_ops.py", *steps["bench_ops_window_row"]], {}),
        ("bench_ops_sparse", [python, "scripts/bench/bench_ops.py", *steps["bench_ops_sparse"]], {}),
        ("bench_train", [python, "scripts/bench/bench_train.py", *steps["bench_train"]], {}),
        ("bench_attention", [python, "scripts/bench/bench_attention.py", *steps["bench_attention"]], {}),
    ]


def portable(text: str) -> str:
    """``text`` without this machine's paths: the interpreter as ``python``, the repository as ``.``."""
    text = text.replace(sys.executable, "python").replace(str(REPO) + "/", "").replace(str(REPO), ".")
    # the toy corpus's directory, as a variable (a path after "<temp dir>" would read as an absolute one)
    return re.sub(re.escape(tempfile.gettempdir()) + r"/tmp\w+", "$TMPDIR", text)


#: the exit status recorded for a step stopped at its time limit (as coreutils' timeout reports it)
TIMED_OUT = 124


def run_step(name: str, command: List[str], extra_env: Dict[str, str], log: Path,
             timeout: Optional[float] = None) -> StepResult:
    """Runs one step from the repository root, printing its output as it comes and keeping it in ``log``
    (line by line, so that a machine taken away mid-step still leaves it). A step still running after
    ``timeout`` seconds is killed with its process group and gets the status :data:`TIMED_OUT`."""
    print(f"\n== {name}: {shlex.join(command)}", flush=True)
    env = dict(os.environ, **extra_env)
    start = time.perf_counter()
    lines = []
    timed_out = threading.Event()
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1, start_new_session=True) as proc, open(log, "w", buffering=1) as sink:
        def stop():
            timed_out.set()
            os.killpg(proc.pid, signal.SIGKILL)  # the step's own children too (fairseq-train, test workers)

        timer = threading.Timer(timeout, stop) if timeout else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                lines.append(portable(line))
                sink.write(lines[-1])
                sys.stdout.write(line)
            proc.wait()
        finally:
            if timer:
                timer.cancel()
        if timed_out.is_set():
            lines.append(f"[gpu_check: stopped after its time limit of {timeout:.0f} s]\n")
            sink.write(lines[-1])
    seconds = time.perf_counter() - start
    returncode = TIMED_OUT if timed_out.is_set() else proc.returncode
    print(f"== {name}: exit {returncode} after {seconds:.0f} s", flush=True)
    return StepResult(name, command, returncode, seconds, "".join(lines), log)


def summary_of(result: StepResult) -> str:
    """One line on the outcome: the tests' summary, or the benchmark's verdict line."""
    if result.name in ("cuda_tests", "kernel_tests"):
        found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped).*?)(?: in [0-9.]+s.*)?=*$", result.output, re.M)
        return found[-1].strip() if found else "no test summary"
    if result.name == "bench_train":
        verdict = [line for line in result.output.splitlines() if "target <=" in line]
        return verdict[-1] if verdict else "no verdict line"
    rows = [line for line in result.output.splitlines() if line.startswith("| ") and "method" not in line]
    return f"{len(rows)} table rows"


def tables_of(output: str) -> str:
    """The markdown tables (and the lines that introduce them) of a benchmark's output."""
    keep, previous = [], ""
    for line in output.splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):  # a new table, introduced by the line before it
                keep += ["", previous, ""] if previous.strip() else [""]
            keep.append(line)
        previous = line
    return "\n".join(keep).strip()


def write_report(path: Path, info: Dict[str, str], results: Sequence[StepResult], dry_run: bool,
                 argv: Sequence[str]) -> None:
    mode = "CPU dry run (the GPU's steps on the CPU, small sizes)" if dry_run else "GPU"
    lines = [f"# gpu-check: {info['device']}", "",
             f"Written by `python scripts/bench/gpu_check.py {portable(shlex.join(argv))}` ({mode}).", "",
             "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in info.items()]
    lines += ["", "| step | status | seconds | result | command |", "|---|---|---:|---|---|"]
    for r in results:
        status = ("ok" if r.returncode == 0 else f"TIMED OUT ({r.seconds:.0f} s)" if r.returncode == TIMED_OUT
                  else f"FAILED (exit {r.returncode})")
        command = portable(shlex.join(r.command))
        lines.append(f"| {r.name} | {status} | {r.seconds:.0f} | {summary_of(r)} | `{command}` |")
    for r in results:
        lines += ["", f"## {r.name}", "", f"`{r.log.name}` holds the whole output."]
        if r.name != "cuda_tests" and r.returncode == 0:
            lines += ["", tables_of(r.output)]
        elif r.returncode != 0:
            lines += ["", "```", *r.output.splitlines()[-40:], "```"]
    path.write_text("\n".join(lines) + "\n")


def default_report_path(info: Dict[str, str], dry_run: bool) -> Path:
    name = "cpu_dry_run" if dry_run else re.sub(r"[^A-Za-z0-9]+", "_", info["device"].split(" (")[0]).strip("_")
    return REPO / "results" / "gpu_check" / f"{name.lower()}.md"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, small sizes (for CI)")
    parser.add_argument("--out", type=Path, help="the report (default: results/gpu_check/<device>.md)")
    parser.add_argument("--steps", default=None,
                        help="comma-separated subset of " + ",".join(name for name, _, _ in plan(True))
                             + ", run in the order given (default: all, in that order)")
    parser.add_argument("--test-workers", type=int, default=1,
                        help="run the cuda tests in this many processes (needs pytest-xdist)")
    parser.add_argument("--step-timeout", type=float, default=None,
                        help="stop a step after this many seconds (its report row says TIMED OUT)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all steps together: a step gets at most what is left, and a step "
                             "that would start with under a minute left is not run (listed in the report)")
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parser.parse_args(argv)
    import torch

    if not opts.dry_run and not torch.cuda.is_available():
        parser.error(f"no GPU: torch {torch.__version__} (CUDA build {torch.version.cuda}) finds none; "
                     "use --dry-run to run the steps on the CPU")
    if opts.test_workers < 1:
        parser.error(f"--test-workers must be at least 1, got {opts.test_workers}")
    steps = plan(opts.dry_run, opts.test_workers)
    names = [name for name, _, _ in steps]
    if opts.steps:
        wanted = opts.steps.split(",")
        unknown = [s for s in wanted if s not in names]
        if unknown:
            parser.error(f"unknown steps {unknown}; choose from {names}")
        by_name = {step[0]: step for step in steps}
        steps = [by_name[name] for name in dict.fromkeys(wanted)]
    info = environment()
    out = opts.out or default_report_path(info, opts.dry_run)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, not_run = [], []
    deadline = time.perf_counter() + opts.budget if opts.budget else None
    for name, command, env in steps:
        timeout = opts.step_timeout
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left < 60:
                not_run.append(name)
                continue
            timeout = min(timeout, left) if timeout else left
        if name == "cuda_tests":  # tests/conftest.py appends each failure there as it happens
            env = dict(env, SOFTTOPK_FAILURE_LOG=str(out.with_name(f"{out.stem}.cuda_failures.log")))
        results.append(run_step(name, command, env, out.with_name(f"{out.stem}.{name}.log"), timeout))
        write_report(out, info, results, opts.dry_run, argv)  # after every step: a partial report survives
    if not_run:
        with open(out, "a") as report:
            report.write(f"\nNot run (the --budget of {opts.budget:.0f} s was spent): {', '.join(not_run)}\n")
    failed = [r.name for r in results if r.returncode != 0]
    print(f"\nreport: {out}" + (f"; FAILED: {', '.join(failed)}" if failed else "; every step passed")
          + (f"; not run: {', '.join(not_run)}" if not_run else ""))
    return 1 if failed or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
