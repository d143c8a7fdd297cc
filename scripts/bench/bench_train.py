#!/usr/bin/env python
"""Training speed of beam-search training (``soft_beam_search``) against teacher forcing and hard beams.

Trains the same model (``--arch``: the plugin's LSTM by default, or a Transformer, whose decoder the
search drives through its incremental state; same initial parameters, same ``--max-tokens``
batches of the training set, Adam) for ``--updates`` timed updates after ``--warmup`` untimed
ones, with the ``soft_beam_search`` criterion as

* ``teacher_forcing``: ``--teacher-forcing-ratio 1.0`` (the beam search is skipped),
* ``beam_hard``: ``--topk-mode hard`` (exact top-k, the paper's ablation),
* ``beam_soft``: ``--topk-mode soft`` over all ``k * V`` candidates (the default search: the static window,
  ``sorted_soft_topk_window``, no host read a step),
* ``beam_soft_adaptive``: as ``beam_soft`` with ``--topk-window-width 0`` (the adaptive window, which the solver
  reads on the host every step: the default before the static window),
* ``beam_soft_pool``: ``--topk-mode soft --topk-candidate-pool m`` (the m best candidates only),
* ``beam_soft_fixed``: as ``beam_soft_pool`` with ``--topk-fixed-iterations --topk-max-iter
  --fixed-iter`` (no host synchronisation in the search: the GPU path),
* ``beam_soft_compiled``: as ``beam_soft_fixed`` with ``--topk-compile default`` (the solve under
  ``torch.compile``; compiled in an untimed forward and backward before the timed updates; not in
  the default ``--configs``: on a CPU inductor needs a C++ compiler and a minute or two to compile),
* ``beam_sparse``: the default soft search with ``--topk-regularizer quadratic --topk-epsilon
  --sparse-lambda`` (the sorted sparse soft top-k: the beams mix only its support; the ``sparse`` arm
  of ``configs/multi30k_en_de_beam_ablation.yaml``; not in the default ``--configs``),
* ``risk_hard``, ``risk_soft``: ``beam_hard`` and the default soft search with ``--beam-loss risk``
  (minimum risk over the finished hypotheses of a search to EOS), and ``risk_beamgrad``: the peer
  beamgrad's search and minimum risk on the same model (``--criterion beamgrad_risk``; needs the optional
  beamgrad): the cost columns of the risk ablation's table; not in the default ``--configs``,

and prints target tokens/s, ms per update (the mean, the median and the slowest update: a one-off cost
inside the timed updates, such as a Triton kernel compiled for a newly met shape, lifts the mean and the
slowest, not the median), peak memory, the share of the update spent in the sorted soft top-k operator and
the time per update relative to ``beam_hard`` (of the means).

How things are measured:

* Each configuration runs in a fresh subprocess (``--repeats`` times, interleaved); an
  update's time is its fastest run, which discards most slowdowns from other load.
* Top-k share: from a second, profiled pass over the same updates (same initial parameters
  and batches; ``--profile-updates`` of them), the time inside the package's named
  ``torch.profiler`` ranges over the profiled time of those updates: ``fwd`` is
  ``softtopk::sorted_soft_topk`` (the operator's forward, Newton solve included), ``bwd``
  ``softtopk::sorted_soft_topk_backward`` (implicit differentiation; both with the sparse operator's
  ranges, ``softtopk::sorted_sparse_soft_topk[_backward]``, for ``beam_sparse``), ``select`` the whole
  candidate selection ``softtopk::select_beams`` (window, or the pool's / hard mode's
  ``torch.topk``, plus the operator's forward), so ``beam_hard`` shows what its selection
  costs, ``mix`` the forward of the mixing of the next inputs and states by the selection
  (``softtopk::mix_beams``: one weighted ``embedding_bag`` and one ``bmm`` per state tensor, for a
  Transformer per cached self-attention key and value; hard mode reorders a Transformer's caches by index; its
  backward runs in autograd, outside the range). The timed pass runs without the profiler. ``Newton it.`` is the mean number of
  Newton iterations per batched solve (the criterion's ``topk_newton`` logging).
* Memory: CPU, the peak resident set size of the worker process during training (the peak
  is reset with ``/proc/self/clear_refs`` before the first update; elsewhere it is the peak
  since the process started) and its growth over the RSS before training; CUDA,
  ``torch.cuda.max_memory_allocated``.
* Launches and syncs (the GPU-speed proxy, measurable on a CPU): one more pass over
  ``--count-updates`` batches, forward and backward from the same initial parameters, under
  :class:`fairseq_softtopk.dispatch_count.DispatchCounter`: dispatched ATen operations (about one
  kernel launch each on a GPU) and host synchronisations per beam step (per target position for
  teacher forcing), split by part of the step: ``step`` (decoder step, candidate scores, the
  ``k + 1`` best, bookkeeping), ``select`` (window / pool / gradient cap), ``solve`` (the
  operator's forward), ``mix``, ``solve bwd`` (implicit differentiation), ``other bwd`` (the rest
  of the backward pass) and ``per batch`` (encoder, teacher-forcing pass, loss, spread over the
  steps). ``syncs/step`` counts those inside a decoding step and in the backward pass, ``syncs/batch``
  the others. ``fused solve`` is what a kernel doing the whole solve, and one its backward, would
  leave: the launches without ``solve`` and ``solve bwd``, plus 2. On CUDA the profiled pass also
  counts the kernel launches the CUDA runtime saw (``CUDA launches/step``, optimizer step included).
  ``beam_soft_compiled``: under the counter the compiled solve runs eagerly, so its ``solve`` and
  ``solve bwd`` columns are instead the kernels that inductor generated for the solve's forward and
  backward graphs, read from the code it wrote in that untimed compiling pass (on a CPU, C++ kernels;
  on CUDA, Triton ones; library calls such as ``bmm`` included).
* ``--triton``: beside each configuration that runs the soft top-k operators (``beam_soft*``, ``risk_soft``,
  ``beam_sparse``), a row ``CONFIG:triton`` with ``--topk-backend triton`` (the fused Triton kernels), and
  the configuration itself with ``--topk-backend torch`` (without ``--triton``: the default ``auto``). The
  kernel rows are timed on CUDA only (on the CPU the kernels run under Triton's interpreter: the rows say
  skipped); on the CPU with ``TRITON_INTERPRET=1`` set, their launches are still counted (the counted pass
  only: each kernel launch once, with the operations around it, none of the interpreter's own work). Calls that asked for the kernels and ran on the torch path (an operator without kernels yet) are
  listed per step under the launch table (``kernel fallbacks``), so that a kernel row is not mistaken for one.
  On CUDA the counted pass also counts the host synchronisations CUDA reports under
  ``torch.cuda.set_sync_debug_mode("warn")`` (``CUDA syncs/step``: every one, per decoding step).
* ``--profile CONFIG`` prints ``torch.profiler`` tables instead: self CPU time by region
  (the named ranges, other forward / backward, optimizer)
  with each region's costliest ops, then the top ops overall.
* The operator's cost depends on how peaked the model's distribution is: from a random
  initialisation every candidate is nearly tied. ``--pretrain-updates N`` (or
  ``--checkpoint``) starts every configuration from a teacher-forced model instead, as in
  fine-tuning.
* On a machine shared with other jobs, ``--threads 1`` and ``--repeats 3`` give steadier
  numbers: waiting OpenMP threads slow down many times over when the cores are busy.

Example::

    python scripts/bench/bench_train.py --updates 5 --warmup 1                      # toy corpus
    python scripts/bench/bench_train.py --data multi30k/bin --arch softtopk_lstm_multi30k --max-tokens 2000 \
        --pretrain-updates 300 --threads 1
    python scripts/bench/bench_train.py --data multi30k/bin --profile beam_soft --updates 3
    python scripts/bench/bench_train.py --data multi30k/bin --arch softtopk_transformer_prenorm_multi30k \
        --checkpoint CHECKPOINT --max-tokens 2000 --threads 1                            # the Transformer rows
"""

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.experiments.bench_harness import (build_training_parts, fixed_batches, header,  # noqa: E402
                                                        kernel_skip_reason, region_table, reset_peak_rss, rss_mib,
                                                        timed_updates)
