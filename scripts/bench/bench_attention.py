#!/usr/bin/env python
"""Training speed of ``softtopk_transformer`` with each attention normaliser, in one process.

Builds the toy language pair (or uses ``--data``), then for every normaliser trains a fresh
model (same seed, same batches) for ``--updates`` updates with Adam and label-smoothed cross
entropy, timing forward + backward + step, and prints target tokens/s and the time per
target token relative to ``softmax`` (the same unfused attention with a plain softmax). The
``fairseq`` row is fairseq's own ``transformer`` of the same size (fused attention), for
reference. Normalisers run interleaved, ``--repeats`` times, and each update counts with its
fastest run; time is the process's CPU time by default (``--clock wall`` for elapsed time).
Both make the ratios robust to other load on a shared machine.

Example::

    python scripts/bench/bench_attention.py --arch softtopk_transformer_tiny --updates 30 --repeats 3
"""

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.experiments.bench_harness import (build_training_parts, timed_updates,  # noqa: E402
                                                        training_batches)
from fairseq_softtopk.experiments.fairseq_commands import binarize_generated_corpus  # noqa: E402

NORMALIZERS = ("fairseq", "softmax", "soft_topk", "hard_topk", "sparse_topk", "sparsemax", "entmax15")
#: What ``fairseq`` means in the table: fairseq's transformer with its fused attention.
REFERENCE = "fairseq"
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def build_trainer_parts(data_bin: Path, arch: str, normalizer: str, k: int, epsilon: float, max_tokens: int,
                        seed: int):
    """``(task, model, criterion)`` for one normaliser, parameters initialised from ``seed``."""
    from fairseq.models.transformer import TransformerModel

    flags = ["--arch", arch, "--share-all-embeddings",
             "--attention-normalizer", "softmax" if normalizer == REFERENCE else normalizer,
             "--attention-topk", k, "--attention-topk-epsilon", epsilon,
             "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
             "--max-tokens", max_tokens, "--dropout", "0.1"]
    # the reference: the same sizes with fairseq's own (fused) attention
    build_model = (lambda cfg, task: TransformerModel.build_model(cfg, task)) if normalizer == REFERENCE else None
    return build_training_parts(data_bin, flags, seed, build_model=build_model)


def time_training(task, model, criterion, updates: int, max_tokens: int, warmup: int, seed: int,
                  clock=time.process_time) -> Tuple[List[float], List[int]]:
    """Trains ``warmup + updates`` updates; seconds and target tokens of each of the last ``updates``."""
    batches = itertools.islice(training_batches(task, max_tokens, seed), warmup + updates)
    records = timed_updates(model, criterion, batches, warmup, clock=clock)
    return [r["seconds"] for r in records], [r["tokens"] for r in records]


def run_benchmark(data_bin: Path, arch: str, normalizers: Sequence[str], updates: int, repeats: int, k: int,
                  epsilon: float, max_tokens: int, warmup: int, seed: int, clock=time.process_time
                  ) -> Dict[str, Dict[str, float]]:
    """Target tokens/s per normaliser from the fastest of ``repeats`` interleaved runs of each update.

    Every run of every normaliser sees the same batches in the same order, so the time of
    update ``i`` can be taken as its minimum over the runs, which discards the slowdowns that
    other processes on the machine cause now and then.
    """
    best: Dict[str, List[float]] = {}
    tokens: List[int] = []
    for _ in range(repeats):
        for name in normalizers:
            parts = build_trainer_parts(data_bin, arch, name, k, epsilon, max_tokens, seed)
            seconds, tokens = time_training(*parts, updates=updates, max_tokens=max_tokens, warmup=warmup, seed=seed,
                                            clock=clock)
            best[name] = [min(a, b) for a, b in zip(best[name], seconds)] if name in best else seconds
    return {name: {"tokens_per_s": sum(tokens) / sum(seconds), "ms_per_update": 1e3 * sum(seconds) / len(seconds)}
            for name, seconds in best.items()}


def format_table(results: Dict[str, Dict[str, float]], baseline: str = "softmax") -> str:
    """Markdown table: tokens/s, ms per update, time relative to ``baseline`` and to fairseq's fused attention."""
    lines = ["| normaliser | target tokens/s | ms/update | time vs softmax | time vs fairseq fused |",
             "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        ratios = [results[ref]["tokens_per_s"] / r["tokens_per_s"] if ref in results else float("nan")
                  for ref in (baseline, REFERENCE)]
        label = "fairseq transformer (fused softmax)" if name == REFERENCE else name
        lines.append(f"| {label} | {r['tokens_per_s']:.0f} | {r['ms_per_update']:.1f} | {ratios[0]:.2f}x | "
                     f"{ratios[1]:.2f}x |")
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
    parser.add_argument("--clock", choices=CLOCKS, default="cpu",
                        help="cpu: this process's CPU time (robust to other processes on a shared machine; "
                             "the wall time of an idle machine with --threads 1); wall: elapsed time")
    args = parser.parse_args(argv)
    names: List[str] = [n for n in args.normalizers.split(",") if n]
    unknown = [n for n in names if n not in NORMALIZERS]
    if unknown:
        parser.error(f"unknown normalizers {unknown}; choose from {NORMALIZERS}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data_bin = args.data or binarize_generated_corpus(Path(tmp), splits={"train": (3000, 11), "valid": (100, 12)},
                                                    joined_dictionary=True)
        results = run_benchmark(data_bin, args.arch, names, args.updates, args.repeats, args.k, args.epsilon,
                                args.max_tokens, args.warmup, args.seed, CLOCKS[args.clock])
    print(f"arch={args.arch} updates={args.updates} repeats={args.repeats} k={args.k} epsilon={args.epsilon} "
          f"max_tokens={args.max_tokens} threads={args.threads} clock={args.clock} torch={torch.__version__}")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
