"""What counts as a number in an argument: Python's and numpy's integers and reals, never a bool.

Torch-free, so that the commands that check options before importing torch (``fairseq-softtopk-bleu``, the option
checks fairseq runs) and the operators share one definition.
"""

import math
import numbers

__all__ = ["is_finite_number", "is_integer", "is_positive_number", "is_real"]


def is_integer(value) -> bool:
    """An integer, Python's or numpy's (a bool is not one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number, Python's or numpy's (a bool is not one)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """A finite real number (Python's or numpy's), not a bool."""
    # comparisons, not math.isfinite: under torch.compile a float argument is a symbolic float, which
    # compares (NaN fails both) but which math.isfinite cannot trace
    return is_real(value) and -math.inf < value < math.inf


def is_positive_number(value) -> bool:
    """A finite real number > 0 (Python's or numpy's), not a bool: an epsilon, a regularisation, a tolerance."""
    return is_finite_number(value) and value > 0
