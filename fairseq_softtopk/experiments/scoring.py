"""Scoring fairseq checkpoints with sacrebleu against a raw reference file.

fairseq-generate -> hypotheses in corpus order -> remove BPE (fairseq's ``--post-process``)
-> detokenise (sacremoses, optional) -> sacrebleu BLEU and chrF against the untouched reference.
Every source line must get exactly one hypothesis: fairseq-generate has been seen to drop long
inputs without a word, so a missing or duplicated id is an error, not a silently lower BLEU
(:mod:`.fairseq_generate` runs it and reads its output).
A reference file with another number of lines than the binarised subset has sentences is an
error found before translating (it names the file and both counts), as are bad decoding numbers,
an output file that cannot be written, a missing data directory or subset, and a checkpoint that
is damaged or was trained with another dictionary (:mod:`.eval_inputs`).

The command ``fairseq-softtopk-bleu`` (:mod:`fairseq_softtopk.cli.bleu`) scores one checkpoint;
the ablation runner (:mod:`.ablation_runner`) scores every run and compares the arms with
:func:`.paired_bootstrap.paired_bootstrap`.
"""

import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .eval_inputs import check_checkpoint_matches_data, check_data_dir, check_decoding_numbers, check_output_file
from .fairseq_generate import (best_at_lenpen, parse_hypotheses, parse_nbest, parse_targets, run_fairseq_generate,
                               translated_ids)


def detokenize(lines: Sequence[str], lang: Optional[str]) -> List[str]:
    """Moses detokenisation for ``lang`` (None: lines unchanged)."""
    if not lang:
        return list(lines)
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


