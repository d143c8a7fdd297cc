"""The main job's agreement check (reference_comparison), against scipy's two-sample t-test."""

import numpy as np
import pytest
from scipy import stats

from fairseq_softtopk.experiments.reference_comparison import SAME_CHECKPOINT_TOLERANCE, compare, comparison_markdown


def results(bleu: dict, seeds=(1, 2, 3)) -> dict:
    """A results.json with the fields the comparison reads: ``bleu`` = {arm: per-seed BLEU}; the
    paired differences are the per-seed BLEU differences (as a bootstrap's ``delta`` is)."""
    seeds = [str(s) for s in seeds]
    scores = {arm: {s: {"test": {"bleu": v}} for s, v in zip(seeds, values)} for arm, values in bleu.items()}

    def delta(arm, ref):
        return {s: {"test": {"bleu": {"delta": scores[arm][s]["test"]["bleu"] - scores[ref][s]["test"]["bleu"]}}}
                for s in seeds}

    return {"baseline": "tf", "summary": {"tf": {"test": {}}}, "scores": scores,
            "bootstrap": {"hard": delta("hard", "tf"), "soft": delta("soft", "tf")},
            "bootstrap_vs": {"hard": {"tf": delta("tf", "hard"), "soft": delta("soft", "hard")}}}


def per_seed(run: dict, name: str) -> list:
    arm, _, ref = name.replace(" BLEU", "").partition(" - ")
    values = [run["scores"][arm][s]["test"]["bleu"] for s in run["scores"][arm]]
    if ref:
        values = [v - run["scores"][ref][s]["test"]["bleu"] for v, s in zip(values, run["scores"][ref])]
    return values


@pytest.mark.parametrize("shift", [0.0, 0.8, 3.0, 12.0])
def test_each_row_agrees_exactly_when_students_t_test_does_not_reject(shift):
    rng = np.random.default_rng(int(shift * 10))
    published = results({arm: list(50 + rng.normal(0, 1.5, 3)) for arm in ("tf", "hard", "soft")})
    ours = results({"tf": list(50 + rng.normal(0, 1.5, 3)), "hard": list(50 + rng.normal(0, 1.5, 3)),
                    "soft": list(50 + shift + rng.normal(0, 1.5, 3))})
    rows = compare(published, ours)
    # each difference once: tf against hard is hard against tf, mirrored
    assert [row["name"] for row in rows] == ["tf BLEU", "hard BLEU", "soft BLEU", "hard - tf BLEU",
                                             "soft - tf BLEU", "soft - hard BLEU"]
    for row in rows:
        p = stats.ttest_ind(per_seed(published, row["name"]), per_seed(ours, row["name"]), equal_var=True).pvalue
        assert row["agrees"] == (p >= 0.05 / len(rows)), (row["name"], p)


def test_a_run_agrees_with_itself_and_a_shifted_one_is_named():
    published = results({"tf": [50.0, 51.0, 52.5], "hard": [52.0, 53.5, 53.0], "soft": [52.5, 52.0, 54.0]})
    _, same = comparison_markdown(compare(published, published), "README's table")
    assert same is True
    shifted = results({"tf": [50.0, 51.0, 52.5], "hard": [52.0, 53.5, 53.0], "soft": [62.5, 62.0, 64.0]})
    text, agrees = comparison_markdown(compare(published, shifted), "README's table")
    assert agrees is False
    assert "soft BLEU" in text.splitlines()[-1] and "soft - hard BLEU" in text.splitlines()[-1]
    assert "hard - tf BLEU" not in text.splitlines()[-1]


def test_a_single_seed_is_shown_and_not_judged():
    published = results({"tf": [50.0, 51.0, 52.5], "hard": [52.0, 53.5, 53.0], "soft": [52.5, 52.0, 54.0]})
    one = results({"tf": [50.0], "hard": [52.0], "soft": [52.5]}, seeds=(1,))
    rows = compare(published, one)
    assert rows and all(row["agrees"] is None for row in rows)
    text, verdict = comparison_markdown(rows, "README's table")
    assert verdict is None and "Not judged" in text


