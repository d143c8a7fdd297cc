"""Scoring fairseq checkpoints with sacrebleu against a raw reference file, and the paired bootstrap.

fairseq-generate -> hypotheses in corpus order -> remove BPE (fairseq's ``--post-process``)
-> detokenise (sacremoses, optional) -> sacrebleu BLEU and chrF against the untouched reference.
Every source line must get exactly one hypothesis: fairseq-generate has been seen to drop long
inputs without a word, so a missing or duplicated id is an error, not a silently lower BLEU.
A reference file with another number of lines than the binarised subset has sentences is an
error found before translating (it names the file and both counts), as are bad decoding numbers,
an output file that cannot be written, a missing data directory or subset, and a checkpoint that
is damaged or was trained with another dictionary (:mod:`.eval_inputs`).

The command ``fairseq-softtopk-bleu`` (:mod:`fairseq_softtopk.cli.bleu`) scores one checkpoint;
the ablation runner (:mod:`.ablation_runner`) scores every run and compares the arms with
:func:`paired_bootstrap`.
"""

import logging
import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .child_processes import run_captured
from .eval_inputs import (check_checkpoint_matches_data, check_data_dir, check_decoding_numbers,
                          check_output_file, refused_checkpoint)  # noqa: F401 (the ablation runner's import)
from .fairseq_commands import fairseq_command, subprocess_env

logger = logging.getLogger("evaluate")

_HYPOTHESIS_LINE = re.compile(r"^D-(\d+)\t([^\t]*)\t(.*)$")
_TARGET_LINE = re.compile(r"^T-(\d+)\t(.*)$")
_POSITIONAL_LINE = re.compile(r"^P-(\d+)\t(.*)$")


#: sentences per generation batch by default: on a GPU a beam-5 batch of 64 leaves it mostly idle
#: (about 22 s per 1,000 sentences on an H100, results/gpu_check); on a CPU larger batches gain little
DEFAULT_BATCH_SIZE = {"cpu": 64, "cuda": 256}


def default_batch_size() -> int:
    """:data:`DEFAULT_BATCH_SIZE` for the device fairseq-generate will run on."""
    return DEFAULT_BATCH_SIZE["cuda" if _has_cuda() else "cpu"]


def run_fairseq_generate(data_bin: str, checkpoint: str, subset: str = "test", beam: int = 5,
                         batch_size: Optional[int] = None, post_process: Optional[str] = None,
                         extra_args: Sequence[str] = ()) -> str:
    """Runs ``fairseq-generate`` with this package as ``--user-dir``; returns its stdout.

    ``batch_size`` None: :func:`default_batch_size`."""
    batch_size = batch_size or default_batch_size()
    # fairseq's main branch drops the last batch when its size is not a multiple of
    # --required-batch-size-multiple (default 8); batches are sorted by length, so the
    # longest sentences vanish silently. A multiple of 1 keeps every sentence.
    args = [data_bin, "--path", checkpoint, "--gen-subset", subset, "--beam", beam,
            "--batch-size", batch_size, "--required-batch-size-multiple", 1, "--no-progress-bar"]
    if not _has_cuda():
        args.append("--cpu")
    if post_process:
        args += ["--post-process", post_process]
    proc = run_captured(fairseq_command("generate", [*args, *extra_args]), env=subprocess_env())  # stops with the runner
    if proc.returncode != 0:
        refused = refused_checkpoint(proc.stderr)
        if refused:  # alone: the rest of the output is fairseq's config, not the cause
            raise RuntimeError(f"fairseq-generate refused the checkpoint: {refused}")
        raise RuntimeError(f"fairseq-generate failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_hypotheses(generate_stdout: str, n_sentences: int) -> List[str]:
    """Hypotheses (``D-`` lines, best beam) in corpus order.

    Raises:
        ValueError: if any id in ``[0, n_sentences)`` is missing, duplicated or out of range.
    """
    by_id: Dict[int, str] = {}
    duplicated = []
    for line in generate_stdout.splitlines():
        match = _HYPOTHESIS_LINE.match(line)
        if not match:
            continue
        idx = int(match.group(1))
        if idx in by_id:
            duplicated.append(idx)
        by_id[idx] = match.group(3)
    missing = [i for i in range(n_sentences) if i not in by_id]
    extra = sorted(i for i in by_id if not 0 <= i < n_sentences)
    if missing or duplicated or extra:
        raise ValueError(
            f"fairseq-generate returned {len(by_id)} hypotheses for {n_sentences} source lines: "
            f"missing ids {missing[:10]}{'...' if len(missing) > 10 else ''} ({len(missing)} in all), "
            f"duplicated ids {duplicated[:10]}, out-of-range ids {extra[:10]}. fairseq drops inputs longer "
            f"than --max-source-positions, and the last batch unless --required-batch-size-multiple is 1.")
    return [by_id[i] for i in range(n_sentences)]


def parse_targets(generate_stdout: str) -> List[str]:
    """The references fairseq-generate printed (``T-`` lines, after ``--post-process``) in corpus order.

    For subsets whose raw reference file is not line-aligned with the binarised data (e.g. a
    valid set that data preparation cleaned). Raises ``ValueError`` if ids are not ``0..n-1``.
    """
    by_id = {}
    for line in generate_stdout.splitlines():
        match = _TARGET_LINE.match(line)
        if match:
            by_id[int(match.group(1))] = match.group(2)
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"fairseq-generate printed target ids that are not 0..{len(by_id) - 1}")
    return [by_id[i] for i in range(len(by_id))]


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


