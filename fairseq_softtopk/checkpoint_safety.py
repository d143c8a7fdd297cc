"""Lets fairseq load its own checkpoints with torch's safe (``weights_only=True``) unpickler.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``; fairseq checkpoints of
models configured through the legacy argparse path keep their model config as an
``argparse.Namespace``, which the safe unpickler refuses, so ``fairseq-generate`` and
``--restore-file`` fail. We allowlist exactly the globals that fairseq checkpoints carry
(found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on checkpoints written
by every model and criterion of this package) and nothing else: weights-only loading stays
on, and a checkpoint that pickles any other object is still refused.
"""

import argparse

import torch

#: The only non-tensor globals fairseq checkpoints were found to need.
FAIRSEQ_CHECKPOINT_GLOBALS = (argparse.Namespace,)


def allow_fairseq_checkpoint_globals() -> None:
    """Adds :data:`FAIRSEQ_CHECKPOINT_GLOBALS` to torch's weights-only allowlist (idempotent)."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is None:  # torch < 2.4 loads with weights_only=False by default
        return
    already = set(torch.serialization.get_safe_globals())
    missing = [g for g in FAIRSEQ_CHECKPOINT_GLOBALS if g not in already]
    if missing:
        add_safe_globals(missing)
