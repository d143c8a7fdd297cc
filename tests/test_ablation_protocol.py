"""The ablation runner's longer protocol: scoring checkpoint_best (by its digest), the length penalty chosen on valid
per run, the loss terms' gradient norms and the validation BLEU read from the training log, and the report's paired
t-test over seeds (fairseq_softtopk.experiments: ablation_config, ablation_evaluation, ablation_training,
ablation_report). fairseq-generate is replaced by a fake whose BLEU depends on the length penalty."""

import json
import math
import random
from pathlib import Path

import pytest

from fairseq_softtopk.experiments import ablation_evaluation, ablation_report, scoring
from fairseq_softtopk.experiments.ablation_config import eval_settings, load_config
from fairseq_softtopk.experiments.ablation_training import read_train_stats
from fairseq_softtopk.experiments.checkpoint_integrity import CheckpointChanged, checkpoint_digest

REPO = Path(__file__).resolve().parents[1]
LONG = REPO / "configs" / "multi30k_en_de_long_finetune.yaml"


@pytest.mark.parametrize("override, message", [
    ("eval.checkpoint=first", "eval.checkpoint must be last or best"),
    ("eval.lenpen_grid=[]", "non-empty list"),
    ("eval.lenpen_grid=[1.0, 1.0]", "distinct"),
    ("eval.lenpen_grid=[0.5, .inf]", "finite"),
    ("eval.lenpen_grid=0.6", "list"),
    ("eval.subsets=[test]", "chosen on valid"),
    ("eval.generate={lenpen: 0.6}", "both set the length penalty"),
    ("eval.fixed_lenpens=[]", "fixed_lenpens must be a non-empty list"),
    ("eval.fixed_lenpens=[1.0, 1.0]", "distinct"),
    ("eval.fixed_lenpens=[true]", "finite numbers"),
    ("eval.subsets=[valid]", "decodes the subsets other than valid"),
])
def test_bad_eval_checkpoint_and_lenpen_grid_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(LONG, ["eval.lenpen_grid=[0.6, 1.0]", override] if "lenpen_grid" not in override
                    else [override])


def test_the_long_protocol_scores_checkpoint_best_at_a_length_penalty_chosen_on_valid():
    config = load_config(LONG)
    assert config["eval"]["checkpoint"] == "best" and 1.0 in config["eval"]["lenpen_grid"]
    assert config["train"]["best-checkpoint-metric"] == "bleu" and config["train"]["eval-bleu"] is True
    assert set(config["default_arms"]) == {"tf", "hard", "soft", "soft_risk"}
    risk = config["arms"]["soft_risk"]
    assert risk["beam-loss"] == "risk" and risk["beam-risk-cost"] == "bleu_points"
    # the optional hard_risk arm differs from soft_risk by the selection alone
    hard_risk = config["arms"]["hard_risk"]
    assert {**hard_risk, "topk-mode": "soft"} == risk and hard_risk["topk-mode"] == "hard"


def test_the_long_protocol_also_decodes_test_at_the_default_length_penalty():
    assert load_config(LONG)["eval"]["fixed_lenpens"] == [1.0]


def test_eval_settings_leave_unset_optional_keys_out():
    """A cache written before checkpoint and lenpen_grid existed has the same settings as a config without them."""
    before = {"beam": 5, "batch_size": None, "subsets": ["test"], "post_process": None, "detok_lang": None,
              "generate": None}
    assert eval_settings({"beam": 5, "subsets": ["test"]}) == before
    assert eval_settings({"beam": 5, "subsets": ["test"], "checkpoint": "best"}) == {**before, "checkpoint": "best"}


def _bleu_at(lenpen: float, subset: str) -> float:
    """The fake decoder's BLEU: best at lenpen 1.2 on both subsets, 1.0 and 1.4 level on valid."""
    return 40.0 - 5 * abs(lenpen - 1.2) + (2.0 if subset == "test" else 0.0)


def _fake_hypothesis(lenpen: float) -> str:
    """The fake decoder's output: longer at a larger length penalty (4 words at 1.0, 6 at 2.0)."""
    return " ".join(["h"] * round(1 + 2.5 * lenpen))