def parse_nbest(generate_stdout: str, n_sentences: int) -> List[List[Tuple[float, int, str]]]:
    """Every hypothesis of ``fairseq-generate --nbest`` per sentence, in corpus order: ``(score, length, text)``
    from its ``D-`` line (score and text) and the ``P-`` line after it (one positional score per token, EOS
    included: the length fairseq normalises by), in the order printed.

    Raises:
        ValueError: a sentence of ``[0, n_sentences)`` without hypotheses, an id out of range, or a ``D-``
            line without its ``P-`` line.
    """
    by_id: Dict[int, List[list]] = {}
    for line in generate_stdout.splitlines():
        match = _HYPOTHESIS_LINE.match(line)
        if match:
            by_id.setdefault(int(match.group(1)), []).append([float(match.group(2)), None, match.group(3)])
            continue
        match = _POSITIONAL_LINE.match(line)
        if match:
            hypotheses = by_id.get(int(match.group(1)))
            if not hypotheses or hypotheses[-1][1] is not None:
                raise ValueError(f"fairseq-generate printed a P- line of sentence {match.group(1)} without its D- line")
            hypotheses[-1][1] = len(match.group(2).split())
    missing = [i for i in range(n_sentences) if i not in by_id]
    extra = sorted(i for i in by_id if not 0 <= i < n_sentences)
    unmatched = sorted(i for i, hyps in by_id.items() if any(h[1] is None for h in hyps))
    if missing or extra or unmatched:
        raise ValueError(f"fairseq-generate --nbest: no hypotheses for ids {missing[:10]} ({len(missing)} of "
                         f"{n_sentences}), out-of-range ids {extra[:10]}, D- lines without P- lines for ids "
                         f"{unmatched[:10]}")
    return [[tuple(h) for h in by_id[i]] for i in range(n_sentences)]


def best_at_lenpen(candidates: Sequence[Tuple[float, int, str]], lenpen: float) -> str:
    """The text of the candidate ``(score, length, text)`` with the highest ``score / length ** lenpen`` (fairseq's
    normalised score); the first of a tie."""
    best = max(range(len(candidates)), key=lambda i: (candidates[i][0] / candidates[i][1] ** lenpen, -i))
    return candidates[best][2]


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
    translated = {int(m.group(1)) for m in map(_HYPOTHESIS_LINE.match, stdout.splitlines()) if m}
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


def bleu_statistics(hypotheses: Sequence[str], references: Sequence[str]):
    """Per-sentence BLEU sufficient statistics ``(n, 2 + 2 * 4)``: sys_len, ref_len, matches, totals.

    Taken from sacrebleu's public ``BLEUScore`` fields of each sentence scored alone (the
    statistics do not depend on smoothing); corpus BLEU of any weighting is
    :func:`bleu_from_statistics` of ``weights @ stats``.
    """
    import numpy as np
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    rows = []
    for hyp, ref in zip(hypotheses, references):
        s = bleu.corpus_score([hyp], [[ref]])
        rows.append([s.sys_len, s.ref_len, *s.counts, *s.totals])
    return np.asarray(rows, dtype=np.float64).reshape(-1, 2 + 2 * bleu.max_ngram_order)


def bleu_from_statistics(stats) -> float:
    """Corpus BLEU (sacrebleu's defaults: exp smoothing, 4-grams) from summed :func:`bleu_statistics`."""
    import sacrebleu

    order = 4
    return sacrebleu.metrics.BLEU.compute_bleu(
        correct=[int(x) for x in stats[2:2 + order]], total=[int(x) for x in stats[2 + order:]],
        sys_len=int(stats[0]), ref_len=int(stats[1]), smooth_method="exp").score


#: chrF's settings (sacrebleu's defaults, the signature ``nc:6|nw:0|space:no``).
CHRF_CHAR_ORDER, CHRF_BETA = 6, 2


def chrf_statistics(hypotheses: Sequence[str], references: Sequence[str]):
    """Per-sentence chrF statistics ``(n, 3 * 6)``: hypothesis, reference and matching character
    n-gram counts for n = 1..6 (whitespace removed), from sacrebleu's public n-gram helper."""
    import numpy as np
    from sacrebleu.metrics.helpers import extract_all_char_ngrams

    rows = []
    for hyp, ref in zip(hypotheses, references):
        row = []
        for h, r in zip(extract_all_char_ngrams(hyp, CHRF_CHAR_ORDER), extract_all_char_ngrams(ref, CHRF_CHAR_ORDER)):
            n_hyp = sum(h.values())
            # as sacrebleu: hypothesis n-grams count only where the reference has n-grams of that order
            row += [n_hyp if r else 0, sum(r.values()), sum(min(c, r[g]) for g, c in h.items() if g in r)]
        rows.append(row)
    return np.asarray(rows, dtype=np.float64).reshape(-1, 3 * CHRF_CHAR_ORDER)


