"""The paired bootstrap (Koehn, 2004) of two systems' hypotheses, BLEU and chrF, from per-sentence statistics.

Corpus BLEU and chrF are functions of sums of per-sentence statistics (n-gram matches and totals, lengths;
character n-gram counts), so every resample's score comes from one weighted sum of the sentences' statistics
instead of scoring each resampled corpus again: :func:`bleu_statistics` and :func:`chrf_statistics` give them,
:func:`bleu_from_statistics` and :func:`chrf_from_statistics` the corpus score, both checked against sacrebleu's
own. The ablation runner (:mod:`.ablation_report`) compares each arm with the baseline by :func:`paired_bootstrap`.
"""

from typing import Dict, Sequence


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
