"""The memory of one decoding step's soft selection, bounded before it is asked for.

The sorted SOFT top-k of a step solves for a plan of ``beam + 1`` anchors over the step's candidates, in float64,
``(rows, beam + 1, m)``: ``m`` is the candidate window, which holds every one of the ``beam x V`` candidates where
the scores do not separate them (an untrained model's). Its solver's peak is 1.7-3.7 times that plan (measured on
the CPU for rows of 12,480 to 187,200 candidates, forward and backward: the larger, the lower), and the search keeps
the step's weights, ``(rows, m, beam)`` in the scores' dtype, for the backward pass. :func:`soft_selection_bytes`
is a lower bound on one step (1.7 times the plan, and the weights in float32; a search has a step per target
token); where it exceeds the memory the device has, the search cannot run, and the option check says so before
anything trains instead of the process being killed by the kernel's out-of-memory killer (or a CUDA out-of-memory
error) at the first update."""

import os
from typing import Optional

import torch

#: the solver's peak over its float64 plan, at least (measured 1.7-3.7)
SOLVER_PEAK_OVER_PLAN = 1.7


def soft_selection_bytes(rows: int, beam: int, vocab_size: int, candidate_pool: int = 0) -> int:
    """A lower bound on the bytes one decoding step's sorted soft top-k may take, its solve and the weights kept:
    ``rows`` sentences of ``beam`` beams over ``vocab_size`` types (``candidate_pool`` > 0: the solve sees that
    many candidates a sentence)."""
    candidates = beam * vocab_size
    if candidate_pool:
        candidates = min(candidates, candidate_pool)
    return int(SOLVER_PEAK_OVER_PLAN * 8 * rows * (beam + 1) * candidates + 4 * rows * candidates * beam)


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(device: Optional[torch.device] = None) -> Optional[int]:
    """The bytes a step may use on ``device``: a CUDA device's total memory; on the CPU the memory the system
    has available now (Linux's MemAvailable, else the free physical pages); None where it cannot be told."""
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    found = _meminfo_available()
    if found is None and hasattr(os, "sysconf"):
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return found


def gib(n_bytes: float) -> str:
    """``"31.2 GiB"``."""
    return f"{n_bytes / 2 ** 30:.1f} GiB"


def selection_memory_problem(rows: int, beam: int, vocab_size: int, candidate_pool: int,
                             device: Optional[torch.device] = None) -> Optional[str]:
    """Why a step of ``rows`` sentences cannot select its beams in the memory ``device`` has (the text an error
    gives after the flag), or None where it fits or the memory cannot be told."""
    need = soft_selection_bytes(rows, beam, vocab_size, candidate_pool)
    if need < 2 ** 28:  # 256 MiB: no need to look
        return None
    have = available_memory(device)
    if have is None or need <= have:
        return None
    candidates = min(beam * vocab_size, candidate_pool) if candidate_pool else beam * vocab_size
    return (f"needs at least {gib(need)} for one decoding step's soft selection of {rows} sentence"
            f"{'s' if rows != 1 else ''} (the sorted soft top-k's float64 plan of {beam + 1} anchors over "
            f"{candidates:,} candidates a sentence, all of them where the scores do not separate them, and the "
            f"weights kept for the backward pass), more than the {gib(have)} the "
            f"{torch.device(device or 'cpu').type.upper()} has available")
