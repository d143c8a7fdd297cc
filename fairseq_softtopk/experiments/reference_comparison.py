"""Does a run of an ablation agree with a published one (README's table)?

Compares, subset by subset, every arm's mean BLEU and every paired BLEU difference (each arm
against the baseline and against the ``compare_to`` arms) of two ``results.json`` files. A row
agrees when Student's two-sample t-test (pooled variance over the seeds of both runs) cannot
tell the two means apart at a two-sided level of 5% divided by the number of rows (Bonferroni: a
run that repeats the published one is called different in at most 5% of cases, however many
rows): ``|a - b| <= t * s_pooled * sqrt(1/n_a + 1/n_b)``, ``t`` Student's quantile at
``n_a + n_b - 2`` degrees of freedom. Runs of one seed have no spread: their rows are shown and
not judged, except the score of a pretrained checkpoint both runs started from (the same file, by
its SHA-256): it differs between machines only by the arithmetic of decoding, and is judged with
:data:`SAME_CHECKPOINT_TOLERANCE`.
"""

import math
import statistics
from typing import Dict, List, Optional, Tuple

Row = Dict[str, object]


FAMILY_LEVEL = 0.05
#: BLEU by which one checkpoint's score may differ between two machines (the beams' arithmetic):
#: the shipped demo model scored the same on AVX-512 and AVX2 arithmetic to 0.1 BLEU.
SAME_CHECKPOINT_TOLERANCE = 1.0


def _student_t(two_sided_level: float, dof: int) -> float:
    from scipy.stats import t

    return float(t.ppf(1 - two_sided_level / 2, dof))


def _stats(values: List[float]) -> Tuple[float, float, int]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)


def _quantities(results: dict, subset: str) -> Dict[str, List[float]]:
    """``{row name: per-seed values}``: each arm's BLEU, each paired BLEU difference."""
    rows: Dict[str, List[float]] = {}
    for arm, by_seed in results["scores"].items():
        rows[f"{arm} BLEU"] = [scores[subset]["bleu"] for scores in by_seed.values() if subset in scores]
    against = {results["baseline"]: results.get("bootstrap") or {}, **(results.get("bootstrap_vs") or {})}
    for ref, arms in against.items():
        for arm, by_seed in arms.items():
            if f"{ref} - {arm} BLEU" in rows:  # the same difference, mirrored (tf against hard, hard against tf)
                continue
            rows[f"{arm} - {ref} BLEU"] = [d[subset]["bleu"]["delta"] for d in by_seed.values() if subset in d]
    return {name: values for name, values in rows.items() if values}


def _same_checkpoint(published: dict, ours: dict) -> bool:
    digest = published.get("pretrained_sha256")
    return bool(digest) and digest == ours.get("pretrained_sha256")


def compare(published: dict, ours: dict) -> List[Row]:
    """One row per quantity both runs measured: name, subset, the two (mean, sd, n), the
    tolerance and ``agrees`` (None where either run has a single seed)."""
    pairs = []
    for subset in published["summary"][published["baseline"]]:
        theirs, mine = _quantities(published, subset), _quantities(ours, subset)
        pairs += [(name, subset, _stats(theirs[name]), _stats(mine[name])) for name in theirs if name in mine]
    judged = sum(1 for _, _, a, b in pairs if a[2] > 1 and b[2] > 1)
    rows: List[Row] = []
    for name, subset, (ma, sa, na), (mb, sb, nb) in pairs:
        tolerance: Optional[float] = None
        if na == nb == 1 and name == "pretrained BLEU" and _same_checkpoint(published, ours):
            tolerance = SAME_CHECKPOINT_TOLERANCE
        elif na > 1 and nb > 1:
            pooled = math.sqrt(((na - 1) * sa ** 2 + (nb - 1) * sb ** 2) / (na + nb - 2))
            tolerance = _student_t(FAMILY_LEVEL / judged, na + nb - 2) * pooled * math.sqrt(1 / na + 1 / nb)
        rows.append({"name": name, "subset": subset, "published": (ma, sa, na), "ours": (mb, sb, nb),
                     "tolerance": tolerance, "agrees": None if tolerance is None else abs(ma - mb) <= tolerance})
    return rows


def comparison_markdown(rows: List[Row], published_name: str) -> Tuple[str, Optional[bool]]:
    """The comparison table and its one-line verdict; the verdict's truth value (None: nothing judged)."""
    lines = [f"| quantity ({rows[0]['subset'] if rows else 'test'}) | {published_name} | this run | "
             f"difference | tolerance | agrees |", "|---|---|---|---|---|---|"]
    for row in rows:
        (ma, sa, na), (mb, sb, nb) = row["published"], row["ours"]
        tol = "-" if row["tolerance"] is None else f"{row['tolerance']:.2f}"
        verdict = {None: "-", True: "yes", False: "**no**"}[row["agrees"]]
        lines.append(f"| {row['name']} | {ma:.2f} ± {sa:.2f} (n={na}) | {mb:.2f} ± {sb:.2f} (n={nb}) | "
                     f"{mb - ma:+.2f} | {tol} | {verdict} |")
    judged = [row for row in rows if row["agrees"] is not None]
    if not judged:
        return "\n".join(lines + ["", "Not judged: one of the runs has a single seed (no spread)."]), None
    differing = [row["name"] for row in judged if not row["agrees"]]
    how = "two-sample t-tests over the seeds, 5% for the whole table"
    if any(row["published"][2] == 1 for row in judged):
        how += f"; the shared pretrained model's score: {SAME_CHECKPOINT_TOLERANCE:.1f} BLEU"
    if not differing:
        verdict = (f"Your run agrees with {published_name}: all {len(judged)} quantities within the tolerance "
                   f"({how}).")
    else:
        verdict = (f"Your run differs from {published_name} in {len(differing)} of {len(judged)} quantities "
                   f"({', '.join(differing)}): beyond the tolerance ({how}).")
    return "\n".join(lines + ["", verdict]), not differing
