"""The per-line segmentation of the prepared corpora (``data_prep/``): Moses punctuation normalisation and
tokenisation, then the corpus's BPE model. One definition, used by data preparation and by the ablation runner
when it translates source files that were not prepared with the corpus (:mod:`.source_translation`), so that a
held-out source is segmented exactly as the training data was."""

from pathlib import Path
from typing import Callable

LineFn = Callable[[str], str]

#: the files of ``DATA_DIR/bpe`` by BPE kind, as data_prep writes them (``data_prep/bpe.py``)
BPE_MODEL_FILES = {"sentencepiece": "spm.model", "subword_nmt": "codes"}


def moses_line_tokenizer(lang: str) -> LineFn:
    """Moses ``normalize-punctuation.perl`` + ``remove-non-printing-char.perl`` +
    ``tokenizer.perl -a -l LANG`` (aggressive dash splitting, HTML escaping), from sacremoses."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer = MosesPunctNormalizer(lang=lang, post_remove_control_chars=True)
    tokenizer = MosesTokenizer(lang=lang)

    def tokenize(line: str) -> str:
        return tokenizer.tokenize(normalizer.normalize(line), aggressive_dash_splits=True,
                                  return_str=True, escape=True)

    return tokenize


def subword_nmt_encoder(codes: str) -> LineFn:
    """``apply_bpe.py -c codes`` for one line."""
    from subword_nmt.apply_bpe import BPE

    with open(codes, encoding="utf-8") as f:
        bpe = BPE(f)
    return bpe.process_line


def sentencepiece_encoder(model: str) -> LineFn:
    """Pieces of one line, joined by spaces."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model)
    return lambda line: " ".join(processor.encode(line, out_type=str))


def corpus_segmenter(bpe_dir: Path, lang: str) -> LineFn:
    """Raw line -> the tokens the binarised corpus holds: :func:`moses_line_tokenizer` then the BPE model of
    ``bpe_dir`` (``DATA_DIR/bpe`` of a data_prep output: ``spm.model`` or ``codes``).

    Raises:
        FileNotFoundError: ``bpe_dir`` holds neither model (naming both).
    """
    found = [kind for kind, name in BPE_MODEL_FILES.items() if (Path(bpe_dir) / name).is_file()]
    if not found:
        raise FileNotFoundError(f"{bpe_dir} holds no BPE model ({' or '.join(BPE_MODEL_FILES.values())}, as "
                                f"data_prep writes DATA_DIR/bpe): sources cannot be segmented as the corpus was")
    kind = found[0]
    tokenize = moses_line_tokenizer(lang)
    encode = {"sentencepiece": sentencepiece_encoder, "subword_nmt": subword_nmt_encoder}[kind](
        str(Path(bpe_dir) / BPE_MODEL_FILES[kind]))
    return lambda line: encode(tokenize(line))
