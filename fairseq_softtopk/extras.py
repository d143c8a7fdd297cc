"""Which optional packages each part of the package needs, and the errors that say how to install them.

``pip install fairseq-softtopk`` brings torch and numpy only: the operators (:mod:`fairseq_softtopk.ops`), the
search (:mod:`fairseq_softtopk.search`) and :mod:`fairseq_softtopk.modules`. The fairseq plugin (the criterions,
the models, ``--user-dir``) needs fairseq's fork, installed without its declared dependencies (they name
torchaudio, which would pull a second torch), and the ``[fairseq]`` extra, which lists what the fork imports::

    pip install ve-fairseq==0.12.3 --no-deps
    pip install "fairseq-softtopk[fairseq]"

The experiments and their commands need the ``[experiments]`` extra on top (it includes ``[fairseq]``).
Nothing here imports the packages it checks: ``importlib.util.find_spec`` looks them up.
"""

import importlib.util
from typing import Dict, List, Sequence, Tuple

#: fairseq's fork (PyPI's fairseq 0.12.2 does not import on Python >= 3.11), installed apart from the extra
FAIRSEQ_FORK_INSTALL = "pip install ve-fairseq==0.12.3 --no-deps"

#: The modules that each extra makes importable (import names, not distribution names): the ones checked
#: before a part that needs the extra runs. "fairseq" stands for the fork, which the extra itself cannot bring.
EXTRA_MODULES: Dict[str, Tuple[str, ...]] = {
    "fairseq": ("fairseq", "hydra", "omegaconf", "bitarray", "regex", "sacrebleu", "sklearn", "tqdm", "packaging"),
}
EXTRA_MODULES["experiments"] = EXTRA_MODULES["fairseq"] + (
    "matplotlib", "sacremoses", "sentencepiece", "subword_nmt", "scipy", "yaml")


class MissingExtraError(ImportError):
    """A part of the package was used without the optional packages it needs; the message names the install."""


def missing_modules(names: Sequence[str]) -> List[str]:
    """The names among ``names`` (top-level modules) that cannot be imported here, in their order.

    A finder that raises ImportError (a module hidden on purpose) counts as missing."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def install_commands(extra: str, missing: Sequence[str]) -> str:
    """The commands that install ``extra`` (one of :data:`EXTRA_MODULES`), the fork first where ``missing`` has it."""
    extra_command = f'pip install "fairseq-softtopk[{extra}]"'
    return f"{FAIRSEQ_FORK_INSTALL} and {extra_command}" if "fairseq" in missing else extra_command


def require_extra(extra: str, what: str) -> None:
    """Raises :class:`MissingExtraError` (an ImportError) naming ``what`` (the part used), the missing modules
    and the install commands, where a module of the ``extra`` (see :data:`EXTRA_MODULES`) is not installed.

    Raises ValueError for an ``extra`` that is not one of :data:`EXTRA_MODULES`."""
    if extra not in EXTRA_MODULES:
        raise ValueError(f"unknown extra {extra!r}; known: {sorted(EXTRA_MODULES)}")
    missing = missing_modules(EXTRA_MODULES[extra])
    if missing:
        needs = "fairseq (the [fairseq] extra)" if extra == "fairseq" else f"the [{extra}] extra"
        raise MissingExtraError(f"{what} needs {needs}; not installed: {', '.join(missing)}. "
                                f"Install with: {install_commands(extra, missing)}")


def require_fairseq(what: str = "the fairseq plugin of fairseq_softtopk") -> None:
    """:func:`require_extra` for the ``fairseq`` extra: fairseq's fork and what it imports."""
    require_extra("fairseq", what)


def exit_unless_installed(parser, extra: str) -> None:
    """For a command: exits with status 1 and one line (``PROG: error: ...``) where ``extra`` is not installed.

    Args:
        parser: the command's ``argparse.ArgumentParser`` (its ``prog`` names the command).
        extra: the extra the command needs (a key of :data:`EXTRA_MODULES`).
    """
    try:
        require_extra(extra, "this command")
    except MissingExtraError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