@pytest.fixture
def fake_generate(monkeypatch):
    """The decoders replaced: each decode records (checkpoint, subset, its length penalties) and writes the
    hypothesis files (one decode at one --lenpen, or one --nbest decode at several)."""
    calls = []

    def result(lenpen, subset):
        return {"bleu": _bleu_at(lenpen, subset), "chrf": 60.0, "n_sentences": 3, "reference": "ref",
                "bleu_signature": "b", "chrf_signature": "c", "hypotheses": [_fake_hypothesis(lenpen)] * 3,
                "references": ["r r r r r"] * 3}

    def evaluate(data_bin, checkpoint, ref, subset="test", beam=5, batch_size=None, post_process=None,
                 detok_lang=None, hyp_out=None, extra_args=(), keep_hypotheses=False):
        args = list(extra_args)
        lenpen = float(args[args.index("--lenpen") + 1]) if "--lenpen" in args else 1.0
        calls.append((Path(checkpoint).name, subset, (lenpen,)))
        Path(hyp_out).write_text(f"{subset} at {lenpen}\n")
        return result(lenpen, subset)

    def evaluate_at_lenpens(data_bin, checkpoint, ref, lenpens, subset="test", beam=5, batch_size=None,
                            post_process=None, detok_lang=None, hyp_outs=None, extra_args=(), keep_hypotheses=False):
        assert "--lenpen" not in extra_args
        calls.append((Path(checkpoint).name, subset, tuple(lenpens)))
        for lenpen in lenpens:
            Path(hyp_outs[lenpen]).write_text(f"{subset} at {lenpen}\n")
        return {lenpen: result(lenpen, subset) for lenpen in lenpens}

    monkeypatch.setattr(scoring, "evaluate_checkpoint", evaluate)
    monkeypatch.setattr(scoring, "evaluate_checkpoint_at_lenpens", evaluate_at_lenpens)
    monkeypatch.setattr(ablation_evaluation, "subset_size", lambda *args: 3)
    return calls


def _finished_run(run_dir: Path) -> Path:
    run_dir.mkdir()
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        (run_dir / name).write_bytes(name.encode())
    (run_dir / "done.json").write_text(json.dumps({
        "finished": "then", "checkpoint_sha256": checkpoint_digest(run_dir / "checkpoint_last.pt"),
        "checkpoint_best_sha256": checkpoint_digest(run_dir / "checkpoint_best.pt")}))
    return run_dir


def test_lenpen_is_chosen_on_valid_and_test_decoded_at_it_from_checkpoint_best(tmp_path, fake_generate):
    run = _finished_run(tmp_path / "run")
    eval_cfg = {"beam": 5, "subsets": ["valid", "test"], "checkpoint": "best", "lenpen_grid": [0.6, 1.0, 1.2, 1.4]}
    subsets = ablation_evaluation.evaluate_run(run, tmp_path, None, eval_cfg, ("src", "tgt"))
    # valid decoded once for the whole grid, test once at the choice
    assert fake_generate == [("checkpoint_best.pt", "valid", (0.6, 1.0, 1.2, 1.4)),
                             ("checkpoint_best.pt", "test", (1.2,))]
    assert subsets["valid"]["lenpen"] == subsets["test"]["lenpen"] == 1.2
    assert subsets["valid"]["bleu"] == _bleu_at(1.2, "valid") and subsets["test"]["bleu"] == _bleu_at(1.2, "test")
    assert subsets["test"]["lenpen_valid_bleu"] == {str(v): _bleu_at(v, "valid") for v in (0.6, 1.0, 1.2, 1.4)}
    assert (run / "valid.hyp").read_text() == "valid at 1.2\n" and (run / "valid.lenpen0.6.hyp").exists()
    # cached: nothing decoded again; a changed grid is scored again
    ablation_evaluation.evaluate_run(run, tmp_path, None, eval_cfg, ("src", "tgt"))
    assert len(fake_generate) == 2
    # a tie goes to the value nearest 1.0: 1.0 and 1.4 score the same on valid
    fake_generate.clear()
    tied = ablation_evaluation.evaluate_run(run, tmp_path, None, {**eval_cfg, "lenpen_grid": [1.4, 1.0]},
                                            ("src", "tgt"))
    assert _bleu_at(1.0, "valid") == _bleu_at(1.4, "valid") and tied["test"]["lenpen"] == 1.0
    assert fake_generate[-1] == ("checkpoint_best.pt", "test", (1.0,))


