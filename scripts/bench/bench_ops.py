#!/usr/bin/env python
"""Benchmark of the SOFT top-k operators against the paper's algorithm, unrolled Sinkhorn and torch.topk.

For each n, k, epsilon and operator (unsorted / sorted), all methods solve the same problem
(the paper's cost: squared distance to the anchors divided by its maximum) on one row of
standard normal scores and are timed for forward + backward (median of ``--repeats`` after a
warm-up). ``--scores logprobs`` gives rows peaked like a decoder's log-probabilities instead:
``log_softmax(4 z)`` of standard normal ``z`` (see :func:`make_scores`; the case is labelled ``logprobs``).
Methods:

* ``ours``: :func:`fairseq_softtopk.ops.soft_topk` / ``sorted_soft_topk`` (``cost="paper"``,
  solved to ``--tol``; implicit backward);
* ``paper``: the published algorithm (200 Sinkhorn iterations, appendix-B backward), see
  :mod:`fairseq_softtopk.ops.paper_algorithm`;
* ``unrolled``: the same 200 log-domain Sinkhorn iterations differentiated by autograd;
* ``topk``: ``torch.topk`` values, forward + backward (the lower bound);
* with ``--sparse``, ``sparse``: the quadratically regularised counterpart of ``ours``
  (:func:`~fairseq_softtopk.ops.sparse_soft_topk` / ``sorted_sparse_soft_topk`` with
  ``regularization = epsilon``, the linear cost's units: needs ``--cost linear``); its note gives the
  support: the mean number of entries per row with a nonzero weight (the dense operators: all n);
* with ``--triton``, ``ours_triton``: ours with ``backend="triton"``, the fused Triton kernels (one launch
  for the solve of every row, one for the backward), and with ``--sparse`` also ``sparse_triton``; CUDA
  only: on the CPU the kernels run under Triton's interpreter, which is no speed to report, and the rows
  say so. ``ours``, ``ours_fixed`` and ``sparse`` are the torch path (``backend="torch"``) on every device.
  The sorted operator's calls of few long rows take the many-programs-a-row kernels (the note says "split
  kernels"); for them ``ours_triton_rows`` times the same call on the one-program-a-row kernels, and for calls of
  more rows as long ``ours_triton_split`` times it on the split kernels (the row limit is not yet set on a GPU);
* with ``--fixed-iterations N``, ``ours_fixed``: ours with ``fixed_iterations=True`` and
  ``max_iter=N`` (no host synchronisation: N iterations on all n entries, the GPU path), and
  with ``--compile MODE`` also ``ours_compiled``: that call under
  ``torch.compile(fullgraph=True, mode=MODE)`` (``reduce-overhead`` captures CUDA graphs on a
  GPU), compiled in an untimed first call of each case;
* with ``--window``, ``ours_window``: :func:`~fairseq_softtopk.ops.sorted_soft_topk_window`, the sorted operator
  on a static window of each row's W best candidates (no host synchronisation; the soft beam search's default
  selection, with its 16 fixed iterations), on the torch path, and with ``--triton`` also
  ``ours_window_triton``; timed on its own output, the ``(rows, W, k)`` ranks (the backward scatters their
  gradient into the scores'). Sorted operator and linear cost only (``--cost linear``; the unsorted operator's
  rows say skipped). W is :func:`~fairseq_softtopk.ops.default_window_width`'s (64 at epsilon <= 0.05, 512 at
  <= 0.15, for k = 5) or ``--window-width``; the note gives W, the candidates the rows need (at or above the
  certificate's floor: median and largest) and the rows that overflow the window (``info.n_overflow``: their
  result is the plan of their W best alone, not the operator's; written OVERFLOW). On standard normal rows of
  38,840 entries nearly every row overflows; on ``--scores logprobs`` none does at the beam-search shape.

Memory is the autograd memory: bytes of the distinct tensors saved for backward plus the
output (what training keeps alive per call); on CUDA the peak allocation is printed too.
``err`` is the marginal error reached: ``max_r |sum_i A_ir - m_r| / m_r``.

Usage::

    python scripts/bench/bench_ops.py --threads 1          # the full grid (about 20 min here)
    python scripts/bench/bench_ops.py --n 100000 --k 5 --eps 0.01
    python scripts/bench/bench_ops.py --ops sorted_soft_topk --n 1000 --k 100 --eps 0.1 --cost linear --batch 100 \\
        --tol 1e-5
    python scripts/bench/bench_ops.py --n 100000 --k 5 --eps 0.01 --fixed-iterations 15 --compile reduce-overhead
    python scripts/bench/bench_ops.py --ops soft_topk --cost linear --batch 32 --n 1000 100000 --k 5 --eps 0.1 \
        --triton                                         # the Triton kernels beside the torch path (CUDA)
    python scripts/bench/bench_ops.py --threads 1 --cost linear --sparse --n 1000 10000 100000 1000000 --k 5 50 \
        --eps 0.1                                        # entropic and sparse operators against torch.topk
    python scripts/bench/bench_ops.py --ops sorted_soft_topk --cost linear --n 38840 --k 5 --eps 0.03 0.1 \
        --batch 64 --scores normal logprobs --window --triton  # the static window at the beam-search shape
"""

