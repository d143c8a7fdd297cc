"""What the training benchmarks (``scripts/bench/bench_train.py``, ``scripts/bench/bench_attention.py``) share.

Building a fairseq task, model and criterion from command-line flags, drawing the same
training batches for every configuration, timing updates, reading the package's named
``torch.profiler`` ranges (``softtopk::...``, placed once in the code) from a profile, and on CUDA
counting kernel launches and host synchronisations; the rows of the Triton kernels are timed on CUDA only.
Also: a process's memory (peak RSS), self CPU time by region of a profile, and the header of a benchmark's
output (command, commit, torch, threads, machine).
"""

import itertools
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch

import fairseq_softtopk

from .fairseq_commands import PACKAGE_DIR

#: The named ranges of the package (``torch.profiler.record_function``) and where they are.
RANGES = {
    "softtopk::select_beams": "the beam search's candidate selection (window or pool, operator forward)",
    "softtopk::mix_beams": "the beam search's mixing of embeddings and states",
    "softtopk::sorted_soft_topk": "sorted_soft_topk forward (preparation and Newton solve)",
    "softtopk::sorted_soft_topk_backward": "sorted_soft_topk backward (implicit differentiation)",
    "softtopk::soft_topk": "soft_topk forward",
    "softtopk::soft_topk_backward": "soft_topk backward",
}


def build_training_parts(data_bin, flags: Sequence[str], seed: int, device: str = "cpu",
                         build_model: Optional[Callable] = None):
    """``(task, model, criterion)`` of ``fairseq-train DATA_BIN FLAGS``, parameters initialised from ``seed``.

    ``build_model(cfg.model, task)`` replaces the task's model builder (e.g. fairseq's own
    Transformer as a reference); the model is moved to ``device``.
    """
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    fairseq_softtopk.register()  # before the parser lists the architectures
    argv = [str(data_bin), "--user-dir", str(PACKAGE_DIR), "--seed", str(seed), *map(str, flags)]
    if device == "cpu":
        argv.append("--cpu")
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    utils.set_torch_seed(seed)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    model = build_model(cfg.model, task) if build_model else task.build_model(cfg.model)
    return task, model.to(device), task.build_criterion(cfg.criterion)


def training_batches(task, max_tokens: int, seed: int, device: str = "cpu") -> Iterator[dict]:
    """Training batches of a seeded shuffle, epoch after epoch (the same sequence for every configuration).

    Raises:
        ValueError: if no training batch fits ``max_tokens``.
    """
    from fairseq import utils

    epochs = task.get_batch_iterator(dataset=task.dataset("train"), max_tokens=max_tokens, seed=seed,
                                     ignore_invalid_inputs=True)
    while True:
        empty = True
        for sample in epochs.next_epoch_itr(shuffle=True):
            empty = False
            yield utils.move_to_cuda(sample) if device.startswith("cuda") else sample
        if empty:
            raise ValueError(f"no training batch fits --max-tokens {max_tokens}")


