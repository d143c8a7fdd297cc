"""Range checks of option values, shared by the criteria and the models of this package.

The criteria and models call these when fairseq builds them, before the first update, and the
ablation runner calls the same checks on every stage's parsed flags before anything trains. Each
error is a ``ValueError`` naming the flag as it is typed (``--topk-epsilon``), the value and the
allowed range.

Epsilon (``--topk-epsilon``, ``--topk-epsilon-start``, ``--attention-topk-epsilon``) is kept in
:data:`EPSILON_RANGE`. Below it the selection is the hard one already, and floating point is what
remains: the quadratic solve works in float64 on ``scores / epsilon`` and finds an empty support
once that ratio nears ``2**53`` (measured: ``--topk-epsilon 1e-20``, beam search then fails), the
entropic selection's exact gradient grows like ``1 / epsilon`` at near ties (measured: ``inf``
gradients with ``--topk-grad full`` at ``1e-15``), and float32 attention scores are rounded to
about ``1.2e-7`` of their size (a sparse top-k mask then sums to ``k - 1`` at ``1e-7``). The floor
leaves nine orders of magnitude to the first of these for score spreads up to thousands of nats.
Above the ceiling every candidate gets the same weight for any realistic scores (no selection),
and beyond float32's largest number (``3.4e38``) the solve fails.
"""

import importlib.util
from typing import Optional, Sequence

from .number_checks import is_finite_number, is_integer
from .option_error import OptionError
from .renamed_options import flag

__all__ = ["BACKEND_CHOICES", "EPSILON_RANGE", "check_backend_option", "check_bf16", "check_choice", "check_epsilon",
           "check_number", "requested_batch_size", "requested_bf16",
           "requested_cpu"]

#: the choices of --topk-backend and --attention-topk-backend (the operators' ``backend``)
BACKEND_CHOICES = ["auto", "torch", "triton"]

#: the allowed range of every epsilon (see the module docstring)
EPSILON_RANGE = (1e-6, 1e6)

BF16_REASON = ("fairseq trains in bfloat16 only on TPUs (--bf16 implies --tpu, which needs torch_xla); "
               "on a GPU use --fp16 or --amp")


def _range_text(low: Optional[float], high: Optional[float], low_open: bool, high_open: bool, integer: bool) -> str:
    """``"an integer >= 1"``, ``"a number in [0, 1)"``, ``"a finite number > 0"``, ..."""
    kind = "an integer" if integer else "a finite number" if low is None or high is None else "a number"
    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {high:g}"
    return kind


def check_number(name: str, value, low: Optional[float] = None, high: Optional[float] = None, *,
                 low_open: bool = False, high_open: bool = False, integer: bool = False, why: str = "") -> None:
    """Raises ``ValueError`` unless ``value`` is a finite number (an integer if ``integer``) in the range.

    Args:
        name: the option's field name (``topk_epsilon``; the message says ``--topk-epsilon``).
        low, high: the bounds (None: unbounded); ``low_open``/``high_open``: the bound itself is excluded.
        why: appended to the message in parentheses (what the range comes from).
    """
    ok = (is_integer(value) or not integer) and is_finite_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        reason = f" ({why})" if why else ""
        raise OptionError(f"{flag(name)} must be {_range_text(low, high, low_open, high_open, integer)}{reason}, "
                         f"got {value!r}")


def check_epsilon(name: str, value, allow_zero: str = "") -> None:
    """``value`` in :data:`EPSILON_RANGE`, or 0 where ``allow_zero`` says what 0 means (``"no schedule"``)."""
    if allow_zero and isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
        return
    low, high = EPSILON_RANGE
    try:
        check_number(name, value, low, high)
    except ValueError:
        zero = f"0 ({allow_zero}) or " if allow_zero else ""
        raise OptionError(f"{flag(name)} must be {zero}a number in [{low:g}, {high:g}] (smaller: a hard selection "
                         f"already, which floating point then breaks; larger: no selection), got {value!r}") from None


def check_choice(name: str, value, choices: Sequence[str]) -> None:
    """Raises ``ValueError`` unless ``str(value)`` is one of ``choices``."""
    if str(value) not in choices:
        raise OptionError(f"{flag(name)} must be one of {list(choices)}, got {value!r}")


def requested_bf16(cfg) -> bool:
    """Whether ``cfg`` (a namespace or a config with a ``bf16`` field, e.g. ``II("common.bf16")``) asks for
    bfloat16: False where the field is missing or an interpolation that cannot be resolved (a config built
    alone, as in tests)."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        value = getattr(cfg, "bf16", False)
    except InterpolationResolutionError:
        return False
    return value is True


def requested_cpu(cfg) -> bool:
    """Whether ``cfg`` (a namespace or a config with a ``cpu`` field, e.g. ``II("common.cpu")``) asks for fairseq's
    ``--cpu``: False where the field is missing or an interpolation that cannot be resolved."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        value = getattr(cfg, "cpu", False)
    except InterpolationResolutionError:
        return False
    return value is True


def requested_batch_size(cfg) -> Optional[int]:
    """fairseq's ``--batch-size`` (sentences a batch at most) where ``cfg`` has it (``II("dataset.batch_size")``),
    else None (not given, or an interpolation that cannot be resolved)."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        value = getattr(cfg, "batch_size", None)
    except InterpolationResolutionError:
        return None
    return value if is_integer(value) and value > 0 else None


def check_backend_option(name: str, value, cpu: bool) -> None:
    """Raises ``ValueError`` unless ``value`` is one of :data:`BACKEND_CHOICES` and can run here: ``triton``
    needs the training on a GPU (not ``--cpu``, and CUDA available) or Triton's interpreter
    (``TRITON_INTERPRET=1``, CPU tensors), and the ``triton`` package.

    Args:
        name: the option's field name (``topk_backend``; the message says ``--topk-backend``).
        cpu: whether fairseq's ``--cpu`` was given.
    """
    check_choice(name, value, BACKEND_CHOICES)
    if str(value) != "triton":
        return
    import torch

    from .ops.kernels.backend import interpreter_requested, triton_import_error

    interpreted = interpreter_requested()
    if (cpu or not torch.cuda.is_available()) and not interpreted:
        where = "--cpu was given" if cpu else "torch finds no CUDA device"
        raise OptionError(f"{flag(name)} triton runs the Triton kernels on a GPU (or under TRITON_INTERPRET=1, for "
                         f"tests), but {where}; use {flag(name)} auto or torch, got {str(value)!r}")
    error = triton_import_error()
    if error:
        raise OptionError(f"{flag(name)} triton needs the triton package (pip install triton), which does not import "
                         f"here ({error}); use {flag(name)} auto or torch, got {str(value)!r}")


def check_bf16(bf16: bool) -> None:
    """Refuses ``--bf16`` where torch_xla cannot be imported: fairseq 0.12's ``--bf16`` implies ``--tpu``, and
    its trainer then fails at start-up with an ``AttributeError`` on ``xla_device``."""
    if bf16 and importlib.util.find_spec("torch_xla") is None:
        raise OptionError(f"--bf16 (or --memory-efficient-bf16) is not available here: {BF16_REASON}")
