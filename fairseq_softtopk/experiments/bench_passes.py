"""The measuring passes of the training benchmark (``scripts/bench/bench_train.py``) besides its timed one.

:func:`profiled_shares`: the updates again under ``torch.profiler``, the time inside the package's named ranges;
:func:`count_dispatches`: the forward and backward passes under
:class:`~fairseq_softtopk.dispatch_count.DispatchCounter`, launches and host syncs per decoding step by part of
the step; :func:`compile_and_count_kernels`: the kernels inductor writes for a compiled solve.
"""

import re
from typing import Dict, List

import torch

from ..dispatch_count import DispatchCounter
from ..ops.kernels import fallback_counts, reset_fallback_counts
from .bench_harness import count_cuda_syncs, cuda_launches, range_seconds, timed_updates

#: a kernel call in the code inductor writes: C++ (CPU) or Triton (CUDA) kernels, library calls, ATen fallbacks
KERNEL_CALL = re.compile(r"^\s+(?:\w+ = )?(?:cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|aten\.\w+(?:\.\w+)?|"
                         r"torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.M)
#: table column -> the package's named profiler range it reads
RANGE_KEYS = {"topk_fwd": ("softtopk::sorted_soft_topk", "softtopk::sorted_sparse_soft_topk"),
              "topk_bwd": ("softtopk::sorted_soft_topk_backward", "softtopk::sorted_sparse_soft_topk_backward"),
              "select": ("softtopk::select_beams",), "mix": ("softtopk::mix_beams",)}
#: innermost named range -> part of a decoding step in the launch table (others: their own name); the static
#: window's own work (its top-W and certificate) is the selection's, its solve (sorted_soft_topk inside) the solve
COUNT_PARTS = {"beam_step": "step", "select_beams": "select", "sorted_soft_topk_window": "select",
               "sorted_soft_topk": "solve", "mix_beams": "mix",
               "sorted_sparse_soft_topk": "solve", "sorted_sparse_soft_topk_backward": "solve bwd",
               "sorted_soft_topk_backward": "solve bwd", "backward": "other bwd", "other": "per batch"}


def profiled_shares(model, criterion, batches: List[dict], warmup: int, device: str) -> Dict[str, float]:
    """Seconds of the timed updates of ``batches`` under ``torch.profiler`` and inside each named range
    (and, on CUDA, the kernel launches the runtime recorded per decoding step)."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    timed_updates(model, criterion, batches[:warmup], 0, device, optimizer=optimizer)
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        records = timed_updates(model, criterion, batches[warmup:], 0, device, optimizer=optimizer)
    ranges = range_seconds(prof.events(), [name for names in RANGE_KEYS.values() for name in names])
    shares = {"profiled_seconds": sum(r["seconds"] for r in records),
              **{key: sum(ranges[name] for name in names) for key, names in RANGE_KEYS.items()}}
    if cuda:
        steps = sum(sample["target"].shape[1] for sample in batches[warmup:])
        shares["cuda_launches_per_step"] = cuda_launches(prof.events()) / steps
    return shares


def count_dispatches(model, criterion, batches: List[dict]) -> dict:
    """Launches and syncs of the forward and backward passes over ``batches`` (``scripts/bench/bench_train.py``'s docstring), per
    decoding step (``target.shape[1]`` per batch): ``{"launches": {part: n}, "syncs_step", "syncs_batch",
    "cuda_syncs_step", "fallbacks": {reason: n}}``; ``cuda_syncs_step`` (None off CUDA): every host sync CUDA
    reports in a second run of the passes (:func:`~fairseq_softtopk.experiments.bench_harness.count_cuda_syncs`);
    ``fallbacks``: the operator calls that asked for the Triton kernels and ran on the torch path, by reason."""
    model.train()

    def forward_backward():
        for sample in batches:
            model.zero_grad(set_to_none=True)
            loss, _, _ = criterion(model, sample)
            loss.backward()

    reset_fallback_counts()
    # a compiled solve runs eagerly here (dynamo cannot trace under a dispatch mode; see compile_and_count_kernels)
    with torch.compiler.set_stance("force_eager"), DispatchCounter() as counter:
        forward_backward()
    steps = sum(sample["target"].shape[1] for sample in batches)
    fallbacks = {reason: n / steps for reason, n in fallback_counts().items() if n}
    cuda_syncs = None
    if next(model.parameters()).is_cuda:  # every sync CUDA reports, the same passes without the counter
        cuda_syncs = count_cuda_syncs(forward_backward) / steps
    launches: Dict[str, float] = {}
    for part, n in counter.by_innermost("launches").items():
        name = COUNT_PARTS.get(part, part)
        launches[name] = launches.get(name, 0.0) + n / steps
    in_step = counter.total("syncs", inside="beam_step")
    in_backward = sum(n for path, n in counter.counts["syncs"].items()
                      if path == ("backward",) or path[-1].endswith("_backward"))
    return {"launches": launches, "syncs_step": (in_step + in_backward) / steps,
            "syncs_batch": (counter.total("syncs") - in_step - in_backward) / len(batches),
            "cuda_syncs_step": cuda_syncs, "fallbacks": fallbacks}


def kernel_calls(code: str) -> int:
    """The kernel calls in one module of code that inductor wrote (:data:`KERNEL_CALL`, in its ``call``)."""
    start = code.find("def call(")
    if start < 0:
        return 0
    end = code.find("\ndef ", start + 1)
    return len(KERNEL_CALL.findall(code[start: end if end > 0 else len(code)]))


def compile_and_count_kernels(model, criterion, sample: dict) -> Dict[str, float]:
    """One untimed forward and backward of ``sample`` that compiles the solve of ``beam_soft_compiled``
    before the timed updates, returning the kernels inductor generated: ``{"solve": forward, "solve bwd":
    backward}`` (the first and the second graph compiled; each step runs both once)."""
    from torch._inductor.utils import run_and_get_code

    def forward_backward():
        model.zero_grad(set_to_none=True)
        criterion(model, sample)[0].backward()

    model.train()
    _, codes = run_and_get_code(forward_backward)
    if len(codes) < 2:
        raise RuntimeError(f"expected the solve's forward and backward graphs to compile, got {len(codes)}")
    return {"solve": float(kernel_calls(codes[0])), "solve bwd": float(kernel_calls(codes[1]))}