from fairseq_softtopk.experiments.bench_passes import (compile_and_count_kernels, count_dispatches,  # noqa: E402
                                                       profiled_shares)
from fairseq_softtopk.experiments.bench_train_tables import (format_count_table, format_table,  # noqa: E402
                                                             summarize)
from fairseq_softtopk.experiments.fairseq_commands import binarize_generated_corpus  # noqa: E402
from fairseq_softtopk.ops.kernels import triton_available  # noqa: E402
from fairseq_softtopk.ops.kernels.backend import interpreter_requested  # noqa: E402

#: beam_soft_fixed: the sync-free search (--topk-fixed-iterations) on the pool of beam_soft_pool;
#: beam_soft_compiled: that search with its solve under torch.compile (--topk-compile default)
CONFIGS = ("teacher_forcing", "beam_hard", "beam_soft", "beam_soft_adaptive", "beam_soft_pool", "beam_soft_fixed",
           "beam_soft_compiled", "risk_hard", "risk_soft", "risk_beamgrad", "beam_sparse")
#: what runs without --configs: not the compiled config (compiling on a CPU takes minutes), nor the risk configs
#: (the sequence-level loss: a search to EOS, --beam-loss risk; risk_beamgrad needs the optional beamgrad)
DEFAULT_CONFIGS = CONFIGS[:6]
#: the configurations that run the soft top-k operators: --triton adds a CONFIG:triton row for each
KERNEL_CONFIGS = ("beam_soft", "beam_soft_adaptive", "beam_soft_pool", "beam_soft_fixed", "beam_soft_compiled", "risk_soft", "beam_sparse")
#: the suffix of a configuration run with --topk-backend triton (the Triton kernels)
TRITON = ":triton"
#: why a kernel row is not timed on a device ("": it is); a module attribute, so that tests can lift the skip
triton_skip_reason = kernel_skip_reason
_RESULT_TAG = "BENCH_RESULT "
#: The toy corpus used without --data: 3000 training pairs (as bench_attention.py).
TOY_SPLITS = {"train": (3000, 11), "valid": (100, 12)}


