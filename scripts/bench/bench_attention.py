#!/usr/bin/env python
"""Training speed of ``softtopk_transformer`` with each attention normaliser, in one process.

Builds the toy language pair (or uses ``--data``), then for every normaliser trains a fresh
model (same seed, same batches) for ``--updates`` updates with Adam and label-smoothed cross
entropy, timing forward + backward + step, and prints target tokens/s and the time per
target token relative to ``softmax`` (the same unfused attention with a plain softmax). The
``fairseq`` row is fairseq's own ``transformer`` of the same size (fused attention), for
reference. Normalisers run interleaved, ``--repeats`` times, and each update counts with its
fastest run; time is the process's CPU time by default on the CPU (``--clock wall`` for elapsed time;
on CUDA, ``--device cuda``, always elapsed time). Both make the ratios robust to other load on a shared
machine.

With ``--triton``, the normalisers that run a soft top-k operator (``soft_topk``, ``sparse_topk``) get a
row ``NAME:triton`` (``--attention-topk-backend triton``: the fused Triton kernels) beside their own, which
then run ``--attention-topk-backend torch``; the kernel rows are timed on CUDA only (on the CPU the kernels
run under Triton's interpreter: the rows say skipped). Per update, from one more update after the timed ones:
``launches`` (dispatched ATen operations, about one kernel launch each on a GPU), and on CUDA the kernel
launches the CUDA runtime recorded (``torch.profiler``) and the host synchronisations CUDA reported
(``torch.cuda.set_sync_debug_mode("warn")``), ``n/a`` elsewhere; ``fallbacks``: the operator calls of a
kernel row that asked for the kernels and ran on the torch path (an operator without kernels yet).

Example::

    python scripts/bench/bench_attention.py --arch softtopk_transformer_tiny --updates 30 --repeats 3
    python scripts/bench/bench_attention.py --device cuda --arch softtopk_transformer_multi30k --triton
"""

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.dispatch_count import DispatchCounter  # noqa: E402
from fairseq_softtopk.experiments.bench_harness import (build_training_parts, count_cuda_syncs,  # noqa: E402
                                                        cuda_launches, kernel_skip_reason, timed_updates,
                                                        training_batches)
from fairseq_softtopk.experiments.fairseq_commands import binarize_generated_corpus  # noqa: E402
from fairseq_softtopk.ops.kernels import fallback_counts, reset_fallback_counts  # noqa: E402

NORMALIZERS = ("fairseq", "softmax", "soft_topk", "hard_topk", "sparse_topk", "sparsemax", "entmax15")
#: What ``fairseq`` means in the table: fairseq's transformer with its fused attention.
REFERENCE = "fairseq"
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
#: the normalisers that run a soft top-k operator: --triton adds a NAME:triton row for each
KERNEL_NORMALIZERS = ("soft_topk", "sparse_topk")
#: the suffix of a normaliser run with --attention-topk-backend triton (the Triton kernels)
TRITON = ":triton"
#: why a kernel row is not timed on a device ("": it is); a module attribute, so that tests can lift the skip
triton_skip_reason = kernel_skip_reason


def build_trainer_parts(data_bin: Path, arch: str, normalizer: str, k: int, epsilon: float, max_tokens: int,
                        seed: int, device: str = "cpu", backend: Optional[str] = None):
    """``(task, model, criterion)`` for one normaliser (a ``NAME:triton`` row: with ``--attention-topk-backend
    triton``; else ``backend``, None: the model's default), parameters initialised from ``seed``, on ``device``."""
    from fairseq.models.transformer import TransformerModel

    if normalizer.endswith(TRITON):
        normalizer, backend = normalizer[: -len(TRITON)], "triton"
    backend_flags = ["--attention-topk-backend", backend] if backend and normalizer in KERNEL_NORMALIZERS else []
    flags = ["--arch", arch, "--share-all-embeddings", *backend_flags,
             "--attention-normalizer", "softmax" if normalizer == REFERENCE else normalizer,
             "--attention-topk", k, "--attention-topk-epsilon", epsilon,
             "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
             "--max-tokens", max_tokens, "--dropout", "0.1"]
    # the reference: the same sizes with fairseq's own (fused) attention
    build_model = (lambda cfg, task: TransformerModel.build_model(cfg, task)) if normalizer == REFERENCE else None
    return build_training_parts(data_bin, flags, seed, device, build_model=build_model)


