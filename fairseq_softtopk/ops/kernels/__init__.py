"""Fused Triton kernels for the operators (opt-in: ``backend="triton"`` or ``"auto"``; pure torch otherwise).

Importing this package needs torch only; ``triton`` is imported on the first kernel launch.
:func:`resolve_backend` says which implementation a ``backend`` argument runs; :func:`fallback_counts` how
many calls asked for the kernels and ran on the torch path, and why.
"""

from .backend import (BACKENDS, FALLBACK_REASONS, KernelFallbackWarning, fallback_counts, reset_fallback_counts,
                      resolve_backend, triton_available)

__all__ = [
    "BACKENDS",
    "FALLBACK_REASONS",
    "KernelFallbackWarning",
    "fallback_counts",
    "reset_fallback_counts",
    "resolve_backend",
    "triton_available",
]