import argparse
import contextlib
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.modules.beam_selection import WINDOW_ITERATIONS  # noqa: E402
from fairseq_softtopk.ops import (candidate_window, soft_topk, sorted_soft_topk,  # noqa: E402
                                  sorted_soft_topk_window, sorted_sparse_soft_topk, sparse_soft_topk)
from fairseq_softtopk.ops.kernels import sorted_soft_topk_split_op, triton_available  # noqa: E402
from fairseq_softtopk.ops.paper_algorithm import paper_marginal_error, paper_soft_topk  # noqa: E402

UNROLLED_MAX_ELEMENTS = 2e6  # n * (k+1) above which 200 unrolled iterations need > ~3 GB: skipped
MIN_TIMED_SECONDS = 0.5  # fast methods are repeated until this much has been timed ...
MAX_RUNS = 200  # ... in at most this many runs
#: ``--scores logprobs``: log_softmax of standard normal logits times this. At 64 x 38,840, k = 5, the best two
#: candidates lie a median 0.55 apart and the rows need a median 13 (largest 20) candidates at epsilon 0.03, 77
#: (114) at 0.1, near the 12 (36) and 59 (214) measured on the shipped Multi30k Transformer's beam steps
LOGPROB_SCALE = 4.0
SCORE_DISTRIBUTIONS = ("normal", "logprobs")


def make_scores(n: int, k: int, batch: int = 1, distribution: str = "normal") -> torch.Tensor:
    """The ``(batch, n)`` scores of a case, on the CPU (seeded by n and k): standard normal, or (``"logprobs"``)
    ``log_softmax(LOGPROB_SCALE * z)`` of the same standard normal ``z`` a row."""
    if distribution not in SCORE_DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {SCORE_DISTRIBUTIONS}, got {distribution!r}")
    z = torch.randn(batch, n, generator=torch.Generator(device="cpu").manual_seed(n + k))
    return torch.log_softmax(LOGPROB_SCALE * z, dim=-1) if distribution == "logprobs" else z


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> (torch.Tensor, int):
    """Runs ``fn`` recording the distinct storages autograd saves; returns (output, bytes)."""
    seen: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values()) + out.numel() * out.element_size()


def _time(fn: Callable[[], torch.Tensor], x: torch.Tensor, repeats: int, device: str):
    """Forward+backward seconds (median and minimum), autograd bytes and the last output.

    The first run is a warm-up, unless it took over 2 s: then it is the measurement. Fast
    methods are repeated until :data:`MIN_TIMED_SECONDS` have been timed (at least
    ``repeats`` runs, at most :data:`MAX_RUNS`), so that a millisecond is not one sample.
    Returns ``(median, minimum, bytes, output)``.
    """
    upstream = {}  # the output gradient, built once per shape: not part of any method's time

    def once():
        x.grad = None
        out, nbytes = _saved_bytes(fn)
        if out.shape not in upstream:
            upstream[out.shape] = (torch.ones_like(out) / out.numel()
                                   + torch.linspace(0, 1, out.numel(), device=device).view_as(out))
        out.backward(upstream[out.shape])
        return out, nbytes

    cuda = device.startswith("cuda")

    def timed():
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = once()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, result

    first, (out, nbytes) = timed()
    if first > 2.0:  # slow baselines (seconds per call): one run is measurement enough
        return first, first, nbytes, out
    times = []
    while len(times) < repeats or (sum(times) < MIN_TIMED_SECONDS and len(times) < MAX_RUNS):
        seconds, (out, nbytes) = timed()
        times.append(seconds)
    return statistics.median(times), min(times), nbytes, out