def time_training(task, model, criterion, updates: int, max_tokens: int, warmup: int, seed: int,
                  clock=time.process_time, device: str = "cpu") -> Tuple[List[float], List[int], dict]:
    """Trains ``warmup + updates`` updates; seconds and target tokens of each of the last ``updates``, and the
    counts of one more update (:func:`count_update`)."""
    batches = list(itertools.islice(training_batches(task, max_tokens, seed, device), warmup + updates + 1))
    records = timed_updates(model, criterion, batches[:-1], warmup, device, clock=clock)
    return [r["seconds"] for r in records], [r["tokens"] for r in records], count_update(model, criterion,
                                                                                       batches[-1])


def count_update(model, criterion, sample: dict) -> dict:
    """Forward and backward of ``sample``: ``{"launches"}`` (dispatched ATen operations), ``"fallbacks"`` (operator
    calls that asked for the kernels and ran on the torch path), and on CUDA ``"cuda_launches"`` (a profiled run)
    and ``"cuda_syncs"`` (under the sync debug mode; None off CUDA)."""
    def forward_backward():
        model.zero_grad(set_to_none=True)
        criterion(model, sample)[0].backward()

    reset_fallback_counts()
    with DispatchCounter() as counter:
        forward_backward()
    counts = {"launches": counter.total("launches"), "fallbacks": sum(fallback_counts().values()),
              "cuda_launches": None, "cuda_syncs": None}
    if next(model.parameters()).is_cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward_backward()
            torch.cuda.synchronize()
        counts["cuda_launches"] = cuda_launches(prof.events())
        counts["cuda_syncs"] = count_cuda_syncs(forward_backward)
    return counts


def run_benchmark(data_bin: Path, arch: str, normalizers: Sequence[str], updates: int, repeats: int, k: int,
                  epsilon: float, max_tokens: int, warmup: int, seed: int, clock=time.process_time,
                  device: str = "cpu", backend: Optional[str] = None) -> Dict[str, dict]:
    """Target tokens/s per normaliser from the fastest of ``repeats`` interleaved runs of each update, and the
    counts of :func:`count_update` (the first run's); a kernel row not timed on ``device`` is ``{"skipped": why}``.

    Every run of every normaliser sees the same batches in the same order, so the time of
    update ``i`` can be taken as its minimum over the runs, which discards the slowdowns that
    other processes on the machine cause now and then.
    """
    skipped = {name: triton_skip_reason(device) for name in normalizers if name.endswith(TRITON)}
    best: Dict[str, List[float]] = {}
    counts: Dict[str, dict] = {}
    tokens: List[int] = []
    for _ in range(repeats):
        for name in (n for n in normalizers if not skipped.get(n)):
            parts = build_trainer_parts(data_bin, arch, name, k, epsilon, max_tokens, seed, device, backend)
            seconds, tokens, counted = time_training(*parts, updates=updates, max_tokens=max_tokens, warmup=warmup,
                                                     seed=seed, clock=clock, device=device)
            best[name] = [min(a, b) for a, b in zip(best[name], seconds)] if name in best else seconds
            counts.setdefault(name, counted)
    return {name: {"skipped": skipped[name]} if skipped.get(name) else
            {"tokens_per_s": sum(tokens) / sum(best[name]), "ms_per_update": 1e3 * sum(best[name]) / len(best[name]),
             **counts[name]} for name in normalizers}