def test_fixed_lenpens_decode_test_at_each_untuned_value_reusing_the_chosen_one(tmp_path, fake_generate):
    run = _finished_run(tmp_path / "run")
    eval_cfg = {"beam": 5, "subsets": ["valid", "test"], "checkpoint": "best", "lenpen_grid": [0.6, 1.0, 1.2, 1.4],
                "fixed_lenpens": [1.0, 1.2, 2.0]}
    subsets = ablation_evaluation.evaluate_run(run, tmp_path, None, eval_cfg, ("src", "tgt"))
    # valid at every grid value, then test in one decode at the chosen 1.2, 1.0 and 2.0 (1.2 not twice)
    assert fake_generate[1:] == [("checkpoint_best.pt", "test", (1.2, 1.0, 2.0))]
    assert subsets["test"]["bleu"] == _bleu_at(1.2, "test") and "at_lenpen" not in subsets["valid"]
    # each untuned value with the output's length (hypothesis / reference words; the reference has 5)
    ratios = {value: round(1 + 2.5 * value) / 5 for value in (1.0, 1.2, 2.0)}
    assert ratios[1.0] < 1 < ratios[2.0]
    assert subsets["test"]["at_lenpen"] == {
        str(v): {"bleu": _bleu_at(v, "test"), "chrf": 60.0, "length_ratio": pytest.approx(ratios[v]),
                 "brevity_penalty": pytest.approx(min(1, math.exp(1 - 1 / ratios[v])))} for v in (1.0, 1.2, 2.0)}
    assert (run / "test.lenpen2.0.hyp").read_text() == "test at 2.0\n"
    assert (run / "test.hyp").read_text() == "test at 1.2\n"
    # without a grid, test is decoded at fairseq's default (1.0) and the fixed 0.6, in one decode
    fake_generate.clear()
    plain = ablation_evaluation.evaluate_run(run, tmp_path, None, {"beam": 5, "subsets": ["test"],
                                                                   "fixed_lenpens": [1.0, 0.6]}, ("src", "tgt"))
    assert fake_generate == [("checkpoint_last.pt", "test", (1.0, 0.6))]
    assert plain["test"]["at_lenpen"]["1.0"]["bleu"] == plain["test"]["bleu"] == _bleu_at(1.0, "test")


def test_a_cached_score_without_the_untuned_lengths_gets_them_from_the_hypothesis_files(tmp_path, fake_generate,
                                                                                         caplog):
    """eval.json written before the untuned length penalties' scores carried the output's length: the length is
    added from the run's hypothesis files, each checked to score as recorded, without decoding again."""
    run = _finished_run(tmp_path / "run")
    eval_cfg = {"beam": 5, "subsets": ["test"], "checkpoint": "best", "lenpen_grid": [1.0, 1.4],
                "fixed_lenpens": [1.0, 2.0]}
    refs = ["Ein Mann fährt Rad.", "Zwei Hunde spielen im Schnee.", "Eine Frau lacht."]
    at = {1.4: ["Ein Mann fährt ein Rad.", "Zwei Hunde spielen im Schnee.", "Eine Frau lacht laut."],
          1.0: ["Ein Mann fährt.", "Zwei Hunde spielen.", "Eine Frau lacht."],
          2.0: ["Ein Mann fährt Rad auf der Straße.", "Zwei Hunde spielen.", "Frau."]}
    for value, hyps in at.items():
        (run / ("test.hyp" if value == 1.4 else f"test.lenpen{value}.hyp")).write_text("".join(h + "\n" for h in hyps))
    recorded = {str(v): {"bleu": scoring.score(at[v], refs)["bleu"], "chrf": 1.0} for v in (1.0, 2.0)}
    recorded["2.0"]["bleu"] += 1  # that file is not what was scored: its length stays out
    subsets = {"test": {**scoring.score(at[1.4], refs), "hypotheses": at[1.4], "references": refs, "lenpen": 1.4,
                        "at_lenpen": recorded}}
    cache = {"settings": eval_settings(eval_cfg), "trained": "then", "subsets": subsets}
    (run / "eval.json").write_text(json.dumps(cache))
    scored = ablation_evaluation.evaluate_run(run, tmp_path, None, eval_cfg, ("src", "tgt"))
    assert fake_generate == []  # nothing decoded
    ratio = sum(len(h.replace(".", " .").split()) for h in at[1.0]) / sum(len(r.replace(".", " .").split())
                                                                          for r in refs)
    assert ratio < 1
    assert scored["test"]["at_lenpen"]["1.0"] == {**recorded["1.0"], "length_ratio": pytest.approx(ratio),
                                                  "brevity_penalty": pytest.approx(math.exp(1 - 1 / ratio))}
    assert "length_ratio" not in scored["test"]["at_lenpen"]["2.0"] and "does not score as" in caplog.text
    on_disk = json.loads((run / "eval.json").read_text())
    assert on_disk["subsets"]["test"]["at_lenpen"]["1.0"]["length_ratio"] == pytest.approx(ratio)
    assert on_disk["settings"] == cache["settings"] and on_disk["trained"] == "then"