def bench_case(n: int, k: int, eps: float, sorted_op: bool, repeats: int, tol: float, device: str,
               cost: str = "paper", batch: int = 1, fixed_iterations: Optional[int] = None,
               compile_mode: Optional[str] = None, sparse: bool = False, triton: bool = False,
               window: bool = False, window_width: Optional[int] = None, scores: str = "normal") -> List[dict]:
    """All methods on one (n, k, epsilon, operator) case of ``batch`` rows of scores; returns one row per method.

    ``fixed_iterations`` adds ``ours_fixed`` (and ``compile_mode`` ``ours_compiled``, whose
    ``err`` is its largest difference from ``ours_fixed``'s output); ``sparse`` adds ``sparse``, the
    quadratically regularised operator at ``regularization = eps`` (linear cost only); ``triton`` adds
    ``ours_triton`` (timed on CUDA only, see :func:`triton_skip_reason`; with few long rows of the sorted operator
    also ``ours_triton_rows``, the one-program-a-row kernels); ``window`` adds
    ``ours_window`` (and with ``triton`` ``ours_window_triton``): the static window of ``window_width``
    candidates (None: the operator's default), sorted operator and linear cost only. ``scores`` is
    :func:`make_scores`' distribution.

    The published algorithm and the unrolled iterations solve the paper's cost only: with
    ``cost="linear"`` they are left out (the rows say so).
    """
    x = make_scores(n, k, batch, scores).to(device).requires_grad_()
    rows = []
    info_box = {}
    op = sorted_soft_topk if sorted_op else soft_topk

    def ours():
        # unsorted: the paper's Algorithm 1 marks the k smallest; the appendix code sorts the largest
        out, info = op(x, k, epsilon=eps, cost=cost, tol=tol, largest=sorted_op, return_info=True, backend="torch")
        info_box["ours"] = info
        return out

    def paper():
        out, plan = paper_soft_topk(x, k, eps, n_iter=200, sorted=sorted_op)
        info_box["paper"] = paper_marginal_error(plan, k, sorted_op)
        return out

    def unrolled():
        anchors = (torch.arange(k, -1, -1.0) if sorted_op else torch.tensor([0.0, 1.0])).to(device)
        masses = [1.0] * k + [n - k] if sorted_op else [k, n - k]
        C = (x.unsqueeze(-1) - anchors) ** 2
        C = C / C.max().detach()
        log_mu = torch.full((1, n, 1), -torch.log(torch.tensor(float(n))).item(), device=device)
        log_nu = torch.log(torch.tensor(masses, device=device) / n).view(1, 1, -1)
        f = torch.zeros(1, n, 1, device=device)
        g = torch.zeros(1, 1, len(masses), device=device)
        for _ in range(200):
            f = eps * log_mu - eps * torch.logsumexp((g - C) / eps, -1, keepdim=True)
            g = eps * log_nu - eps * torch.logsumexp((f - C) / eps, -2, keepdim=True)
        plan = torch.exp((f + g - C) / eps)
        info_box["unrolled"] = paper_marginal_error(plan, k, sorted_op)
        return n * (plan[..., :k] if sorted_op else plan[..., 0])

    def fixed_call(v):
        return op(v, k, epsilon=eps, cost=cost, tol=tol, largest=sorted_op, return_info=True,
                  max_iter=fixed_iterations, fixed_iterations=True, backend="torch")

    def triton_call(name, family=contextlib.nullcontext):
        """The kernels' call, recorded as ``name``, inside ``family()``: the kernel family the shape takes, or
        another forced (``ours_triton_rows``: one program a row, where the call would take the split kernels;
        ``ours_triton_split``: the split kernels, where a call of many long rows would take the one-program ones)."""
        def call():
            with family():
                out, info = op(x, k, epsilon=eps, cost=cost, tol=tol, largest=sorted_op, return_info=True,
                               backend="triton")
            info_box[name] = info
            return out
        return call

    ours_triton = triton_call("ours_triton")
    ours_triton_rows = triton_call("ours_triton_rows", sorted_soft_topk_split_op.one_program_a_row)
    ours_triton_split = triton_call("ours_triton_split", sorted_soft_topk_split_op.split_for_long_rows)

    def ours_fixed():
        out, info = fixed_call(x)
        info_box["ours_fixed"] = info
        return out

    compiled_call = None
    if compile_mode is not None:
        # the output alone: the info's tensors are read from ours_fixed, which solves the same problem
        compiled_call = torch.compile(lambda v: fixed_call(v)[0], fullgraph=True, dynamic=False,
                                      mode=None if compile_mode == "default" else compile_mode)

    def ours_compiled():
        return compiled_call(x)

    def window_call(name, backend):
        ranks, _, info = sorted_soft_topk_window(x, k, epsilon=eps, width=window_width, tol=tol,
                                                 max_iter=WINDOW_ITERATIONS, return_info=True, backend=backend)
        info_box[name] = info
        return ranks

    def ours_window():
        return window_call("ours_window", "torch")

    def ours_window_triton():
        return window_call("ours_window_triton", "triton")

    def topk():
        return x.topk(k, dim=-1, largest=sorted_op).values

    def sparse_call(name, backend):
        if sorted_op:
            out, info = sorted_sparse_soft_topk(x, k, regularization=eps, tol=tol, return_info=True, backend=backend)
            info_box[name] = info
            return out
        info_box[name] = None  # exact threshold: no iteration, no marginal error beyond rounding
        return sparse_soft_topk(x, k, regularization=eps, backend=backend)

    def sparse_op():
        return sparse_call("sparse", "torch")

    def sparse_triton():
        return sparse_call("sparse_triton", "triton")

    split_rows = sorted_op and sorted_soft_topk_split_op.use_split_kernels(batch, n)  # the split kernels' calls
    methods = {"ours": ours}
    if triton:
        methods["ours_triton"] = ours_triton
        if split_rows:
            methods["ours_triton_rows"] = ours_triton_rows
        elif sorted_op and n >= sorted_soft_topk_split_op.SPLIT_MIN_LENGTH:
            methods["ours_triton_split"] = ours_triton_split
    if fixed_iterations is not None:
        methods["ours_fixed"] = ours_fixed
        if compile_mode is not None:
            methods["ours_compiled"] = ours_compiled
    if window:
        methods["ours_window"] = ours_window
        if triton:
            methods["ours_window_triton"] = ours_window_triton
    methods.update(paper=paper, unrolled=unrolled)
    if sparse:
        methods["sparse"] = sparse_op
        if triton:
            methods["sparse_triton"] = sparse_triton
    methods["topk"] = topk
    outputs = {}
    for name, fn in methods.items():
        if name.startswith("ours_window") and (not sorted_op or cost != "linear"):
            rows.append(dict(method=name, seconds=None, best=None, mbytes=None, err=None,
                             note="skipped: the sorted operator with the linear cost only"))
            continue
        if name in ("ours_triton", "ours_triton_rows", "ours_triton_split", "sparse_triton", "ours_window_triton") and \
                triton_skip_reason(device):
            rows.append(dict(method=name, seconds=None, best=None, mbytes=None, err=None,
                             note=triton_skip_reason(device)))
            continue
        if name in ("paper", "unrolled") and (cost != "paper" or batch != 1):
            rows.append(dict(method=name, seconds=None, best=None, mbytes=None, err=None,
                             note="skipped: one row of the paper's cost only"))
            continue
        if name == "unrolled" and n * (k + 1) > UNROLLED_MAX_ELEMENTS:
            rows.append(dict(method=name, seconds=None, best=None, mbytes=None, err=None, note="skipped: memory"))
            continue
        if name == "ours_compiled":  # compilation (seconds to minutes) is not part of any call's time
            out = fn()
            out.backward(torch.ones_like(out))
            x.grad = None
        seconds, best, nbytes, outputs[name] = _time(fn, x, repeats, device)
        err = info_box.get(name)
        note = ""
        if name in ("ours", "ours_fixed", "ours_triton", "ours_triton_rows", "ours_triton_split"):
            note = f"{int(err.n_iter)} it" + ("" if bool(err.converged) else " NOT CONVERGED")
            if name == "ours_triton_rows":
                note += "; one program a row"
            elif name == "ours_triton_split":
                note += "; split kernels"
            elif name == "ours_triton" and split_rows:
                note += "; split kernels"
            err = float(err.marginal_error)
        elif name in ("sparse", "sparse_triton"):
            selected = outputs[name].detach()
            support = float((selected.sum(-1) if sorted_op else selected).gt(0).sum(-1).double().mean())
            note = f"support {support:.1f} of {n}"
            if err is not None:
                note = f"{int(err.n_iter)} it" + ("" if bool(err.converged) else " NOT CONVERGED") + "; " + note
                err = float(err.marginal_error)
            else:
                k_err = (selected.double().sum(-1) - k).abs().max() / k
                err = float(k_err)
        elif name.startswith("ours_window"):
            note = window_note(x.detach(), k, eps, tol, outputs[name].shape[1], err)
            err = float(err.marginal_error)
        elif name == "ours_compiled":
            err = float((outputs[name].detach() - outputs["ours_fixed"].detach()).abs().max())
            note = f"mode {compile_mode}; err = max difference from ours_fixed"
        rows.append(dict(method=name, seconds=seconds, best=best, mbytes=nbytes / 2 ** 20, err=err, note=note))
    return rows