def synchronize(device: str) -> None:
    """Waits for queued CUDA work (no-op on CPU), so that wall times cover it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_updates(model, criterion, batches: Iterable[dict], warmup: int, device: str = "cpu",
                  clock: Callable[[], float] = time.perf_counter,
                  optimizer: Optional[torch.optim.Optimizer] = None) -> List[dict]:
    """Trains on ``batches`` (Adam, lr 1e-3, unless given ``optimizer``).

    Returns, per update after the first ``warmup``: ``seconds`` (of ``clock``, the update from
    zero_grad to the optimizer step), ``tokens`` (target tokens) and ``logging`` (the
    criterion's logging output, tensors as numbers).
    """
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    records = []
    for step, sample in enumerate(batches):
        synchronize(device)
        start = clock()
        optimizer.zero_grad()
        loss, _, logging_output = criterion(model, sample)
        loss.backward()
        optimizer.step()
        synchronize(device)
        seconds = clock() - start
        if step >= warmup:
            logging = {key: float(value) for key, value in logging_output.items()}
            records.append({"seconds": seconds, "tokens": int(sample["ntokens"]), "logging": logging})
    return records


def range_seconds(events, names: Iterable[str] = RANGES) -> Dict[str, float]:
    """Total wall seconds inside each named range of a ``torch.profiler`` profile's ``events()``.

    A range's time is measured on the host thread that entered it (forward ranges on the
    training thread, backward ranges on autograd's): on CUDA it includes waiting for the GPU
    only where the code synchronises inside the range.
    """
    from torch.autograd import DeviceType

    totals = dict.fromkeys(names, 0.0)
    for event in events:
        if event.name in totals and event.device_type == DeviceType.CPU:  # not the GPU's copy of a range
            totals[event.name] += event.cpu_time_total / 1e6  # us -> s
    return totals


#: kernel launches as the CUDA runtime records them in a ``torch.profiler`` trace
CUDA_LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def kernel_skip_reason(device: str) -> str:
    """Why a row of the Triton kernels (an operator's ``backend="triton"``) is not timed on ``device`` (``""``:
    it is): on the CPU the kernels run under Triton's interpreter, which is no speed to report."""
    from fairseq_softtopk.ops.kernels import triton_available

    if not device.startswith("cuda"):
        return "skipped: CUDA only (on the CPU the kernels run under Triton's interpreter)"
    if not triton_available():
        return "skipped: triton is not installed"
    return ""


def cuda_launches(events) -> int:
    """The kernel launches in a ``torch.profiler`` profile's ``events()`` (:data:`CUDA_LAUNCH_EVENTS`)."""
    return sum(event.name in CUDA_LAUNCH_EVENTS for event in events)


def count_cuda_syncs(run: Callable[[], None]) -> int:
    """Calls ``run()`` under ``torch.cuda.set_sync_debug_mode("warn")`` and returns the host synchronisations
    that CUDA reported (one warning each; the mode is restored after)."""
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()  # the queued work done, outside the count
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def fixed_batches(task, max_tokens: int, count: int, seed: int, device: str) -> List[dict]:
    """The first ``count`` training batches of a seeded shuffle (epoch after epoch), on ``device``."""
    return list(itertools.islice(training_batches(task, max_tokens, seed, device), count))


def rss_mib(field: str) -> Optional[float]:
    """``VmRSS`` / ``VmHWM`` of this process in MiB (Linux), else None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the kernel's peak RSS of this process (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _region(event) -> str:
    """Where a profiled op ran: the innermost ``softtopk::`` range, the optimizer, other backward or forward."""
    backward = False
    while event is not None:
        if event.name.startswith("softtopk::"):
            return event.name[len("softtopk::"):]
        if event.name.startswith("Optimizer."):
            return "optimizer"
        backward = backward or event.name.startswith("autograd::engine::evaluate_function")
        event = event.cpu_parent
    return "other backward" if backward else "other forward"


def region_table(events, rows: int) -> str:
    """Self CPU time per region (see :func:`_region`) and its ``rows`` costliest ops."""
    by_region: Dict[str, Dict[str, float]] = {}
    for event in events:
        ops = by_region.setdefault(_region(event), {})
        ops[event.name] = ops.get(event.name, 0.0) + event.self_cpu_time_total / 1e3  # us -> ms
    total = sum(sum(ops.values()) for ops in by_region.values()) or 1.0
    lines = []
    for region, ops in sorted(by_region.items(), key=lambda item: -sum(item[1].values())):
        spent = sum(ops.values())
        top = sorted(ops.items(), key=lambda item: -item[1])[:rows]
        lines.append(f"{region}: {spent:.0f} ms self CPU ({100 * spent / total:.1f}%); top ops: "
                     + ", ".join(f"{name} {ms:.0f}" for name, ms in top))
    return "\n".join(lines)


def header(argv: Sequence[str], threads: int, device: str) -> str:
    """The exact command line and the torch / thread / machine information."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    gpu = f" gpu={torch.cuda.get_device_name()}" if device.startswith("cuda") else ""
    if os.environ.get("GPU_CHECK_COMMIT"):  # gpu_check's caller's word: a copied checkout's .git can be stale
        commit = f"{os.environ['GPU_CHECK_COMMIT']} (given by GPU_CHECK_COMMIT)"
    else:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                             cwd=PACKAGE_DIR)
        commit = f"{git.stdout.strip() or 'unknown'} (working tree as run)"
    text = (f"command: {shlex.join([sys.executable, sys.argv[0], *argv])}\n"
            f"commit: {commit}\n"
            f"torch={torch.__version__} threads={threads} (interop {torch.get_num_interop_threads()}) "
            f"cpus={os.cpu_count()} device={device}{gpu} python={platform.python_version()} "
            f"load avg={' '.join(f'{x:.2f}' for x in load) if load else 'n/a'}")
    if load and device == "cpu" and load[0] + threads > (os.cpu_count() or 1):
        text += ("\nwarning: other processes use the CPUs: timings are noisy, and OpenMP threads that wait "
                 "for a busy core can slow everything down many times over (try --threads 1 and --repeats 3)")
    return text
