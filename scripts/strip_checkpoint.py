#!/usr/bin/env python
"""Writes a fairseq checkpoint without its optimizer state: the file to publish or fine-tune from.

The model's weights, its config and the rest of the checkpoint are kept, the config's absolute paths cut to what a
reader can resolve (``/home/me/runs/x/bin`` -> ``runs/x/bin``, as results/ are: fairseq reads none of them when it
loads a checkpoint; the training data and save directory were the training machine's); ``last_optimizer_state``
(Adam's two moments: twice the model's size) is dropped, so ``--restore-file`` cannot resume the optimizer from it, while
``--finetune-from-model`` and ``fairseq-softtopk-ablation --pretrained`` (which reset the optimizer) and
``fairseq-generate`` use it as they would the original. Loaded with weights-only unpickling (the package's
allowlist of what fairseq checkpoints carry); an existing output is not overwritten. Prints the output's
sha256 and the number of model parameters::

    python scripts/strip_checkpoint.py runs/transformer_ablation/pretrain/checkpoint_last.pt \\
        checkpoints/multi30k_en_de_transformer_tf/checkpoint_best.pt
"""

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from fairseq_softtopk.checkpoint_safety import allow_fairseq_checkpoint_globals  # noqa: E402
from fairseq_softtopk.experiments.publish import absolute_paths, strip_absolute_paths  # noqa: E402


def without_machine_paths(value):
    """``value`` (a checkpoint's ``cfg`` or ``args``: dicts, lists, namespaces of plain values) with every string
    that names an absolute path cut by :func:`strip_absolute_paths`; nothing else changes."""
    if isinstance(value, str):
        return strip_absolute_paths(value) if absolute_paths(value) else value
    if isinstance(value, dict):
        return {key: without_machine_paths(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(without_machine_paths(item) for item in value)
    if isinstance(value, argparse.Namespace):
        return argparse.Namespace(**without_machine_paths(vars(value)))
    return value


def strip_checkpoint(source: Path, target: Path) -> dict:
    """Writes ``source`` without ``last_optimizer_state`` to ``target``; returns ``{sha256, parameters, bytes}``.

    Raises:
        FileNotFoundError: ``source`` is missing. FileExistsError: ``target`` exists.
        ValueError: ``source`` holds no ``model`` state (not a fairseq checkpoint).
    """
    if not source.is_file():
        raise FileNotFoundError(f"checkpoint not found: {source}")
    if target.exists():
        raise FileExistsError(f"{target} exists: not overwritten (remove it first)")
    allow_fairseq_checkpoint_globals()
    state = torch.load(source, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{source} is not a fairseq checkpoint (no 'model' entry)")
    state.pop("last_optimizer_state", None)
    for key in ("cfg", "args"):
        if state.get(key) is not None:
            state[key] = without_machine_paths(state[key])
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    torch.save(state, partial)
    partial.replace(target)  # never a half-written file under the final name
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    # tied weights (one tensor under several names) once
    parameters = sum({(t.untyped_storage().data_ptr(), t.numel()): t.numel() for t in state["model"].values()}.values())
    return {"sha256": digest, "parameters": parameters, "bytes": target.stat().st_size}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a fairseq checkpoint (with its optimizer state)")
    parser.add_argument("target", type=Path, help="where to write it without (must not exist)")
    args = parser.parse_args(argv)
    try:
        info = strip_checkpoint(args.source, args.target)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"{info['sha256']}  {args.target.name}\n# {info['parameters']:,} model parameters and buffers (tied once), "
          f"{info['bytes'] / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
