"""Loading a kernels file (``*_triton.py``) on first use, the device check every launcher makes, and the
launch itself (:func:`launch`, seen by :class:`~fairseq_softtopk.dispatch_count.DispatchCounter`).

The kernel files import ``triton``; the op modules load them only when a kernel first launches, so that
importing the package needs torch only.
"""

import contextlib
import importlib.util
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, List

from torch import Tensor


def load_kernels(path: Path, name: str, probe: str) -> ModuleType:
    """The kernels module at ``path``, imported as ``name``, with ``INTERPRETED`` set (Triton's interpreter or not).

    Triton fixes, at ``import triton``, whether its kernels are compiled for GPUs or run by its interpreter
    (``TRITON_INTERPRET=1``), and a kernel defined in the other mode cannot call its library: a mismatch (the
    variable set or cleared after triton was imported), seen on the kernel ``probe``, raises here rather than
    inside a launch.

    Raises:
        RuntimeError: the kernels and triton's own library were defined in different modes.
    """
    import triton.language as tl

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if type(getattr(module, probe)) is not type(tl.sum):
        raise RuntimeError(f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} now, but triton was imported "
                           f"with the other setting: set it before anything imports triton (torch.compile does)")
    module.INTERPRETED = type(tl.sum).__name__ == "InterpretedFunction"
    return module


def check_device(module: ModuleType, t: Tensor) -> None:
    """Raises ``ValueError`` unless the kernels of ``module`` can run on ``t``'s device (CUDA, or the interpreter)."""
    if not (t.is_cuda or module.INTERPRETED):
        raise ValueError(f"the Triton kernels run on CUDA tensors (or on CPU tensors with TRITON_INTERPRET=1 set "
                         f"before triton is imported), got a tensor on {t.device}")


_launch_watchers: List[Callable[[str], None]] = []
_running = threading.local()


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: one kernel launch, reported to the watchers (:func:`watching_launches`).

    Under Triton's interpreter the kernel's own work runs as torch operations on the host (copies of its
    arguments); :func:`kernel_running` says so while it runs, so that a counter does not take them for launches.
    """
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "triton_kernel")
    for watcher in list(_launch_watchers):
        watcher(name)
    _running.depth = getattr(_running, "depth", 0) + 1
    try:
        kernel[grid](*args, **kwargs)
    finally:
        _running.depth -= 1


def kernel_running() -> bool:
    """Whether a kernel launched by :func:`launch` is running in this thread (the interpreter's work, or a launch)."""
    return getattr(_running, "depth", 0) > 0


@contextlib.contextmanager
def watching_launches(watcher: Callable[[str], None]) -> Iterator[None]:
    """Calls ``watcher(kernel name)`` at every :func:`launch` inside the block."""
    _launch_watchers.append(watcher)
    try:
        yield
    finally:
        _launch_watchers.remove(watcher)
