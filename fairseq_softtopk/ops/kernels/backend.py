"""Which implementation runs an operator: the torch path or a Triton kernel.

``"auto"`` (the operators' default) takes the kernels for CUDA tensors when ``triton`` imports, the torch
path otherwise (never the interpreter): CPU tensors keep the torch path and its speed. ``"torch"`` is the
pure-torch path everywhere. ``"triton"`` asks for the fused kernels: CUDA tensors, or CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported; it runs the kernels in
Python: for tests, far too slow for work).

A call the kernels cannot take (see :data:`FALLBACK_REASONS`) runs on the torch path instead, counted in
:func:`fallback_counts`; where ``"triton"`` was asked for by name, a :class:`KernelFallbackWarning` reports
it too (once per call site).
"""

import collections
import importlib
import os
import warnings
from typing import Dict, Optional

import torch
from torch import Tensor

BACKENDS = ("torch", "triton", "auto")

#: why a call that asked for the kernels ran on the torch path (keys of :func:`fallback_counts`)
FALLBACK_REASONS = {
    "row_length": "rows longer than the kernels' int32 offsets reach",
    "no_kernel": "this operator has no Triton kernel yet",
    "rank_count": "more ranks than the kernels hold in registers (the sorted operators: k <= 31)",
}

_fallbacks: Dict[str, int] = collections.Counter()
_triton_import_error: Optional[str] = None  # None: not tried yet; "": imported
_TRUE = ("1", "true", "on", "yes")


class KernelFallbackWarning(UserWarning):
    """A call asked for the Triton kernels and ran on the torch path (same results, the torch path's speed)."""


def check_backend(backend: str) -> None:
    """Raises ``ValueError`` unless ``backend`` is one of :data:`BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter now (the kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def triton_import_error() -> str:
    """Why ``import triton`` fails here (``""``: it imports); tried once, then remembered."""
    global _triton_import_error
    if _triton_import_error is None:
        try:
            importlib.import_module("triton")
            _triton_import_error = ""
        except Exception as error:  # not installed (ImportError), or a build that does not load here
            _triton_import_error = f"{type(error).__name__}: {error}"
    return _triton_import_error


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """Whether the ``triton`` package imports (to ``torch.compile``, a constant: the first operator call of a
    process may sit inside a compiled region, where the import could not be traced)."""
    return triton_import_error() == ""


def resolve_backend(backend: str, tensor: Tensor) -> str:
    """``"torch"`` or ``"triton"``: the implementation that runs ``backend`` on ``tensor``'s device.

    Args:
        backend: one of :data:`BACKENDS`.
        tensor: the operator's input (its device decides).
    Returns:
        ``"triton"`` for ``"triton"``, and for ``"auto"`` on a CUDA tensor when ``triton`` imports;
        ``"torch"`` otherwise.
    Raises:
        ValueError: an unknown ``backend``; ``"triton"`` where ``triton`` does not import, or on a tensor
        that is neither on CUDA nor under the interpreter.
    """
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if tensor.is_cuda and triton_available() else "torch"
    if not triton_available():
        raise ValueError(f"backend='triton' needs the triton package (pip install triton), which does not import "
                         f"here ({triton_import_error()}); backend='torch' or 'auto' run without it")
    if not (tensor.is_cuda or interpreter_requested()):
        raise ValueError(f"backend='triton' runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got a "
                         f"tensor on {tensor.device}; backend='auto' picks the torch path there")
    return "triton"


def record_fallback(reason: str, operator: str, warn: bool = True) -> None:
    """Counts a call that ran on the torch path instead of the kernels, and (``warn``) warns once per call site."""
    _fallbacks[reason] += 1
    if warn:
        warnings.warn(f"{operator}: the Triton kernels cannot take this call ({FALLBACK_REASONS[reason]}); it ran "
                      f"on the torch path (same results)", KernelFallbackWarning, stacklevel=4)


def torch_path_only(backend: str, tensor: Tensor, operator: str) -> None:
    """The dispatch point of an operator that has no kernel yet: checks ``backend`` and, where it resolves to
    the kernels, counts the call under ``"no_kernel"`` (warning only where ``"triton"`` was asked for by name).

    Raises:
        ValueError: as :func:`resolve_backend`.
    """
    if backend != "torch" and resolve_backend(backend, tensor) == "triton":
        record_fallback("no_kernel", operator, warn=backend == "triton")


def fallback_counts() -> Dict[str, int]:
    """Calls that asked for the kernels and ran on the torch path, by reason (see :data:`FALLBACK_REASONS`)."""
    return dict(_fallbacks)


def reset_fallback_counts() -> None:
    """Sets every count of :func:`fallback_counts` back to 0."""
    _fallbacks.clear()