def window_note(scores: torch.Tensor, k: int, eps: float, tol: float, width: int, info) -> str:
    """The window rows' note: iterations, W, the candidates each row needs (at or above the certificate's floor,
    :func:`~fairseq_softtopk.ops.candidate_window`'s) and the rows the window does not cover (``info.overflow``)."""
    rows, n = scores.shape
    top = scores.topk(k + 1, dim=-1).values
    need = (scores >= candidate_window(top[:, k:k + 1], k, eps, tol, n_out=n)).sum(-1).double()
    overflow = int(info.n_overflow)
    note = (f"{int(info.n_iter)} it" + ("" if bool(info.converged) else " NOT CONVERGED")
            + f"; W={width} of {n}; rows need {float(need.median()):.0f} median, {int(need.max())} max; ")
    if overflow:
        return note + f"OVERFLOW {overflow} of {rows} rows (their plan is the W best's alone)"
    return note + f"overflow 0 of {rows} rows"


def triton_skip_reason(device: str) -> str:
    """Why ``ours_triton`` is not timed on ``device`` (``""``: it is)."""
    if not device.startswith("cuda"):
        return "skipped: CUDA only (on the CPU the kernels run under Triton's interpreter)"
    if not triton_available():
        return "skipped: triton is not installed"
    return ""