def criterion_args(config: str, beam: int, epsilon: Optional[float], pool: int, ratio: float,
                   fixed_iter: int = 15, sparse_lambda: float = 0.1, backend: Optional[str] = None) -> List[str]:
    """``soft_beam_search`` flags of one configuration (one of :data:`CONFIGS`, or one of
    :data:`KERNEL_CONFIGS` + :data:`TRITON`: with ``--topk-backend triton``); ``beam_sparse`` takes
    ``sparse_lambda`` as its ``--topk-epsilon`` (the quadratic regulariser's lambda) whatever ``epsilon``;
    ``backend`` (None: the criterion's default) is the ``--topk-backend`` of a configuration without the suffix."""
    if config.endswith(TRITON) and config[: -len(TRITON)] in KERNEL_CONFIGS:
        config, backend = config[: -len(TRITON)], "triton"
    common = ["--criterion", "soft_beam_search", "--train-beam", str(beam)]
    if backend is not None and config in KERNEL_CONFIGS:
        common += ["--topk-backend", backend]
    if epsilon is not None:  # None: the criterion's default
        common += ["--topk-epsilon", str(epsilon)]
    flags = {
        "teacher_forcing": ["--teacher-forcing-ratio", "1.0"],
        "beam_hard": ["--teacher-forcing-ratio", str(ratio), "--topk-mode", "hard"],
        "beam_soft": ["--teacher-forcing-ratio", str(ratio), "--topk-mode", "soft", "--topk-candidate-pool", "0"],
        "beam_soft_pool": ["--teacher-forcing-ratio", str(ratio), "--topk-mode", "soft",
                           "--topk-candidate-pool", str(pool)],
        "beam_soft_fixed": ["--teacher-forcing-ratio", str(ratio), "--topk-mode", "soft",
                            "--topk-candidate-pool", str(pool), "--topk-fixed-iterations",
                            "--topk-max-iter", str(fixed_iter)],
    }
    flags["beam_soft_adaptive"] = flags["beam_soft"] + ["--topk-window-width", "0"]
    flags["beam_soft_compiled"] = flags["beam_soft_fixed"] + ["--topk-compile", "default"]
    # the risk arms of configs/multi30k_en_de_risk_ablation.yaml, with the same teacher-forcing ratio as the others
    flags["risk_hard"] = flags["beam_hard"] + ["--beam-loss", "risk"]
    flags["risk_soft"] = flags["beam_soft"] + ["--beam-loss", "risk"]
    # the sparse arm of configs/multi30k_en_de_beam_ablation.yaml (a later --topk-epsilon wins in argparse)
    flags["beam_sparse"] = flags["beam_soft"] + ["--topk-regularizer", "quadratic", "--topk-epsilon", str(sparse_lambda)]
    if config == "risk_beamgrad":  # the peer's search and minimum risk, driving the same model
        return ["--criterion", "beamgrad_risk", "--train-beam", str(beam), "--teacher-forcing-ratio", str(ratio)]
    if config not in flags:
        raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")
    return common + flags[config]


