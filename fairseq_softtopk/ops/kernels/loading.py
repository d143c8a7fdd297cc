"""Loading a kernels file (``*_triton.py``) on first use, and the device check every launcher makes.

The kernel files import ``triton``; the op modules load them only when a kernel first launches, so that
importing the package needs torch only.
"""

import importlib.util
import os
from pathlib import Path
from types import ModuleType

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