def format_table(results: Dict[str, Dict[str, float]], baseline: str = "softmax") -> str:
    """Markdown table: tokens/s, ms per update, time relative to ``baseline`` and to fairseq's fused attention,
    and the counts per update (:func:`count_update`; CUDA's ``n/a`` off CUDA)."""
    lines = ["| normaliser | target tokens/s | ms/update | time vs softmax | time vs fairseq fused | launches/update | "
             "CUDA launches/update | CUDA syncs/update | fallbacks/update |", "|---|" + "---:|" * 8]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | {r['skipped']} |" + " - |" * 7)
            continue
        cuda = ["n/a" if r[key] is None else str(r[key]) for key in ("cuda_launches", "cuda_syncs")]
        ratios = [results[ref]["tokens_per_s"] / r["tokens_per_s"] if ref in results else float("nan")
                  for ref in (baseline, REFERENCE)]
        label = "fairseq transformer (fused softmax)" if name == REFERENCE else name
        lines.append(f"| {label} | {r['tokens_per_s']:.0f} | {r['ms_per_update']:.1f} | {ratios[0]:.2f}x | "
                     f"{ratios[1]:.2f}x | {r['launches']} | {cuda[0]} | {cuda[1]} | {r['fallbacks']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="fairseq binary data dir (default: the toy corpus in a temp dir)")
    parser.add_argument("--arch", default="softtopk_transformer_tiny",
                        help="softtopk_transformer_tiny or softtopk_transformer_multi30k")
    parser.add_argument("--normalizers", default=",".join(NORMALIZERS), help="comma-separated; 'fairseq' = reference")
    parser.add_argument("--updates", type=int, default=30, help="timed updates per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates before timing")
    parser.add_argument("--repeats", type=int, default=3,
                        help="interleaved runs per normaliser (the fastest run of each update counts)")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clock", choices=CLOCKS, default=None,
                        help="cpu (the default on the CPU): this process's CPU time (robust to other processes on a "
                             "shared machine; the wall time of an idle machine with --threads 1); wall: elapsed time "
                             "(always on CUDA)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--triton", action="store_true",
                        help="beside soft_topk and sparse_topk, a NAME:triton row with --attention-topk-backend triton "
                             "(the Triton kernels; timed on CUDA only, the row says skipped elsewhere), the normaliser "
                             "itself then with --attention-topk-backend torch")
    args = parser.parse_args(argv)
    names: List[str] = [n for n in args.normalizers.split(",") if n]
    kernel_rows = [n + TRITON for n in KERNEL_NORMALIZERS]
    unknown = [n for n in names if n not in NORMALIZERS and n not in kernel_rows]
    if unknown:
        parser.error(f"unknown normalizers {unknown}; choose from {NORMALIZERS} (or {', '.join(kernel_rows)})")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    if cuda and args.clock == "cpu":
        parser.error("--clock cpu does not see the GPU's work: on CUDA the time is elapsed time (--clock wall)")
    args.clock = args.clock or ("wall" if cuda else "cpu")
    if args.triton:  # each kernel row after its normaliser
        names = [row for n in names for row in ([n, n + TRITON] if n in KERNEL_NORMALIZERS else [n])]
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data_bin = args.data or binarize_generated_corpus(Path(tmp), splits={"train": (3000, 11), "valid": (100, 12)},
                                                    joined_dictionary=True)
        results = run_benchmark(data_bin, args.arch, names, args.updates, args.repeats, args.k, args.epsilon,
                                args.max_tokens, args.warmup, args.seed, CLOCKS[args.clock], args.device,
                                "torch" if args.triton else None)
    print(f"arch={args.arch} updates={args.updates} repeats={args.repeats} k={args.k} epsilon={args.epsilon} "
          f"max_tokens={args.max_tokens} threads={args.threads} clock={args.clock} device={args.device} "
          f"torch={torch.__version__}")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
