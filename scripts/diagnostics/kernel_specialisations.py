#!/usr/bin/env python
"""Which compiled variants of the sorted Triton kernel a soft beam search asks for, update by update.

Triton compiles a kernel once per *specialisation* and keeps it: here the block size (the row length's next
power of two, at least 16 and at most a tile's entries / KP: 64 at k = 5 on a GPU), whether the row length is a
multiple of 16 or is 1 (Triton specialises integer arguments on both), and whether the row is longer than the
kernel's window (``WINDOW_MAX``). The adaptive search solves on the candidate window, whose width changes at
every step, so a variant can first be needed many updates into training, and each costs a compile of seconds
then. This runs ``scripts/bench/bench_train.py``'s configuration (default ``beam_soft``, on its toy corpus) on
the CPU, where the torch path gets the row lengths the kernels would get, and prints per update the variants
met and the new ones, marking the updates bench_train would time::

    python scripts/diagnostics/kernel_specialisations.py --updates 10 --warmup 2

(``make gpu-check``'s training step on an H200 timed 10 updates after 2 untimed ones; the variants counted here
are the forward kernel's, and its backward kernel is specialised on the same block and length.)
"""

import argparse
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Set, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench_train, for its configurations
import bench_train  # noqa: E402

from fairseq_softtopk.experiments.bench_harness import timed_updates  # noqa: E402
from fairseq_softtopk.experiments.fairseq_commands import binarize_generated_corpus  # noqa: E402
from fairseq_softtopk.modules import beam_selection  # noqa: E402
from fairseq_softtopk.ops.kernels.sorted_soft_topk_op import WINDOW_MAX, block_size  # noqa: E402

#: a variant of the compiled kernel: (block size, length a multiple of 16, length 1, windowed)
Variant = Tuple[int, bool, bool, bool]


def specialisation(n: int, k: int) -> Variant:
    """The variant of the sorted kernel (compiled for a GPU) that a row of ``n`` candidates and ``k`` ranks needs."""
    return block_size(n, k, interpret=False), n % 16 == 0, n == 1, n > WINDOW_MAX


def record_variants(opts: argparse.Namespace, config: str) -> List[Tuple[Set[Variant], List[int]]]:
    """Trains ``config`` for ``opts.warmup + opts.updates`` updates on the CPU; per update, the kernel variants its
    sorted soft top-k solves need and their row lengths."""
    per_update: List[Tuple[Set[Variant], List[int]]] = []
    solve = beam_selection.sorted_soft_topk

    def recording_solve(scores, k, **kwargs):
        per_update[-1][0].add(specialisation(scores.shape[-1], k))
        per_update[-1][1].append(scores.shape[-1])
        return solve(scores, k, **kwargs)

    model, criterion, batches = bench_train._setup(opts, config)
    forward = criterion.forward

    def counted_forward(*args, **kwargs):
        per_update.append((set(), []))  # one criterion call per update
        return forward(*args, **kwargs)

    criterion.forward = counted_forward
    beam_selection.sorted_soft_topk = recording_solve
    try:
        timed_updates(model, criterion, batches, opts.warmup, opts.device)
    finally:
        beam_selection.sorted_soft_topk = solve
    return per_update


def variants_table(per_update: Sequence[Tuple[Set[Variant], List[int]]], warmup: int) -> str:
    """A markdown table, one row per update, and a closing line counting the variants first met while timed."""
    lines = ["| update | timed | solves | row lengths | variants | new variants (block, n % 16 == 0, n == 1, "
             "windowed) |", "|---:|---|---:|---|---:|---|"]
    seen: Set[Variant] = set()
    late = []
    for update, (variants, lengths) in enumerate(per_update):
        new = sorted(variants - seen)
        seen |= variants
        timed = update >= warmup
        if timed and new:
            late.append(update)
        span = f"{min(lengths)}-{max(lengths)}" if lengths else "-"
        lines.append(f"| {update} | {'yes' if timed else 'no'} | {len(lengths)} | {span} | {len(variants)} | "
                     f"{', '.join(map(str, new))} |")
    lines.append(f"\n{len(seen)} variant{'' if len(seen) == 1 else 's'} in all; updates timed after {warmup} "
                 f"untimed that first need one: {', '.join(map(str, late)) or 'none'}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="beam_soft", help="a bench_train.py configuration that runs the search")
    parser.add_argument("--updates", type=int, default=10, help="updates bench_train would time")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates before them")
    parser.add_argument("--arch", default="softtopk_lstm_multi30k")
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    opts = parser.parse_args(argv)
    if opts.config not in bench_train.KERNEL_CONFIGS:
        parser.error(f"--config must run the soft search: one of {bench_train.KERNEL_CONFIGS}, got {opts.config!r}")
    if opts.updates < 1 or opts.warmup < 0:
        parser.error(f"need --updates >= 1 and --warmup >= 0, got {opts.updates} and {opts.warmup}")
    bench = bench_train.build_parser().parse_args([
        "--arch", opts.arch, "--max-tokens", str(opts.max_tokens), "--beam", str(opts.beam), "--threads",
        str(opts.threads), "--seed", str(opts.seed), "--updates", str(opts.updates), "--warmup", str(opts.warmup)])
    with tempfile.TemporaryDirectory() as tmp:
        bench.data = binarize_generated_corpus(Path(tmp), splits=bench_train.TOY_SPLITS, joined_dictionary=True)
        per_update = record_variants(bench, opts.config)
    print(f"{opts.config}, {opts.arch}, beam {opts.beam}, max-tokens {opts.max_tokens}, seed {opts.seed}: the sorted "
          f"kernel's variants per update\n")
    print(variants_table(per_update, opts.warmup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