def test_checkpoint_best_is_checked_against_its_digest_and_its_absence_is_explained(tmp_path, fake_generate):
    run = _finished_run(tmp_path / "run")
    (run / "checkpoint_best.pt").write_bytes(b"another model")
    eval_cfg = {"beam": 5, "subsets": ["test"], "checkpoint": "best"}
    with pytest.raises(CheckpointChanged, match="checkpoint_best.pt changed"):
        ablation_evaluation.evaluate_run(run, tmp_path, None, eval_cfg, ("src", "tgt"))
    # checkpoint_last is unchanged and still scores
    assert ablation_evaluation.evaluate_run(run, tmp_path, None, {**eval_cfg, "checkpoint": "last"},
                                            ("src", "tgt"))["test"]["bleu"] == _bleu_at(1.0, "test")
    (run / "checkpoint_best.pt").unlink()
    with pytest.raises(FileNotFoundError, match="only where it validates"):
        ablation_evaluation.evaluate_run(run, tmp_path, None, eval_cfg, ("src", "tgt"))
    assert fake_generate == [("checkpoint_last.pt", "test", (1.0,))]


def test_train_stats_read_the_term_gradient_norms_updates_and_validation_bleu(tmp_path):
    inner = ("2026-01-01 00:00:00 | INFO | train_inner | epoch 001:     {n} / 486 loss=1{extra}, ppl=3, "
             "num_updates={n}, lr=0.0001, gnorm={g}, clip={c}, train_wall={w}, wall=0")
    valid = ("2026-01-01 00:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 4 | nll_loss 2 | "
             "bleu {b} | num_updates {n} | best_bleu 41")
    log = tmp_path / "train.log"
    log.write_text("\n".join([
        inner.format(n=10, extra=", tf_gnorm=0.3, beam_gnorm=1.1", g=1.2, c=100, w=5),
        inner.format(n=20, extra=", tf_gnorm=None, beam_gnorm=None", g=0.5, c=0, w=6),  # nothing measured then
        inner.format(n=30, extra=", tf_gnorm=9.0, beam_gnorm=9.0", g=9.0, c=100, w=90),  # redone after the resume
        "2026-01-01 00:00:00 | INFO | fairseq.trainer | Loaded checkpoint checkpoint_last.pt (epoch 1 @ 20 updates)",
        inner.format(n=30, extra=", tf_gnorm=0.5, beam_gnorm=0.9", g=1.0, c=0, w=7),
        inner.format(n=40, extra=", tf_gnorm=0.4, beam_gnorm=1.3", g=1.4, c=100, w=8),
        valid.format(b=40.5, n=243), valid.format(b=41.0, n=486)]) + "\n")
    stats = read_train_stats(log)
    # each interval once, as last logged: the killed process's line at 30 does not count
    assert stats["tf_gnorm_median"] == 0.4 and stats["beam_gnorm_median"] == 1.1
    assert stats["gnorm_median"] == pytest.approx(1.1) and stats["clipped_percent"] == 50.0
    assert stats["train_seconds"] == 5 + 6 + 7 + 8 and stats["train_seconds_updates"] == 40
    assert stats["updates"] == 486 and stats["valid_bleu"] == [[243, 40.5], [486, 41.0]]  # the last validation
    missing = read_train_stats(tmp_path / "missing.log")
    assert missing["valid_bleu"] is None and missing["train_seconds"] is None


