"""Joint BPE over both languages: subword-nmt (``@@`` continuation marks) or sentencepiece
(``\u2581`` word-start marks). Remove it after generation with fairseq's
``--post-process subword_nmt`` or ``--post-process sentencepiece``.
"""

import logging
import os
import shutil
from pathlib import Path
from typing import Sequence

from data_prep.text import map_lines
from fairseq_softtopk.experiments.source_segmentation import sentencepiece_encoder, subword_nmt_encoder

logger = logging.getLogger("data_prep")

BPE_KINDS = ("subword_nmt", "sentencepiece")
# Sentences sampled for sentencepiece training (it loads them into memory); subword-nmt reads all.
SPM_MAX_SENTENCES = 10_000_000
SPM_SEED = 1


def model_files(kind: str, bpe_dir: Path) -> Sequence[Path]:
    """The files :func:`learn_bpe` writes: ``codes`` or ``spm.model`` + ``spm.vocab``."""
    if kind == "subword_nmt":
        return [bpe_dir / "codes"]
    if kind == "sentencepiece":
        return [bpe_dir / "spm.model", bpe_dir / "spm.vocab"]
    raise ValueError(f"unknown BPE kind {kind!r}; choose one of {', '.join(BPE_KINDS)}")


def _learn_subword_nmt(inputs: Sequence[Path], codes: Path, size: int, workers: int) -> None:
    from subword_nmt.learn_bpe import learn_bpe

    joint = codes.with_name(codes.name + ".input")  # both languages, as in fairseq's recipes
    with open(joint, "wb") as out:
        for path in inputs:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    try:
        with open(joint, encoding="utf-8") as fin, open(codes, "w", encoding="utf-8") as fout:
            learn_bpe(fin, fout, size, min_frequency=2, num_workers=workers)
    finally:
        joint.unlink()


def _learn_sentencepiece(inputs: Sequence[Path], model: Path, vocab: Path, size: int, workers: int) -> None:
    import sentencepiece as spm

    prefix = model.with_name("spm-training")
    spm.set_random_generator_seed(SPM_SEED)
    spm.SentencePieceTrainer.train(
        input=[str(p) for p in inputs], model_prefix=str(prefix), vocab_size=size, model_type="bpe",
        character_coverage=1.0, input_sentence_size=SPM_MAX_SENTENCES, shuffle_input_sentence=True,
        hard_vocab_limit=False, num_threads=workers, minloglevel=2)
    os.replace(f"{prefix}.model", model)
    os.replace(f"{prefix}.vocab", vocab)


def learn_bpe(kind: str, inputs: Sequence[Path], outputs: Sequence[Path], size: int, workers: int) -> None:
    """Learns a joint BPE model of ``size`` merges (subword-nmt) or pieces (sentencepiece).

    Args:
        inputs: tokenised training text, one file per language.
        outputs: where to write :func:`model_files` (same order).
    """
    if size < 1:
        raise ValueError(f"BPE size must be positive, got {size}")
    if kind == "subword_nmt":
        _learn_subword_nmt(inputs, outputs[0], size, workers)
    elif kind == "sentencepiece":
        _learn_sentencepiece(inputs, outputs[0], outputs[1], size, workers)
    else:
        raise ValueError(f"unknown BPE kind {kind!r}; choose one of {', '.join(BPE_KINDS)}")
    logger.info("learnt %s BPE (size %d) on %s", kind, size, ", ".join(map(str, inputs)))


def apply_bpe(kind: str, model: Path, src: Path, dst: Path, workers: int) -> int:
    """Segments ``src`` into ``dst`` with a model from :func:`learn_bpe`; returns the line count."""
    factory = {"subword_nmt": subword_nmt_encoder, "sentencepiece": sentencepiece_encoder}.get(kind)
    if factory is None:
        raise ValueError(f"unknown BPE kind {kind!r}; choose one of {', '.join(BPE_KINDS)}")
    return map_lines(src, dst, factory, (str(model),), workers, f"bpe {src.name}")
