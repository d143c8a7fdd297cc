"""A checkpoint of the plugin's models, its task and a sample of single-sentence batches: what the diagnostics
under ``scripts/diagnostics/`` share (their command-line arguments and quiet logging too)."""

import argparse
import logging
import math
import statistics
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

import fairseq_softtopk
from fairseq_softtopk.experiments.fairseq_commands import PACKAGE_DIR  # the --user-dir: the same copy


def training_cfg(data_bin: str, arch: str, flags: Sequence[str]):
    """fairseq's config for ``fairseq-train DATA_BIN --arch ARCH --criterion soft_beam_search FLAGS --cpu``."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    fairseq_softtopk.register()
    argv = [data_bin, "--user-dir", str(PACKAGE_DIR), "--arch", arch, "--criterion", "soft_beam_search", "--cpu",
            *flags]
    return convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))


def checkpoint_arch(state: dict) -> Optional[str]:
    """The architecture a loaded fairseq checkpoint records, or None: ``cfg.model`` is a dict (``_name``) or, in
    checkpoints whose model config fairseq kept as the parsed arguments (the shipped Transformer's), an
    ``argparse.Namespace`` (``arch``); the oldest keep only ``args``."""
    model = (state.get("cfg") or {}).get("model")
    if isinstance(model, dict):
        return model.get("_name")
    return getattr(model, "arch", None) or getattr(state.get("args"), "arch", None)


def load_model(checkpoint: Path, data_bin: str):
    """``(task, model)``: the checkpoint's architecture and weights, the task on ``data_bin``."""
    from fairseq import tasks

    fairseq_softtopk.register()
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    arch = checkpoint_arch(state)
    if arch is None:
        raise ValueError(f"{checkpoint}: no architecture recorded (not a fairseq checkpoint?)")
    cfg = training_cfg(data_bin, arch, [])
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    model.load_state_dict(state["model"])
    return task, model, arch


def sample_sentences(task, subset: str, count: int, seed: int, max_len: int) -> List[dict]:
    """``count`` single-sentence batches of ``subset`` (a seeded sample of targets up to ``max_len`` tokens)."""
    task.load_dataset(subset)
    dataset = task.dataset(subset)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=generator).tolist()
    chosen = [i for i in order if dataset.tgt_sizes[i] <= max_len][:count]
    if not chosen:
        raise ValueError(f"no {subset} sentence has a target of at most {max_len} tokens")
    return [dataset.collater([dataset[i]]) for i in chosen]


def quantiles(values: Sequence[float]) -> Dict[str, float]:
    """median, p90, p99 and max (nearest-rank) of ``values``."""
    ordered = sorted(values)

    def rank(q):
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"median": statistics.median(ordered), "p90": rank(0.9), "p99": rank(0.99), "max": ordered[-1]}


def add_sample_arguments(parser: argparse.ArgumentParser, model: str, subset: str, sentences: int) -> None:
    """The checkpoint, its data and the sentence sample (:func:`load_model`, :func:`sample_sentences`)."""
    parser.add_argument("checkpoint", type=Path, help=f"a fairseq checkpoint of {model}")
    parser.add_argument("data_bin", help="its fairseq-preprocess directory")
    parser.add_argument("--subset", default=subset)
    parser.add_argument("--sentences", type=int, default=sentences)
    parser.add_argument("--max-len", type=int, default=60, help="longest target (tokens) sampled")
    parser.add_argument("--seed", type=int, default=1)


def quiet_logging(threads: int) -> None:
    """Warnings and fairseq's, hydra's and matplotlib's info logs off (the tables are the output); ``threads`` > 0
    sets torch's threads."""
    for category in (UserWarning, DeprecationWarning):  # hydra's configuration deprecations, not ours
        warnings.filterwarnings("ignore", category=category)
    logging.basicConfig(level=logging.WARNING)
    for name in ("fairseq", "hydra", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if threads:
        torch.set_num_threads(threads)