def test_mean_over_seeds_averages_the_updates_every_seed_has():
    from fairseq_softtopk.experiments.ablation_plot import mean_over_seeds

    curves = [[{"num_updates": 243, "bleu": 40.0}, {"num_updates": 486, "bleu": 41.0}, {"num_updates": 729}],
              [{"num_updates": 243, "bleu": 42.0}, {"num_updates": 486, "bleu": 40.0}],
              [{"num_updates": 243, "bleu": 41.0}, {"num_updates": 486, "bleu": 43.5},
               {"num_updates": 729, "bleu": 39.0}]]  # 729: not every seed has it
    assert mean_over_seeds(curves, "bleu") == [(243, 41.0), (486, 41.5)]
    assert mean_over_seeds(curves[:1], "bleu") == [(243, 40.0), (486, 41.0)]
    assert mean_over_seeds(curves + [[]], "bleu") == [] and mean_over_seeds([], "bleu") == []


@pytest.mark.parametrize("n_seeds", [2, 5])
def test_curves_draw_each_arms_mean_from_three_seeds_on(tmp_path, monkeypatch, n_seeds):
    """Five seeds in four line styles repeated one: from three seeds on each arm is one labelled line, its mean
    (the teacher-forced NLL from the pretrained point at update 0), over unlabelled per-seed curves; a run not yet
    validated (soft, seed 5) stays out of the mean."""
    from matplotlib.figure import Figure

    from fairseq_softtopk.experiments import ablation_plot

    valid = ("2026-01-01 00:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 4 | nll_loss {nll} | "
             "bleu {b} | num_updates {n} | best_bleu 41")
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "train.log").write_text(valid.format(nll=2.5, b=30, n=9000) + "\n")
    bleu = {}
    for arm_index, arm in enumerate(("tf", "soft")):
        for seed in range(1, n_seeds + 1):
            bleu[arm, seed] = [40 + arm_index + 0.1 * seed, 41 + arm_index - 0.2 * seed]
            (tmp_path / f"seed{seed}" / arm).mkdir(parents=True)
            if (arm, seed) == ("soft", 5):
                (tmp_path / f"seed{seed}" / arm / "train.log").write_text("training, not validated yet\n")
                continue
            (tmp_path / f"seed{seed}" / arm / "train.log").write_text("\n".join(
                valid.format(nll=2.4 - 0.01 * seed, b=b, n=n) for n, b in zip((243, 486), bleu[arm, seed])) + "\n")
    drawn = {}

    def capture(fig, png, **kwargs):
        for ax in fig.axes:
            drawn[ax.get_title()] = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                                     for line in ax.get_lines() if not line.get_label().startswith("_")}

    monkeypatch.setattr(Figure, "savefig", capture)
    ablation_plot.plot_curves(tmp_path, ["tf", "soft"], list(range(1, n_seeds + 1)), tmp_path / "curves.png")
    right = drawn["valid BLEU (fairseq-train --eval-bleu)"]
    if n_seeds == 2:
        assert sorted(right) == ["soft (seed 1)", "soft (seed 2)", "tf (seed 1)", "tf (seed 2)"]
        assert right["soft (seed 2)"] == ([243, 486], bleu["soft", 2])
        return
    assert sorted(right) == ["soft (mean of 4 seeds)", "tf (mean of 5 seeds)"]
    for arm, n in (("tf", 5), ("soft", 4)):
        xs, ys = right[f"{arm} (mean of {n} seeds)"]
        assert xs == [243, 486]
        assert ys == pytest.approx([sum(bleu[arm, s][i] for s in range(1, n + 1)) / n for i in (0, 1)])
        nll = 2.4 - 0.01 * (n + 1) / 2  # the mean of 2.4 - 0.01 * seed over the seeds averaged
        assert drawn["valid NLL, teacher forced"][f"{arm} (mean of {n} seeds)"] == (
            [0, 243, 486], pytest.approx([2.5, nll, nll]))