def with_kernel_rows(configs: Sequence[str]) -> List[str]:
    """``configs`` with, after each of :data:`KERNEL_CONFIGS`, its kernel row (``CONFIG:triton``)."""
    return [row for c in configs for row in ([c, c + TRITON] if c in KERNEL_CONFIGS else [c])]


def build_parts(opts: argparse.Namespace, config: str):
    """``(task, model, criterion)`` of one configuration, parameters initialised from ``opts.seed``
    (then loaded from ``opts.checkpoint`` where given)."""
    flags = ["--arch", opts.arch, "--max-tokens", opts.max_tokens,
             *criterion_args(config, opts.beam, opts.epsilon, opts.candidate_pool, opts.teacher_forcing_ratio,
                            opts.fixed_iter, opts.sparse_lambda, "torch" if opts.triton else None)]
    if opts.window_width is not None and config.split(":")[0] in ("beam_soft", "risk_soft", "beam_sparse"):
        flags += ["--topk-window-width", opts.window_width]
    task, model, criterion = build_training_parts(opts.data, flags, opts.seed, opts.device)
    if opts.checkpoint:
        state = torch.load(opts.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state.get("model", state))  # a fairseq checkpoint or a bare state dict
    return task, model, criterion


def update_record(record: dict) -> Dict[str, float]:
    """One timed update of :func:`bench_harness.timed_updates` as this benchmark keeps it."""
    logging = record["logging"]
    return {"seconds": record["seconds"], "tokens": record["tokens"],
            "newton_iters": logging.get("topk_newton_iters", 0.0), "solves": logging.get("topk_solves", 0.0)}


def _setup(opts: argparse.Namespace, config: str):
    """Threads, quiet logging, ``(model, criterion, batches)`` of one configuration."""
    torch.set_num_threads(opts.threads)
    for name in ("fairseq", "hydra", "filelock"):  # filelock: inductor's cache locks
        logging.getLogger(name).setLevel(logging.WARNING)
    task, model, criterion = build_parts(opts, config)
    return model, criterion, fixed_batches(task, opts.max_tokens, opts.warmup + opts.updates, opts.seed, opts.device)


def run_config(opts: argparse.Namespace, config: str) -> dict:
    """Builds and trains one configuration in this process.

    Returns ``{"updates": [...], "peak_mib", "growth_mib", "profile": {...}, "counts": {...}}``: the
    timed pass (no profiler), then the profiled pass (:func:`profiled_shares`) over the first
    ``opts.profile_updates`` of the same updates and the counted pass (:func:`count_dispatches`) over the
    first ``opts.count_updates`` (forward and backward only), each from the same initial parameters.
    """
    model, criterion, batches = _setup(opts, config)
    initial = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    compiled = None
    if config == "beam_soft_compiled":  # compile now, reading the kernels (the timed updates find it compiled)
        compiled = compile_and_count_kernels(model, criterion, batches[0])
    cuda = opts.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = rss_mib("VmRSS")
        reset_peak_rss()
    records = [update_record(r) for r in timed_updates(model, criterion, batches, opts.warmup, opts.device)]
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mib("VmHWM")
    growth = None if peak is None or before is None else peak - before
    model.load_state_dict(initial)
    shares = profiled_shares(model, criterion, batches[: opts.warmup + opts.profile_updates], opts.warmup, opts.device)
    model.load_state_dict(initial)
    counts = count_dispatches(model, criterion, batches[opts.warmup: opts.warmup + opts.count_updates])
    if compiled is not None:  # counted eagerly (module docstring): the solve is the kernels inductor wrote
        counts["launches"].update(compiled)
    return {"updates": records, "peak_mib": peak, "growth_mib": growth, "profile": shares, "counts": counts}