def with_pretrained(run: dict, bleu: float, sha256: str) -> dict:
    """``run`` with the score of the one pretrained checkpoint every seed started from."""
    run = {**run, "scores": {**run["scores"], "pretrained": {"0": {"test": {"bleu": bleu}}}}, "pretrained_sha256": sha256}
    return run


@pytest.mark.parametrize("shift, agrees", [(0.0, True), (0.9, True), (-1.1, False), (5.0, False)])
def test_the_shared_pretrained_model_is_judged_with_the_fixed_tolerance(shift, agrees):
    base = results({"tf": [50.0, 51.0, 52.5], "hard": [52.0, 53.5, 53.0], "soft": [52.5, 52.0, 54.0]})
    rows = compare(with_pretrained(base, 48.0, "a" * 64), with_pretrained(base, 48.0 + shift, "a" * 64))
    row = next(row for row in rows if row["name"] == "pretrained BLEU")
    assert row["tolerance"] == SAME_CHECKPOINT_TOLERANCE and row["agrees"] is agrees
    text, verdict = comparison_markdown(rows, "README's table")
    assert verdict is agrees and ("pretrained BLEU" in text.splitlines()[-1]) is not agrees


def test_another_pretrained_checkpoint_is_shown_and_not_judged():
    base = results({"tf": [50.0, 51.0, 52.5], "hard": [52.0, 53.5, 53.0], "soft": [52.5, 52.0, 54.0]})
    rows = compare(with_pretrained(base, 48.0, "a" * 64), with_pretrained(base, 58.0, "b" * 64))
    row = next(row for row in rows if row["name"] == "pretrained BLEU")
    assert row["tolerance"] is None and row["agrees"] is None


def doctored(run: dict, flip=None, pretrained_shift: float = 0.0) -> dict:
    """A copy of a published ``results.json`` with the sign of ``flip`` = (a, b)'s difference flipped (each seed's
    test BLEU of arm a reflected about b's: ``a' = 2 b - a``; b may be the shared "pretrained" model), every paired
    difference recomputed from the scores, and the pretrained model's score shifted by ``pretrained_shift``."""
    import copy

    run = copy.deepcopy(run)
    scores = run["scores"]
    if flip:
        a, b = flip
        for seed, subsets in scores[a].items():
            reference = scores[b].get(seed) or next(iter(scores[b].values()))  # the shared model: one score
            for subset, entry in subsets.items():
                entry["bleu"] = 2 * reference[subset]["bleu"] - entry["bleu"]
    for by_ref in [{run["baseline"]: run["bootstrap"]}, run.get("bootstrap_vs") or {}]:
        for ref, arms in by_ref.items():
            for arm, by_seed in arms.items():
                for seed, subsets in by_seed.items():
                    for subset, d in subsets.items():
                        d["bleu"]["delta"] = scores[arm][seed][subset]["bleu"] - scores[ref][seed][subset]["bleu"]
    for entry in scores["pretrained"].values():
        entry["test"]["bleu"] += pretrained_shift
    return run


def test_the_published_main_job_run_agrees_with_itself_and_a_doctored_one_is_rejected(repo_root):
    """The main job's check against README's table cannot pass a run whose main difference has the other sign,
    or whose pretrained model scores 5 BLEU off (the published run's own numbers, doctored)."""
    import json

    from fairseq_softtopk.cli.main_job import MAIN_DIFFERENCE

    published = json.loads((repo_root / "results" / "main_job_demo" / "results.json").read_text())
    arm, ref = MAIN_DIFFERENCE
    assert comparison_markdown(compare(published, doctored(published)), "README's table")[1] is True
    for run, named in ((doctored(published, flip=MAIN_DIFFERENCE), f"{arm} BLEU"),
                       (doctored(published, pretrained_shift=5.0), "pretrained BLEU"),
                       (doctored(published, pretrained_shift=-5.0), "pretrained BLEU")):
        text, agrees = comparison_markdown(compare(published, run), "README's table")
        assert agrees is False and named in text.splitlines()[-1].split(":")[0], text