def test_best_checkpoint_update_follows_fairseqs_save_rule():
    """fairseq's save_checkpoint: ``best = max(score, best)``, then checkpoint_best is written where ``score >= best``;
    replayed here over the validations, against the function's max-then-latest reading."""
    curves = [[[243, 40.1], [486, 40.5], [729, 40.3]], [[243, 41.0], [486, 40.2], [729, 41.0], [972, 40.9]],
              [[243, 39.0]], [[243, 40.0], [486, 40.01]]]
    for curve in curves:
        best = kept = None
        for update, score in curve:
            best = score if best is None else max(score, best)
            if score >= best:
                kept = update
        assert ablation_report.best_checkpoint_update(curve) == kept
    assert ablation_report.best_checkpoint_update(None) is None


def test_paired_ttest_is_the_t_statistic_of_the_differences():
    """t = mean(d) / (sd(d) / sqrt(n)), p = 2 * (1 - F_t(|t|; n - 1)), computed here from the t distribution."""
    from scipy import stats

    base = {"1": 38.1, "2": 38.4, "3": 38.0, "4": 38.3, "5": 38.2}
    other = {"1": 38.6, "2": 38.5, "3": 38.4, "4": 38.9, "5": 38.3, "6": 50.0}  # seed 6 has no pair
    test = ablation_report.paired_ttest(base, other)
    d = [other[s] - base[s] for s in base]
    mean = sum(d) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    t = mean / (sd / math.sqrt(5))
    assert test["n_seeds"] == 5 and test["t"] == pytest.approx(t, abs=1e-3)
    assert test["p_value"] == pytest.approx(2 * stats.t.sf(abs(t), 4), abs=1e-4)
    assert test["delta_mean"] == pytest.approx(mean, abs=0.01) and test["delta_sd"] == pytest.approx(sd, abs=0.01)
    assert ablation_report.paired_ttest({"1": 1.0}, {"1": 2.0}) is None