def score(hypotheses: Sequence[str], references: Sequence[str]) -> Dict[str, object]:
    """Corpus BLEU and chrF with sacrebleu's default (13a) tokenisation, plus signatures."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
    chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": round(bleu_score.score, 2),
        "chrf": round(chrf_score.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "n_sentences": len(hypotheses),
    }


def _binarised_target_prefix(data_bin: str, subset: str, source_lang: str, target_lang: str) -> Path:
    """The path, less ``.idx``/``.bin``, of the target side of ``subset`` in a fairseq-preprocess directory
    (``data_bin`` may list several, separated by ``os.pathsep`` as fairseq's shards: the first holds the
    evaluation subsets)."""
    return Path(str(data_bin).split(os.pathsep)[0]) / f"{subset}.{source_lang}-{target_lang}.{target_lang}"


def binarised_subset_size(data_bin: str, subset: str, source_lang: Optional[str] = None,
                          target_lang: Optional[str] = None) -> Optional[int]:
    """Sentences of ``subset`` in a fairseq-preprocess directory, from its index file; None when it
    cannot tell (no such subset, several language pairs and no languages given).

    ``data_bin`` may list several directories separated by ``os.pathsep`` (fairseq's shards): the
    first holds the evaluation subsets.
    """
    root = Path(str(data_bin).split(os.pathsep)[0])
    pairs = sorted({p.name[len(subset) + 1:].split(".")[0] for p in root.glob(f"{subset}.*-*.*.idx")})
    if source_lang and target_lang:
        pairs = [f"{source_lang}-{target_lang}"]
    if len(pairs) != 1 or "-" not in pairs[0]:
        return None
    prefix = _binarised_target_prefix(data_bin, subset, *pairs[0].split("-", 1))
    if not Path(f"{prefix}.idx").is_file():
        return None
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    return len(MMapIndexedDataset(str(prefix)))


def binarised_references(data_bin: str, subset: str, source_lang: str, target_lang: str,
                         post_process: Optional[str] = None, detok_lang: Optional[str] = None) -> List[str]:
    """The references of ``subset`` as :func:`evaluate_checkpoint` reads them from fairseq-generate's ``T-`` lines
    (the binarised target, ``post_process`` applied, then detokenised for ``detok_lang``), read from the binarised
    data without a model: as fairseq-generate prints them (unknown words as ``<<unk>>``, end of sentence dropped),
    in corpus order."""
    from fairseq.data import Dictionary
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    prefix = _binarised_target_prefix(data_bin, subset, source_lang, target_lang)
    if not Path(f"{prefix}.idx").is_file():
        raise FileNotFoundError(f"{data_bin} has no binarised '{subset}' subset ({prefix}.idx)")
    dictionary = Dictionary.load(str(prefix.parent / f"dict.{target_lang}.txt"))
    dataset = MMapIndexedDataset(str(prefix))
    lines = [dictionary.string(dataset[i].long(), post_process, escape_unk=True,
                               extra_symbols_to_ignore={dictionary.eos()}) for i in range(len(dataset))]
    return detokenize(lines, detok_lang)


def _language_args(extra_args: Sequence[str]) -> Dict[str, str]:
    """``source_lang``/``target_lang`` given to fairseq-generate in ``extra_args`` (``-s``/``-t`` too)."""
    names = {"-s": "source_lang", "--source-lang": "source_lang", "-t": "target_lang", "--target-lang": "target_lang"}
    extra = [str(a) for a in extra_args]
    found = {}
    for i, arg in enumerate(extra):
        flag, eq, value = arg.partition("=")
        if flag in names and (eq or i + 1 < len(extra)):
            found[names[flag]] = value if eq else extra[i + 1]
    return found


def check_reference_lines(ref: str, n_lines: int, data_bin: str, subset: str,
                          extra_args: Sequence[str] = ()) -> None:
    """Raises ``ValueError`` naming ``ref`` when its ``n_lines`` differ from the binarised subset's
    sentences (nothing is raised when the subset's size cannot be read)."""
    n_sentences = binarised_subset_size(data_bin, subset, **_language_args(extra_args))
    if n_sentences is not None and n_sentences != n_lines:
        raise ValueError(f"reference file {ref} has {n_lines} lines but the binarised '{subset}' subset of "
                         f"{data_bin} has {n_sentences} sentences: pass the raw reference of that subset, line by "
                         f"line the target side of what fairseq-preprocess binarised (or omit --ref to score "
                         f"against the binarised target)")


def read_lines(path: str) -> List[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"reference file not found: {path}")
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def evaluate_checkpoint(data_bin: str, checkpoint: str, ref: Optional[str], subset: str = "test", beam: int = 5,
                        batch_size: Optional[int] = None, post_process: Optional[str] = None,
                        detok_lang: Optional[str] = None, hyp_out: Optional[str] = None,
                        extra_args: Sequence[str] = (), keep_hypotheses: bool = False) -> Dict[str, object]:
    """Generates, checks completeness, detokenises and scores one checkpoint.

    Before translating (:mod:`.eval_inputs`): ``beam`` and ``batch_size``, that ``hyp_out`` can be
    written, the data directory and its ``subset``, the reference's line count, and that the
    checkpoint is a whole file trained with ``data_bin``'s dictionaries.

    Args:
        ref: raw reference file of ``subset``; None scores against fairseq-generate's ``T-``
            lines (the binarised target, after ``post_process`` and ``detok_lang``), for
            subsets without a line-aligned raw reference. ``result["reference"]`` says which.
        keep_hypotheses: also return the detokenised ``hypotheses`` and the ``references``
            (lists of strings, corpus order), e.g. for :func:`paired_bootstrap`.

    Raises:
        ValueError: bad input found before translating (one line naming it; a damaged checkpoint
            is a ``CorruptCheckpointError``), or hypotheses missing after it.
        FileNotFoundError: no such checkpoint, reference or data directory.
        RuntimeError: fairseq-generate failed.
    """
    stdout, references = _checked_generate(data_bin, checkpoint, ref, subset, beam, batch_size, post_process,
                                           detok_lang, [hyp_out] if hyp_out else [], extra_args)
    hypotheses = detokenize(parse_hypotheses(stdout, len(references)), detok_lang)
    return _scored(hypotheses, references, checkpoint, subset, beam, ref, hyp_out, keep_hypotheses)


def evaluate_checkpoint_at_lenpens(data_bin: str, checkpoint: str, ref: Optional[str], lenpens: Sequence[float],
                                   subset: str = "test", beam: int = 5, batch_size: Optional[int] = None,
                                   post_process: Optional[str] = None, detok_lang: Optional[str] = None,
                                   hyp_outs: Optional[Mapping[float, str]] = None, extra_args: Sequence[str] = (),
                                   keep_hypotheses: bool = False) -> Dict[float, Dict[str, object]]:
    """:func:`evaluate_checkpoint` at each length penalty of ``lenpens``, from one fairseq-generate.

    The length penalty does not steer fairseq's beam search: it only divides the score of each finished
    hypothesis by its length (tokens with EOS) ** lenpen, which ranks them. So one decode with
    ``--nbest beam --unnormalized`` holds every candidate of every length penalty, and each penalty's best is
    the candidate with the highest score / length ** lenpen: the hypotheses a decode with ``--lenpen`` gives
    (up to float32 rounding, which could only reorder two candidates whose normalised scores agree to about
    7 digits). Ties go to the candidate fairseq printed first (the higher raw score).

    Args:
        lenpens: the length penalties (distinct).
        hyp_outs: ``{lenpen: path}`` where each penalty's detokenised hypotheses are written.
        Others as :func:`evaluate_checkpoint`.
    Returns:
        ``{lenpen: result}``, each result as :func:`evaluate_checkpoint`'s.
    Raises:
        As :func:`evaluate_checkpoint`; ``ValueError`` for ``extra_args`` that already set ``--lenpen``,
        ``--nbest`` or ``--unnormalized``.
    """
    clashing = sorted({"--lenpen", "--nbest", "--unnormalized"} & {str(arg) for arg in extra_args})
    if clashing:
        raise ValueError(f"{', '.join(clashing)} in the fairseq-generate arguments: decoding at several length "
                         f"penalties sets them itself")
    hyp_outs = dict(hyp_outs or {})
    stdout, references = _checked_generate(data_bin, checkpoint, ref, subset, beam, batch_size, post_process,
                                           detok_lang, list(hyp_outs.values()),
                                           [*extra_args, "--nbest", beam, "--unnormalized"])
    candidates = parse_nbest(stdout, len(references))
    results = {}
    for lenpen in lenpens:
        hypotheses = detokenize([best_at_lenpen(sentence, lenpen) for sentence in candidates], detok_lang)
        results[lenpen] = _scored(hypotheses, references, checkpoint, subset, beam, ref, hyp_outs.get(lenpen),
                                  keep_hypotheses)
    return results


def _checked_generate(data_bin: str, checkpoint: str, ref: Optional[str], subset: str, beam: int,
                      batch_size: Optional[int], post_process: Optional[str], detok_lang: Optional[str],
                      hyp_outs: Sequence[str], extra_args: Sequence) -> Tuple[str, List[str]]:
    """The input checks of :func:`evaluate_checkpoint`, then fairseq-generate: its stdout and the references
    (read from ``ref``, or from the ``T-`` lines)."""
    check_decoding_numbers(beam, batch_size)
    if not os.path.exists(checkpoint):
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    for hyp_out in hyp_outs:
        check_output_file(hyp_out, "--hyp-out")
    check_data_dir(data_bin, subset)
    references = read_lines(ref) if ref else None
    if references is not None:  # before translating: a wrong reference is found in seconds, not after generation
        check_reference_lines(ref, len(references), data_bin, subset, extra_args)
    from fairseq_softtopk.checkpoint_safety import check_whole_checkpoint

    check_whole_checkpoint(checkpoint, "Nothing was translated: score a whole copy of it.")  # torch checks no CRC
    check_checkpoint_matches_data(checkpoint, data_bin, **_language_args(extra_args))
    stdout = run_fairseq_generate(data_bin, checkpoint, subset, beam, batch_size, post_process, extra_args)
    if references is None:
        return stdout, detokenize(parse_targets(stdout), detok_lang)
    translated = translated_ids(stdout)
    if translated and translated == set(range(len(translated))) and len(translated) != len(references):
        # every sentence of the subset has its hypothesis: the reference is the odd one out
        raise ValueError(f"reference file {ref} has {len(references)} lines but fairseq-generate translated "
                         f"all {len(translated)} sentences of the '{subset}' subset of {data_bin}")
    return stdout, references


def _scored(hypotheses: List[str], references: List[str], checkpoint: str, subset: str, beam: int,
            ref: Optional[str], hyp_out: Optional[str], keep_hypotheses: bool) -> Dict[str, object]:
    """:func:`score` of the detokenised ``hypotheses`` with what was scored (written to ``hyp_out``)."""
    if hyp_out:
        Path(hyp_out).parent.mkdir(parents=True, exist_ok=True)
        Path(hyp_out).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    result = score(hypotheses, references)
    result.update({"checkpoint": str(checkpoint), "subset": subset, "beam": beam,
                   "reference": str(ref) if ref else "fairseq-generate T- lines (binarised target)"})
    if keep_hypotheses:
        result.update({"hypotheses": list(hypotheses), "references": list(references)})
    return result


def output_length(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """The output's length as corpus BLEU counts it (sacrebleu's default tokens): ``length_ratio``, hypothesis
    tokens over reference tokens, and ``brevity_penalty`` (1 where the output is the longer, else
    ``exp(1 - 1 / ratio)``), the factor that BLEU loses to short output."""
    import sacrebleu

    score = sacrebleu.metrics.BLEU().corpus_score(list(hypotheses), [list(references)])
    return {"length_ratio": score.sys_len / score.ref_len, "brevity_penalty": score.bp}
