"""fairseq-softtopk: differentiable top-k (SOFT top-k, Xie et al., NeurIPS 2020) for fairseq.

``fairseq-train --user-dir fairseq_softtopk`` imports this package after fairseq, and that
import registers the package's models and criterions and lets fairseq's checkpoints load
under torch's weights-only unpickler. The operator library :mod:`fairseq_softtopk.ops` is
pure PyTorch: importing it alone does not import fairseq (call :func:`register` to register
the fairseq components from a script that imports this package before fairseq). The fairseq parts need
fairseq's fork and the ``[fairseq]`` extra, and say so when either is missing (:mod:`.extras`).
"""

import sys

# The one place the version is written: pyproject.toml reads it; CITATION.cff and CHANGELOG.md agree
# (tests/test_citation.py).
__version__ = "0.1.0"


def register() -> None:
    """Registers the models and criterions with fairseq, allowlists checkpoint globals and makes a
    refused, damaged or missing checkpoint a plain error (:mod:`.checkpoint_safety`); in fairseq-train, SIGUSR1
    then saves a checkpoint and training goes on (:mod:`.checkpoint_on_signal`); a run resumed in a later epoch
    gets the training batches of the run never stopped (:mod:`.resumed_batches`); in fairseq's commands a bad
    option value is reported in one line (:mod:`.option_error`). Raises RuntimeError
    under a torch older than 2.6, whose ``torch.load`` is not weights-only by default; warns (once per
    process) when ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns weights-only loading off. Raises ImportError
    (:class:`.extras.MissingExtraError`) naming the install commands where fairseq or a package it imports is
    missing."""
    from .extras import require_fairseq

    require_fairseq("fairseq_softtopk.register() (the fairseq plugin)")
    from .checkpoint_safety import (allow_fairseq_checkpoint_globals, guard_checkpoint_loading,
                                    require_weights_only_torch, warn_if_unsafe_loading_forced)

    require_weights_only_torch()
    warn_if_unsafe_loading_forced()
    allow_fairseq_checkpoint_globals()
    guard_checkpoint_loading()
    from . import criterions, models  # noqa: F401  (importing registers the components)
    from .checkpoint_on_signal import install as save_checkpoint_on_signal
    from .resumed_batches import install as resumed_runs_get_the_same_batches

    resumed_runs_get_the_same_batches()  # a run resumed in a later epoch gets the batches of one never stopped

    save_checkpoint_on_signal()  # in fairseq-train only: SIGUSR1 saves checkpoint_last.pt and training goes on
    from .option_error import install_one_line_report

    install_one_line_report()  # in fairseq's commands only: a bad option value is one line, not a traceback


if sys.modules.get("fairseq") is not None:  # loaded as fairseq's --user-dir (or after `import fairseq`)
    register()