def test_report_has_the_ttests_lenpens_gradient_norms_cost_and_validation_bleu():
    rng = random.Random(3)
    refs = [" ".join(f"w{rng.randrange(30)}" for _ in range(10)) for _ in range(60)]

    def system(p, lenpen):
        hyps = [" ".join(w if rng.random() > p else "x" for w in r.split()) for r in refs]
        out = {**scoring.score(hyps, refs), "reference": "ref", "hypotheses": hyps, "references": refs}
        return {**out, "lenpen": lenpen}

    config = {"path": "long.yaml", "stage": "scratch", "baseline": "tf", "compare_to": ["hard"],
              "model": {"arch": "a"}, "train": {"lr": 1},
              "arms": {"tf": {}, "hard": {"topk-mode": "hard"}, "soft": {}},
              "eval": {"checkpoint": "best", "lenpen_grid": [0.6, 1.0]}}
    runs = {}
    for arm, p, gnorms in (("tf", 0.5, {}), ("hard", 0.4, {"tf_gnorm_median": 0.3, "beam_gnorm_median": 0.15}),
                           ("soft", 0.3, {"tf_gnorm_median": 0.3, "beam_gnorm_median": 0.6})):
        for seed in ("1", "2", "3"):
            # wall_seconds: the last call's only (a resumed run); the cost comes from the log's train_wall
            train = {"wall_seconds": 30.0, "cpu_seconds": None, "gnorm_median": 0.5, "clipped_percent": 0.0,
                     "updates": 100, "train_seconds": 270.0 + 30 * int(seed), "train_seconds_updates": 90,
                     "valid_bleu": [[50, 30.0 + int(seed)], [100, 31.0]], **gnorms}
            test = system(p, 0.6 if seed == "2" else 1.0)
            test["at_lenpen"] = {"1.0": {"bleu": 30.0 + 0.5 * int(seed) + {"tf": 0.0, "hard": 0.2 * (int(seed) - 2),
                                                                   "soft": 1.0 + 0.1 * int(seed)}[arm],
                                          "chrf": 50.0}}
            runs.setdefault(arm, {})[seed] = {"train": train, "eval": {"test": test}}
    results = ablation_report.summarise(config, runs, ["tf", "hard", "soft"], [1, 2, 3], bootstrap_samples=50)
    soft = results["ttest"]["tf"]["soft"]["test"]
    per_seed = [results["scores"]["soft"][s]["test"]["bleu"] - results["scores"]["tf"][s]["test"]["bleu"]
                for s in ("1", "2", "3")]
    assert soft["delta_mean"] == pytest.approx(sum(per_seed) / 3, abs=0.01) and soft["delta_mean"] > 5
    assert set(results["ttest"]) == {"tf", "hard"} and "hard" not in results["ttest"]["hard"]
    markdown = ablation_report.results_markdown({**results, "data_bin": "bin"})
    assert "checkpoint_best (by the validation metric of fairseq-train)" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| soft | test |"))
    assert row.count("±") == 2  # against tf and against hard
    assert "| hard | 1.0 | 0.6 | 1.0 |" in markdown  # the length penalty per seed
    per_seed_rows = [line for line in markdown.splitlines() if line.startswith("| soft | test | ")]
    assert per_seed_rows[-1] == "| soft | test | " + " | ".join(  # BLEU / chrF of each seed as scored
        f"{results['scores']['soft'][s]['test']['bleu']:.2f} / {results['scores']['soft'][s]['test']['chrf']:.2f}"
        for s in ("1", "2", "3")) + " |"
    assert "BLEU / chrF per seed" not in ablation_report.results_markdown(
        {**ablation_report.summarise(config, {arm: {"1": by_seed["1"]} for arm, by_seed in runs.items()},
                                     ["tf", "hard", "soft"], [1], bootstrap_samples=50), "data_bin": "bin"})
    assert "| soft | 0.3 | 0.6 | 2.00 |" in markdown  # beam / token gradient norm
    assert "| hard | 100 | 3.67 |" in markdown  # seconds per update: 300, 330, 360 s over 90 updates
    assert "| hard | " in markdown and "| 330 (-) |" in markdown  # train s (no CPU s beside other runs)
    assert "| tf | 32.00 | 31.00 |" in markdown  # validation BLEU at updates 50 and 100, mean over seeds
    # checkpoint_best: seed 1 validates 31.0 twice (the later kept), seeds 2 and 3 best at update 50
    assert "| tf | 100 | 50 | 50 |" in markdown
    # untuned lenpen 1.0: soft is 1.1, 1.2, 1.3 above tf and 1.3, 1.2, 1.1 above hard (t = 1.2 / (0.1 / sqrt(3)),
    # 2 degrees of freedom)
    from scipy import stats

    p = format(round(2 * stats.t.sf(1.2 / (0.1 / math.sqrt(3)), 2), 4), ".3g")
    assert "| test | 1.0 | tf | 31.00 ± 0.50 | 50.00 ± 0.00 |  |" in markdown
    assert f"| test | 1.0 | soft | 32.20 ± 0.60 | 50.00 ± 0.00 | +1.20 ± 0.10 ({p}) | +1.20 ± 0.10 ({p}) |" in markdown


def _tokens_13a(lines):
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    tokenize = Tokenizer13a()
    return sum(len(tokenize(line).split()) for line in lines)


@pytest.mark.parametrize("cut", [0, 1, 3])
def test_output_length_is_the_token_ratio_and_the_brevity_penalty_of_corpus_bleu(cut):
    refs = ["Ein Mann, der ein Fahrrad fährt.", "Zwei Hunde spielen im Schnee!", "Eine Frau (links) lacht."]
    hyps = [" ".join(r.split()[:len(r.split()) - cut]) or "x" for r in refs] if cut else [r + " ja ." for r in refs]
    ratio = _tokens_13a(hyps) / _tokens_13a(refs)
    assert (ratio > 1) == (cut == 0)
    length = scoring.output_length(hyps, refs)
    assert length["length_ratio"] == pytest.approx(ratio)
    assert length["brevity_penalty"] == pytest.approx(1.0 if ratio >= 1 else math.exp(1 - 1 / ratio))


