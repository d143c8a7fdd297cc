"""SIGUSR1 to fairseq-train: save ``checkpoint_last.pt`` after the update in progress, and train on.

fairseq-train saves only at its intervals (``--save-interval-updates``, epochs), so a run stopped between
two saves redoes everything after the last one. A job scheduler can warn a job before its time runs out
(Slurm: ``--signal=USR1@300``), and a user can save before stopping a machine: with this plugin loaded
(``--user-dir``), ``kill -USR1 <fairseq-train pid>`` makes fairseq-train write ``checkpoint_last.pt`` at the
end of the current update, then go on; ``fairseq-softtopk-ablation`` forwards its own SIGUSR1 to the
fairseq-train processes it runs (:mod:`.experiments.child_processes`).

The save is fairseq's own (``checkpoint_utils.save_checkpoint``) without a validation score: it writes
``checkpoint_last.pt`` only (no ``checkpoint_best.pt``, no interval checkpoint, the best score kept), so
the checkpoint chosen by validation and the validation schedule are the run's as before. fairseq reseeds
every update from the seed and the update number and the checkpoint keeps the data iterator's place, so a
run resumed from such a save ends with the weights, to the bit, of the run never stopped (tested).

Single-process training only: with several processes (data parallel) the request is logged and ignored,
since the processes would have to agree on the update at which to save.
"""

import logging
import os
import signal
import sys
import threading
from types import ModuleType
from typing import Optional

logger = logging.getLogger(__name__)

#: the signal that asks for a save (the runners pass it on: experiments.child_processes)
SAVE_SIGNAL = signal.SIGUSR1
TRAIN_MODULE = "fairseq_cli.train"
_TRAIN_SCRIPTS = ("fairseq-train", "fairseq-hydra-train")

_requested = False


def _request_save(signum, frame) -> None:
    global _requested
    _requested = True  # acted on between updates: a signal handler must not touch the model mid-update


def _running_train_module() -> Optional[ModuleType]:
    """The module of fairseq-train's training loop when this process is fairseq-train (``python -m
    fairseq_cli.train`` runs it as ``__main__``; the console scripts import it), else None."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == TRAIN_MODULE:
        return main
    if os.path.basename(sys.argv[0] if sys.argv else "") in _TRAIN_SCRIPTS:
        return sys.modules.get(TRAIN_MODULE)
    return None


def install() -> bool:
    """In fairseq-train (and nowhere else), makes :data:`SAVE_SIGNAL` save a checkpoint after the update in
    progress (see the module). Idempotent; returns whether it is installed. Called when fairseq imports the
    plugin (``--user-dir``), which it does from its main thread before training starts."""
    module = _running_train_module()
    if module is None or not hasattr(module, "validate_and_save"):
        return False
    if getattr(module.validate_and_save, "_saves_on_signal", False):
        return True
    if threading.current_thread() is not threading.main_thread():
        return False  # signal handlers can only be set from the main thread
    original = module.validate_and_save

    def validate_and_save(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch):
        global _requested
        if _requested:
            _requested = False
            _save_now(cfg, trainer, epoch_itr)
        return original(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch)

    validate_and_save._saves_on_signal = True
    module.validate_and_save = validate_and_save
    signal.signal(SAVE_SIGNAL, _request_save)
    return True


def _save_now(cfg, trainer, epoch_itr) -> None:
    """``checkpoint_last.pt`` at the update just made, without a validation score (before fairseq's own
    validation and save at this update, which, where due, run as they would have)."""
    from fairseq import checkpoint_utils

    updates = trainer.get_num_updates()
    if cfg.checkpoint.no_save or cfg.checkpoint.no_last_checkpoints:
        logger.warning("%s at update %d ignored: --no-save or --no-last-checkpoints", SAVE_SIGNAL.name, updates)
        return
    if trainer.data_parallel_world_size > 1:
        logger.warning("%s at update %d ignored: saving on a signal needs single-process training",
                       SAVE_SIGNAL.name, updates)
        return
    logger.info("%s: saving checkpoint_last.pt at update %d, then training on", SAVE_SIGNAL.name, updates)
    checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