def pretrain(opts: argparse.Namespace, path: Path) -> None:
    """Teacher-forced updates (``opts.pretrain_updates``, Adam) from ``opts.checkpoint`` or scratch, saved to
    ``path``: the beams then search a peaked distribution, as when fine-tuning, not a uniform one."""
    # another seed: other batches than the timed ones
    pre = argparse.Namespace(**{**vars(opts), "updates": opts.pretrain_updates, "warmup": 0, "seed": opts.seed + 1})
    model, criterion, batches = _setup(pre, "teacher_forcing")
    records = timed_updates(model, criterion, batches, 0, opts.device)
    torch.save(model.state_dict(), path)
    print(f"pretrained {len(records)} teacher-forced updates in {sum(r['seconds'] for r in records):.0f} s "
          f"-> {path}", flush=True)


def run_isolated(opts: argparse.Namespace, argv: Sequence[str], config: str) -> dict:
    """:func:`run_config` in a fresh Python process (this script with ``--worker``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--data", str(opts.data), "--worker", config]
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads), MKL_NUM_THREADS=str(opts.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {config} failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(_RESULT_TAG):])


def run_benchmark(opts: argparse.Namespace, argv: Sequence[str], configs: Sequence[str]) -> Dict[str, dict]:
    """Summary per configuration; each update counts with its fastest of ``opts.repeats`` interleaved runs; a
    kernel row that is not timed here (:func:`triton_skip_reason`) is ``{"skipped": why}``."""
    skipped = {name: triton_skip_reason(opts.device) for name in configs if name.endswith(TRITON)}
    runs: Dict[str, List[dict]] = {name: [] for name in configs if not skipped.get(name)}
    for repeat in range(opts.repeats):
        for name in runs:
            runs[name].append(run_config(opts, name) if opts.in_process else run_isolated(opts, argv, name))
            # each run's times as it ends: a run stopped part-way (a GPU lease's time limit) keeps them
            done = summarize(runs[name][-1:])
            print(f"run {repeat + 1}/{opts.repeats} of {name}: {done['ms_per_update']:.1f} ms/update (median "
                  f"{done['median_ms']:.1f}, slowest {done['slowest_ms']:.1f})", flush=True)
    summary = {name: {"skipped": skipped[name]} if skipped.get(name) else summarize(runs[name]) for name in configs}
    if interpreter_requested() and triton_available():  # untimed kernel rows: their launches, counted here
        for name in skipped:
            if skipped[name]:
                summary[name]["counts"] = count_config(opts, name)
    return summary


def count_config(opts: argparse.Namespace, config: str) -> dict:
    """The counted pass of :func:`run_config` alone (:func:`count_dispatches`), in this process: for the kernel
    rows on a CPU, whose kernels run under Triton's interpreter (no time to report, but the launches a GPU would
    see: each kernel once, with the operations around it)."""
    model, criterion, batches = _setup(opts, config)
    return count_dispatches(model, criterion, batches[opts.warmup: opts.warmup + opts.count_updates])


def profile_config(opts: argparse.Namespace, config: str, rows: int) -> str:
    """``torch.profiler`` tables over the timed updates of one configuration: by region, and by op."""
    from torch.profiler import ProfilerActivity, profile

    model, criterion, batches = _setup(opts, config)
    cuda = opts.device.startswith("cuda")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    timed_updates(model, criterion, batches[: opts.warmup], 0, opts.device, optimizer=optimizer)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        records = timed_updates(model, criterion, batches[opts.warmup:], 0, opts.device, optimizer=optimizer)
    seconds = sum(r["seconds"] for r in records)
    ops = prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                    row_limit=rows, max_name_column_width=60)
    return (f"{config}: {len(records)} profiled updates, {1e3 * seconds / len(records):.0f} ms/update "
            f"(profiler overhead included)\n\nself CPU time by region (top ops in ms):\n"
            f"{region_table(prof.events(), 8)}\n\n{ops}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="fairseq binary data dir (default: the toy corpus in a temp dir)")
    parser.add_argument("--arch", default="softtopk_lstm_multi30k", help="an architecture beam-search training supports "
                        "(softtopk_lstm*, softtopk_transformer*, fairseq's transformer*)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated subset of {CONFIGS} (default: all but beam_soft_compiled)")
    parser.add_argument("--updates", type=int, default=20, help="timed updates per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates before timing")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs per config (fastest per update)")
    parser.add_argument("--beam", type=int, default=5, help="--train-beam k")
    parser.add_argument("--epsilon", type=float, default=None, help="--topk-epsilon (default: the criterion's)")
    parser.add_argument("--sparse-lambda", type=float, default=0.1,
                        help="--topk-epsilon (lambda) of beam_sparse (default 0.1, the sparse ablation arm's)")
    parser.add_argument("--candidate-pool", type=int, default=50, help="m of beam_soft_pool and beam_soft_fixed")
    parser.add_argument("--window-width", type=int, help="--topk-window-width of the default search's configs "
                                                         "(beam_soft, risk_soft; default: the criterion's, -1)")
    parser.add_argument("--fixed-iter", type=int, default=15,
                        help="--topk-max-iter of beam_soft_fixed (every solve runs exactly this many iterations)")
    parser.add_argument("--teacher-forcing-ratio", type=float, default=0.8, help="p of the beam configs")
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--checkpoint", type=Path, help="start every config from these weights (fairseq checkpoint "
                        "or state dict of the same --arch and dictionaries), e.g. a teacher-forcing pretrained model")
    parser.add_argument("--pretrain-updates", type=int, default=0,
                        help="first train this many teacher-forced updates (untimed, once) and start every config "
                             "from the result; 0: from --checkpoint or random initialisation")
    parser.add_argument("--profile-updates", type=int, default=5,
                        help="updates of the profiled pass that measures the top-k shares (at most --updates)")
    parser.add_argument("--count-updates", type=int, default=2,
                        help="batches of the counted pass (launches and syncs per step; at most --updates)")
    parser.add_argument("--triton", action="store_true",
                        help="beside each configuration that runs the soft top-k operators, a CONFIG:triton row with "
                             "--topk-backend triton (the Triton kernels; timed on CUDA only, the row says skipped "
                             "elsewhere), the configuration itself then with --topk-backend torch")
    parser.add_argument("--in-process", action="store_true", help="no subprocess per run (memory then accumulates)")
    parser.add_argument("--profile", metavar="CONFIG", help="print a torch.profiler table for this config instead")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--worker", metavar="CONFIG", help=argparse.SUPPRESS)  # internal: one isolated run
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    opts = parser.parse_args(argv)
    configs = [c for c in opts.configs.split(",") if c]
    kernel_rows = [c + TRITON for c in KERNEL_CONFIGS]
    unknown = [c for c in configs + [opts.profile or CONFIGS[0]] if c not in CONFIGS and c not in kernel_rows]
    configs = with_kernel_rows(configs) if opts.triton else configs
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {CONFIGS} (or {', '.join(kernel_rows)})")
    if min(opts.updates, opts.repeats, opts.threads, opts.profile_updates, opts.count_updates) < 1 or opts.warmup < 0:
        parser.error(f"need --updates, --repeats, --threads, --profile-updates, --count-updates >= 1 and --warmup >= 0, "
                     f"got {opts.updates}, {opts.repeats}, {opts.threads}, {opts.profile_updates}, {opts.count_updates}, "
                     f"{opts.warmup}")
    opts.profile_updates = min(opts.profile_updates, opts.updates)
    opts.count_updates = min(opts.count_updates, opts.updates)
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    if opts.worker:
        print(_RESULT_TAG + json.dumps(run_config(opts, opts.worker)), flush=True)
        return 0
    torch.set_num_threads(opts.threads)
    print(header(argv, opts.threads, opts.device), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        opts.data = opts.data or binarize_generated_corpus(Path(tmp), splits=TOY_SPLITS, joined_dictionary=True)
        if opts.pretrain_updates:
            pretrain(opts, Path(tmp) / "pretrained.pt")
            opts.checkpoint = Path(tmp) / "pretrained.pt"
            argv = argv + ["--checkpoint", str(opts.checkpoint), "--pretrain-updates", "0"]
        print(f"data={opts.data} checkpoint={opts.checkpoint} arch={opts.arch} k={opts.beam} "
              f"epsilon={opts.epsilon} sparse_lambda={opts.sparse_lambda} pool={opts.candidate_pool} p={opts.teacher_forcing_ratio} "
              f"max_tokens={opts.max_tokens} updates={opts.updates} warmup={opts.warmup} repeats={opts.repeats}",
              flush=True)
        if opts.profile:
            print(profile_config(opts, opts.profile, opts.profile_rows))
            return 0
        summary = run_benchmark(opts, argv, configs)
    memory = "peak CUDA MiB (+growth)" if opts.device.startswith("cuda") else "peak RSS MiB (+growth)"
    print(format_table(summary, memory))
    print("\nlaunches (dispatched ATen operations) and host syncs per decoding step, forward + backward:")
    print(format_count_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