def chrf_from_statistics(stats) -> float:
    """Corpus chrF (Popovic, 2015; beta 2) from summed :func:`chrf_statistics`.

    Precision and recall are averaged over the orders where both the hypothesis and the
    reference have n-grams (sacrebleu's default, no epsilon smoothing), then combined in F_beta.
    """
    precisions, recalls = [], []
    for i in range(CHRF_CHAR_ORDER):
        n_hyp, n_ref, n_match = stats[3 * i: 3 * i + 3]
        if n_hyp > 0 and n_ref > 0:
            precisions.append(n_match / n_hyp)
            recalls.append(n_match / n_ref)
    if not precisions:
        return 0.0
    prec, rec = sum(precisions) / len(precisions), sum(recalls) / len(recalls)
    factor = CHRF_BETA ** 2
    return 100 * (1 + factor) * prec * rec / (factor * prec + rec) if prec + rec else 0.0


#: metric name -> (per-sentence statistics, corpus score from summed statistics)
BOOTSTRAP_METRICS = {"bleu": (bleu_statistics, bleu_from_statistics), "chrf": (chrf_statistics, chrf_from_statistics)}


def _resample_scores(metric: str, hypotheses: Sequence[str], references: Sequence[str], weights):
    """Corpus scores of ``metric`` (``bleu`` or ``chrf``) on every bootstrap resample.

    ``weights`` ``(n_samples, n_sentences)`` counts how often each sentence is drawn; corpus
    statistics are sums of sentence statistics, so ``weights @ stats`` gives every resample's
    statistics at once.
    """
    import numpy as np

    statistics, score = BOOTSTRAP_METRICS[metric]
    stats = statistics(hypotheses, references)
    return np.array([score(row) for row in weights @ stats])


def paired_bootstrap(baseline: Sequence[str], system: Sequence[str], references: Sequence[str],
                     n_samples: int = 1000, seed: int = 12345) -> Dict[str, Dict[str, object]]:
    """Paired bootstrap resampling (Koehn, 2004) of ``system`` against ``baseline``, BLEU and chrF.

    Both systems are scored on the same ``n_samples`` resamples of the test sentences (drawn
    with a ``numpy`` generator seeded with ``seed``). For each metric:

    * ``delta``: system minus baseline on the full corpus, the difference of the two scores as reported
      (rounded to 2 decimals first, so that a table of differences agrees with the table of scores);
    * ``delta_ci95``: the 2.5 and 97.5 percentiles of the resampled deltas;
    * ``p_value``: two-sided, ``min(1, 2 min(P(delta* <= 0), P(delta* >= 0)))`` with add-one
      smoothing; Koehn's one-sided "the system is better in x% of resamples" is ``1 - x``.
      Identical systems get 1; sacrebleu's ``--paired-bs`` gives them ``1/(n+1)`` because it
      counts resampled differences strictly larger than the observed one, zero here.
    * ``system_ci95``: the percentile interval of the system's own score.

    Raises:
        ValueError: if the three lists differ in length or are empty.
    """
    import numpy as np
    import sacrebleu

    if not len(baseline) == len(system) == len(references) or not references:
        raise ValueError(f"paired_bootstrap needs equal, non-empty lists: {len(baseline)} baseline, "
                         f"{len(system)} system hypotheses, {len(references)} references")
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    rng = np.random.default_rng(seed)
    n = len(references)
    draws = rng.integers(0, n, size=(n_samples, n))
    weights = np.stack([np.bincount(row, minlength=n) for row in draws]).astype(np.float64)
    result = {}
    for name, metric in (("bleu", sacrebleu.metrics.BLEU()), ("chrf", sacrebleu.metrics.CHRF())):
        base = metric.corpus_score(list(baseline), [list(references)]).score
        sys_score = metric.corpus_score(list(system), [list(references)]).score
        base_star = _resample_scores(name, baseline, references, weights)
        sys_star = _resample_scores(name, system, references, weights)
        delta_star = sys_star - base_star
        tail = int(min((delta_star <= 0).sum(), (delta_star >= 0).sum()))
        base, sys_score = round(base, 2), round(sys_score, 2)
        result[name] = {
            "baseline": base, "system": sys_score, "delta": round(sys_score - base, 2),
            "delta_ci95": [round(float(x), 2) for x in np.percentile(delta_star, [2.5, 97.5])],
            "system_ci95": [round(float(x), 2) for x in np.percentile(sys_star, [2.5, 97.5])],
            "p_value": round(min(1.0, 2.0 * (tail + 1) / (n_samples + 1)), 4),
            "n_samples": n_samples, "seed": seed,
        }
    return result