def warm_up(ops: List[str], k: int, eps: float, tol: float, device: str, cost: str, batch: int,
            fixed_iterations: Optional[int] = None, triton: bool = False, window: bool = False) -> None:
    """Runs every method once on a small case, untimed, before the first measurement.

    The first call on a device initialises it and loads its libraries (CUDA, cuBLAS, cuSOLVER:
    seconds), and the first call of each method pays its own one-time costs; :func:`_time`'s
    per-case warm-up run does not cover them where a first run over 2 s counts as the measurement.
    """
    for op in ops:
        bench_case(1000, k, eps, op.startswith("sorted"), 1, tol, device, cost=cost, batch=min(batch, 2),
                   fixed_iterations=fixed_iterations, triton=triton, window=window)


def format_rows(case: str, rows: List[dict]) -> List[str]:
    by = {r["method"]: r for r in rows}
    lines = []
    for r in rows:
        if r["seconds"] is None:
            lines.append(f"| {case} | {r['method']} | - | - | - | - | - | - | {r['note']} |")
            continue
        paper_seconds = by["paper"]["seconds"]
        ratio_paper = paper_seconds / r["seconds"] if r["method"].startswith("ours") and paper_seconds else None
        vs_topk = r["seconds"] / by["topk"]["seconds"]
        best_vs_topk = r["best"] / by["topk"]["best"]
        err = "-" if r["err"] is None else f"{r['err']:.1e}"
        speed = f"{ratio_paper:.1f}x faster" if ratio_paper else ""
        lines.append(f"| {case} | {r['method']} | {r['seconds'] * 1e3:.2f} | {vs_topk:.1f} | {r['best'] * 1e3:.2f} | "
                     f"{best_vs_topk:.1f} | {r['mbytes']:.2f} | {err} | {' '.join(s for s in (speed, r['note']) if s)} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[1000, 10000, 100000, 1000000])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 5, 10])
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-1, 1e-2, 1e-3])
    parser.add_argument("--ops", nargs="+", default=["soft_topk", "sorted_soft_topk"],
                        choices=["soft_topk", "sorted_soft_topk"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tol", type=float, default=1e-4, help="our solver's marginal tolerance")
    parser.add_argument("--cost", choices=["paper", "linear"], default="paper",
                        help="cost of our operator (linear: the library's default; the published algorithm and "
                             "the unrolled iterations are then skipped)")
    parser.add_argument("--batch", type=int, default=1, help="rows of scores per call (ours and topk only above 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fixed-iterations", type=int, default=None, metavar="N",
                        help="also time ours with fixed_iterations=True, max_iter=N (the sync-free solve)")
    parser.add_argument("--sparse", action="store_true",
                        help="also time the sparse operators (quadratic regularisation = --eps; needs --cost linear)")
    parser.add_argument("--triton", action="store_true",
                        help="also time the operators with backend='triton' (the fused kernels; CUDA only, the rows "
                             "say skipped elsewhere)")
    parser.add_argument("--window", action="store_true",
                        help="also time sorted_soft_topk_window, the static window of each row's W best candidates "
                             "(needs --cost linear; sorted operator only; with --triton also on the kernels)")
    parser.add_argument("--window-width", type=int, default=None, metavar="W",
                        help="the window's width (needs --window; default: default_window_width's for n, k, eps)")
    parser.add_argument("--scores", nargs="+", choices=SCORE_DISTRIBUTIONS, default=["normal"],
                        help="score distributions, each its own cases: normal (standard normal) or logprobs "
                             f"(log_softmax of {LOGPROB_SCALE:g} x standard normal: peaked like a decoder's)")
    parser.add_argument("--compile", default=None, metavar="MODE",
                        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
                        help="also time the fixed-iteration call under torch.compile(fullgraph=True, mode=MODE) "
                             "(needs --fixed-iterations; reduce-overhead: CUDA graphs on a GPU)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compile is not None and args.fixed_iterations is None:
        parser.error("--compile needs --fixed-iterations N (only the fixed-iteration solve compiles as one graph)")
    if args.sparse and args.cost != "linear":
        parser.error("--sparse needs --cost linear (the sparse operators' regularisation is in the scores' units)")
    if args.window and args.cost != "linear":
        parser.error("--window needs --cost linear (the static window solves the linear cost)")
    if args.window_width is not None and not args.window:
        parser.error("--window-width needs --window")
    if args.window_width is not None and args.window_width < max(args.k):
        parser.error(f"--window-width must be >= the largest --k ({max(args.k)}), got {args.window_width}")
    if args.fixed_iterations is not None and args.fixed_iterations < 1:
        parser.error(f"--fixed-iterations must be >= 1, got {args.fixed_iterations}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# command: python {' '.join(sys.argv)}")
    print(f"# torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}")
    print("# time = forward+backward ms, median and minimum over the runs (at least --repeats, fast methods "
          f"until {MIN_TIMED_SECONDS} s are timed); vs topk = time / torch.topk time (median / minimum); "
          "mem = autograd MB; err = marginal error reached; x faster = paper median / ours median")
    warm_up(args.ops, min(args.k), args.eps[0], args.tol, args.device, args.cost, args.batch, args.fixed_iterations,
            args.triton, args.window)
    print("| case | method | median ms | vs topk | min ms | vs topk (min) | mem MB | err | notes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op in args.ops:
        for n in args.n:
            for k in args.k:
                for eps in args.eps:
                    for scores in args.scores:
                        case = f"{'sorted' if op.startswith('sorted') else 'topk'} n={n:.0e} k={k} eps={eps:g}"
                        if args.cost != "paper" or args.batch != 1:
                            case += f" {args.cost} batch={args.batch}"
                        if scores != "normal":
                            case += f" {scores}"
                        rows = bench_case(n, k, eps, op.startswith("sorted"), args.repeats, args.tol, args.device,
                                          cost=args.cost, batch=args.batch, fixed_iterations=args.fixed_iterations,
                                          compile_mode=args.compile, sparse=args.sparse, triton=args.triton,
                                          window=args.window, window_width=args.window_width, scores=scores)
                        print("\n".join(format_rows(case, rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
