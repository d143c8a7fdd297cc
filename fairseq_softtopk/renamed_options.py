"""Options renamed so that every option of one component shares its prefix (``--topk-*`` for the
selection of the criterion, ``--attention-*`` for the attention of the models).

The old names stay as deprecated aliases: fields of the same config whose default ``None`` means
"not given". A command (or a config, or a checkpoint's saved arguments) that uses an old name
keeps working and is told, with a ``FutureWarning`` (shown by default, unlike
``DeprecationWarning``), which name to use instead.
"""

import warnings
from typing import Any, Dict, Optional, Sequence

from .option_error import OptionError

#: old field name -> new field name
RENAMED_OPTIONS: Dict[str, str] = {
    "candidate_pool": "topk_candidate_pool",
    "selection_grad": "topk_grad",
    "selection_grad_cap": "topk_grad_cap",
    "topk_self_attention": "attention_normalize_self_attention",
}


def flag(name: str) -> str:
    """``topk_grad`` -> ``--topk-grad``."""
    return "--" + name.replace("_", "-")


def alias_metadata(old: str) -> Dict[str, Any]:
    """The dataclass metadata of the deprecated field ``old``."""
    return {"help": f"deprecated alias of {flag(RENAMED_OPTIONS[old])}", "deprecated": True}


def use_renamed(old: str, old_value: Any, new_value: Any, new_default: Any,
                choices: Optional[Sequence[str]] = None) -> Any:
    """The value of the renamed option: ``new_value``, or ``old_value`` (with a warning) where the
    old name was given (not None).

    Raises:
        ValueError: both names given with different values, or an old value outside ``choices``.
    """
    if old_value is None:
        return new_value
    new = RENAMED_OPTIONS[old]
    warnings.warn(f"{flag(old)} is deprecated and will be removed; use {flag(new)} (same meaning)",
                  FutureWarning, stacklevel=3)
    if choices is not None and str(old_value) not in choices:
        raise OptionError(f"{flag(old)} (deprecated alias of {flag(new)}) must be one of {list(choices)}, "
                         f"got {old_value!r}")
    if new_value != new_default and str(new_value) != str(old_value):
        raise OptionError(f"{flag(old)} {old_value} and {flag(new)} {new_value} disagree; {flag(old)} is the "
                         f"deprecated name of {flag(new)}: give only {flag(new)}")
    return type(new_default)(old_value) if not isinstance(new_default, str) else str(old_value)