def test_report_gives_each_arms_output_length_on_each_subset():
    rng = random.Random(5)
    refs = {subset: [" ".join(f"w{rng.randrange(30)}" for _ in range(6 + i % 5)) + "." for i in range(40)]
            for subset in ("valid", "test")}
    config = {"path": "long.yaml", "stage": "scratch", "baseline": "tf", "model": {"arch": "a"}, "train": {},
              "arms": {"tf": {}, "soft": {}}, "eval": {"checkpoint": "best"}}
    runs, expected = {}, {}
    for arm, cut in (("tf", 0), ("soft", 1)):
        for seed in ("1", "2"):
            run = {"train": {}, "eval": {}}
            for subset, lines in refs.items():
                # soft drops its last word on seed 2 only: the table's numbers are means over the seeds
                drop = cut * (seed == "2")
                hyps = [" ".join(r.split()[:len(r.split()) - drop]) for r in lines]
                run["eval"][subset] = {**scoring.score(hyps, lines), "reference": "ref", "hypotheses": hyps,
                                       "references": lines}
                ratio = _tokens_13a(hyps) / _tokens_13a(lines)
                bp = 1.0 if ratio >= 1 else math.exp(1 - 1 / ratio)
                expected.setdefault((arm, subset), []).append((ratio, bp))
            # test at the untuned lenpen 1.0 (its length as the scoring recorded it); at 2.0 seed 1's score
            # predates the length: that column is left out
            run["eval"]["test"]["at_lenpen"] = {
                "1.0": {"bleu": 30.0, "chrf": 50.0, "length_ratio": 0.9 + 0.02 * int(seed) + 0.1 * cut,
                        "brevity_penalty": 0.8 + 0.01 * int(seed)},
                "2.0": {"bleu": 30.0, "chrf": 50.0, **({"length_ratio": 1.2, "brevity_penalty": 1.0} if seed == "2"
                                                      else {})}}
            runs.setdefault(arm, {})[seed] = run
    results = ablation_report.summarise(config, runs, ["tf", "soft"], [1, 2], bootstrap_samples=10)
    markdown = ablation_report.results_markdown({**results, "data_bin": "bin"})
    assert ("| arm | valid length | valid BP | test length | test BP | test at lenpen 1.0 length | "
            "test at lenpen 1.0 BP |") in markdown
    assert "test at lenpen 2.0 length" not in markdown
    for arm, cut in (("tf", 0), ("soft", 1)):
        cells = []
        for subset in ("valid", "test"):
            ratio, bp = (sum(v) / 2 for v in zip(*expected[arm, subset]))
            cells += [f"{ratio:.3f}", f"{bp:.3f}"]
        cells += [f"{0.93 + 0.1 * cut:.3f}", "0.815"]
        assert f"| {arm} | {' | '.join(cells)} |" in markdown
    assert "| tf | 1.000 | 1.000 | 1.000 | 1.000 | 0.930 | 0.815 |" in markdown
    assert expected["soft", "test"][1][0] < 0.9  # the cut is visible


def test_score_pretrained_needs_the_checkpoint_and_reaches_the_runner(tmp_path, monkeypatch, capsys):
    from fairseq_softtopk.cli import ablation as ablation_cli

    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(LONG), "--data-dir", str(tmp_path), "--work-dir", str(tmp_path / "w"),
                           "--score-pretrained"])
    assert exit_info.value.code == 2 and "--score-pretrained scores the --pretrained checkpoint" in capsys.readouterr().err
    seen = {}

    def fake_run(*args, **kwargs):
        seen.update(kwargs, pretrained=args[6])
        raise ValueError("stop here")

    monkeypatch.setattr(ablation_cli, "run_ablation", fake_run)
    with pytest.raises(SystemExit):
        ablation_cli.main([str(LONG), "--data-dir", str(tmp_path), "--work-dir", str(tmp_path / "w"),
                           "--pretrained", "tf.pt", "--score-pretrained"])
    assert seen["score_pretrained"] is True and seen["pretrained"] == "tf.pt"


def test_a_failed_pretrained_scoring_is_logged_when_it_fails(caplog):
    """The pretrained checkpoint is scored in a thread beside the runs: its error is logged at once (the report
    raises it only after every run has trained)."""
    import logging
    from concurrent.futures import Future

    from fairseq_softtopk.experiments.ablation_runner import _log_failure

    ok, failed = Future(), Future()
    with caplog.at_level(logging.INFO, logger="ablation"):
        ok.add_done_callback(_log_failure)
        ok.set_result({})
        assert "failed" not in caplog.text
        failed.add_done_callback(_log_failure)
        failed.set_exception(RuntimeError("fairseq-generate failed: Missing key attention_topk_backend"))
    assert "scoring the pretrained checkpoint failed" in caplog.text and "Missing key" in caplog.text
