"""Tests of the ablation (fairseq-softtopk-ablation: fairseq_softtopk.cli.ablation, and the runner's modules
ablation_runner, ablation_config, ablation_report and ablation_plot in fairseq_softtopk.experiments: configs,
reports, end to end) and of the scoring and paired bootstrap (experiments.scoring, fairseq_generate, paired_bootstrap,
fairseq-softtopk-bleu)."""

import gzip
import json
import logging
import os
import random
import sys
import types
from pathlib import Path

import pytest
import torch

from fairseq_softtopk.cli import ablation as ablation_cli
from fairseq_softtopk.cli import bleu
from fairseq_softtopk.data.toy_language_pair import write_toy_corpus
from fairseq_softtopk.experiments import (ablation_report, ablation_runner, ablation_training, fairseq_generate,
                                          run_records, scoring)
from fairseq_softtopk.experiments.ablation_config import (apply_override, config_train_args, flags_to_args, load_config,
                                                          stage_flags)
from fairseq_softtopk.experiments.ablation_plot import read_valid_curve
from fairseq_softtopk.experiments.ablation_runner import run_ablation
from fairseq_softtopk.experiments.checkpoint_integrity import checkpoint_digest
from fairseq_softtopk.experiments.fairseq_commands import PACKAGE_DIR, fairseq_command, run_logged
from fairseq_softtopk.experiments.publish import absolute_paths
from fairseq_softtopk.experiments.paired_bootstrap import paired_bootstrap

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


# ----------------------------------------------------------------------------- configs

def test_flags_to_args_booleans_none_and_lists():
    flags = {"lr": 0.5, "no-epoch-checkpoints": True, "fp16": False, "clip-norm": None,
             "adam-betas": "(0.9, 0.98)", "subsets": ["a", "b"]}
    assert flags_to_args(flags) == ["--lr", "0.5", "--no-epoch-checkpoints", "--adam-betas", "(0.9, 0.98)",
                                    "--subsets", "a", "b"]
    with pytest.raises(ValueError, match="'lr'"):
        flags_to_args({"lr": {"a": 1}})


def test_finetune_arm_inherits_pretrain_model_flags_only():
    args = config_train_args(REPO / "configs" / "toy_finetune.yaml", arm="hard")
    joined = " ".join(args)
    assert "--arch softtopk_lstm " in joined and "--encoder-embed-dim 64" in joined  # model: from toy_pretrain
    assert "--max-epoch" not in joined  # the pretrain stage's training flags are not inherited
    assert args[args.index("--lr") + 1] == "0.0002"  # fine-tuning lr, not pretraining's 0.005
    assert args[args.index("--topk-mode") + 1] == "hard"
    assert args[args.index("--teacher-forcing-ratio") + 1] == "0.8"


def test_overrides_reach_train_arms_and_pretrain():
    path = REPO / "configs" / "toy_finetune.yaml"
    config = load_config(path, ["train.max-update=7", "arms.soft.topk-epsilon=0.05", "pretrain.train.max-epoch=2",
                                "train.clip-norm=", "eval.beam=1", "train.new-flag=true"])
    soft = flags_to_args(stage_flags(config, "soft"))
    assert soft[soft.index("--max-update") + 1] == "7"
    assert soft[soft.index("--topk-epsilon") + 1] == "0.05"
    assert "--clip-norm" not in soft and "--new-flag" in soft
    assert stage_flags(config["pretrain"])["max-epoch"] == 2
    assert config["eval"]["beam"] == 1
    hard = flags_to_args(stage_flags(config, "hard"))
    assert "--topk-epsilon" not in hard  # the arm override stays in its arm


@pytest.mark.parametrize("item", ["train.max-update", "=3", "nosection.lr=1", "train.lr.x=1", "train.=1"])
def test_bad_override_is_an_error(item):
    config = load_config(REPO / "configs" / "toy_finetune.yaml")
    with pytest.raises(ValueError, match="override"):
        apply_override(config, item)


@pytest.mark.parametrize("override, message", [
    ("arms.soft.max-update=5", "update budget"),
    ("arms.hard.seed=3", "update budget"),
    ("baseline=nope", "baseline 'nope'"),
    ("stage=train", "stage must be"),
    ("train.save-dir=/tmp/x", "runner sets"),
    ("eval.bem=5", "unknown eval keys"),
    ("default_arms=[tf, nope]", "default_arms"),
    ("compare_to=[nope]", "compare_to"),
])
def test_invalid_config_is_rejected(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(REPO / "configs" / "toy_finetune.yaml", [override])


def test_missing_config_and_missing_pretrain_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "ft.yaml").write_text("stage: finetune\npretrain: gone.yaml\ntrain: {lr: 1}\n")
    with pytest.raises(FileNotFoundError, match="gone.yaml"):
        load_config(tmp_path / "ft.yaml")


def test_cli_reports_missing_config_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(tmp_path / "nope.yaml"), "--work-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "config not found" in capsys.readouterr().err


@pytest.mark.slow
def test_every_shipped_config_and_arm_parses_with_fairseq_train():
    """Catches misspelt flags (fairseq-train rejects unknown arguments): every config, every arm."""
    from fairseq import options

    import fairseq_softtopk

    fairseq_softtopk.register()  # this process imported the package before fairseq (see its __init__)
    assert len(CONFIGS) >= 8
    checked = 0
    for path in CONFIGS:
        config = load_config(path)
        for arm in [None] if config["stage"] == "pretrain" else list(config["arms"]):
            argv = ["data", *flags_to_args(stage_flags(config, arm)), "--user-dir", str(PACKAGE_DIR)]
            parsed = options.parse_args_and_arch(options.get_training_parser(), argv)
            assert parsed.arch == stage_flags(config, arm)["arch"]
            checked += 1
    assert checked >= 25
    with pytest.raises(SystemExit):  # the check above can fail
        options.parse_args_and_arch(options.get_training_parser(), [*argv, "--no-such-flag", "1"])


def _fake_data_bin(path: Path) -> Path:
    """A directory that passes ablation_runner.check_data_bin (empty files): nothing can train on it."""
    path.mkdir(parents=True)
    for name in ("dict.src.txt", "dict.tgt.txt", "train.src-tgt.src.idx", "train.src-tgt.tgt.idx"):
        (path / name).write_text("")
    return path


def test_misspelt_config_flags_are_named_with_their_section_before_any_run(tmp_path, capsys):
    """fairseq-train's parser checks every stage and arm first: a misspelt arm flag stopped the runner only
    after pretraining (a misspelt train flag of the fine-tuning stage: after the pretrain stage trained)."""
    config_path = REPO / "configs" / "toy_finetune.yaml"
    data_bin, work = _fake_data_bin(tmp_path / "bin"), tmp_path / "work"
    cases = [(["arms.soft.topk-epsilonn=0.05"], "--topk-epsilonn", f"{config_path}: arms.soft"),
             (["train.max-updat=5"], "--max-updat", f"{config_path}: train"),
             (["pretrain.train.lrr=0.1"], "--lrr", f"{REPO / 'configs' / 'toy_pretrain.yaml'}: train"),
             (["arms.soft.topk-mode=medium"], "invalid choice: 'medium'", f"{config_path}: arms.soft")]
    for overrides, flag, section in cases:
        with pytest.raises(ValueError) as error:
            run_ablation(load_config(config_path, overrides), data_bin, work)
        assert flag in str(error.value) and f"(set in {section}" in str(error.value), str(error.value)
        assert not work.exists()  # nothing ran, nothing was written
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(config_path), "--data-bin", str(data_bin), "--work-dir", str(work),
                       "--set", "arms.hard.topk-modee=hard"])
    assert exit_info.value.code == 2
    assert "--topk-modee (set in" in capsys.readouterr().err and not work.exists()


@pytest.mark.parametrize("args, message", [
    (["--seeds", "3", "1", "3"], "--seeds: seeds [3] are given more than once (3 1 3)"),
    (["--jobs", "0"], "--jobs: runs trained at the same time must be an integer >= 1, got 0"),
    (["--jobs", "-2"], "--jobs: runs trained at the same time must be an integer >= 1, got -2"),
    (["--work-dir", "{file}"], "--work-dir: work directory {file} is a file")])
def test_bad_seeds_jobs_and_work_dir_are_one_line_errors(tmp_path, capsys, args, message):
    """Duplicate seeds trained one run twice over; --jobs 0 was taken (as one); a file as work directory ended in a
    traceback."""
    file = tmp_path / "notes.txt"
    file.write_text("not a directory")
    args = [arg.format(file=file) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(REPO / "configs" / "toy_finetune.yaml"), "--data-bin", str(tmp_path / "bin"),
                           "--work-dir", str(tmp_path / "work"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message.format(file=file) in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match=r"seeds \[1, 2\] are given more than once"):
        run_ablation(load_config(REPO / "configs" / "toy_finetune.yaml"), _fake_data_bin(tmp_path / "bin"),
                     tmp_path / "work", seeds=[1, 2, 2, 1])
    with pytest.raises(ValueError, match=r"runs trained at the same time must be an integer >= 1, got 0"):
        run_ablation(load_config(REPO / "configs" / "toy_finetune.yaml"), tmp_path / "bin", tmp_path / "work", jobs=0)
    assert not (tmp_path / "work").exists()


def test_a_pretrained_checkpoint_whose_tensor_bytes_changed_is_refused_before_anything_runs(tmp_path, capsys):
    """--pretrained with bytes overwritten inside a tensor (same size, the zip's CRC-32 wrong; torch loads it): the
    arms were fine-tuned from it and --score-pretrained scored it; now one line names it, and nothing runs."""
    from conftest import overwrite_tensor_bytes

    data_bin, work = _fake_data_bin(tmp_path / "bin"), tmp_path / "work"
    pretrained = tmp_path / "tf.pt"
    torch.save({"model": {"w": torch.arange(4096.0)}}, pretrained)
    member = overwrite_tensor_bytes(pretrained)
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(REPO / "configs" / "toy_finetune.yaml"), "--data-bin", str(data_bin), "--work-dir",
                           str(work), "--pretrained", str(pretrained), "--score-pretrained"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"{pretrained} is not a complete checkpoint: its member {member} fails its CRC-32 check" in err
    assert err.rstrip().endswith("Nothing was trained or scored: pass a whole copy of it as --pretrained.")
    assert not work.exists()


def test_a_work_directory_under_a_file_is_one_line(tmp_path, capsys):
    """--work-dir under a regular file (refused even as root) ended in a NotADirectoryError traceback."""
    file = tmp_path / "notes.txt"
    file.write_text("not a directory")
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(REPO / "configs" / "toy_finetune.yaml"), "--data-bin", str(tmp_path / "bin"),
                           "--work-dir", str(file / "work")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.strip().endswith(f"--work-dir: work directory {file / 'work'} cannot be created: {file} is a file, not "
                                f"a directory")
    assert file.read_text() == "not a directory"


def test_a_work_directory_without_write_permission_is_one_line(tmp_path, capsys):
    """A work directory (or, while it is missing, its parent) this user cannot write ended in a PermissionError
    traceback; found by trying to create a file, as os.access says yes to root whatever the mode."""
    if os.geteuid() == 0:
        pytest.skip("root writes into a directory whatever its mode: this case needs a user that file modes bind")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    for work, what in ((locked / "work", f"be created: creating a file in {locked}"),
                       (locked, "be written: creating a file in it")):
        with pytest.raises(SystemExit) as exit_info:
            ablation_cli.main([str(REPO / "configs" / "toy_finetune.yaml"), "--data-bin", str(tmp_path / "bin"),
                               "--work-dir", str(work)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
        assert f"--work-dir: work directory {work} cannot {what} failed (Permission denied)" in err
    assert not list(locked.iterdir())


BEAMGRAD_INSTALL = "pip install --no-build-isolation beamgrad==2.3.0"


def test_requesting_only_the_beamgrad_arm_without_beamgrad_is_an_error_naming_it(tmp_path, monkeypatch, capsys):
    """Without beamgrad, an ablation of the beamgrad arm alone (the baseline is always added) refuses before
    anything runs, naming the arm and the install command; with beamgrad importable the arm is kept."""
    config_path = REPO / "configs" / "multi30k_en_de_risk_ablation.yaml"
    data_bin, work = _fake_data_bin(tmp_path / "bin"), tmp_path / "work"
    monkeypatch.setitem(sys.modules, "beamgrad", None)  # import beamgrad raises ImportError
    with pytest.raises(ValueError) as error:
        run_ablation(load_config(config_path), data_bin, work, arms=["beamgrad_mrt"])
    message = str(error.value)
    assert "none of the requested arms can run here: arm 'beamgrad_mrt': " in message
    assert "needs the optional package beamgrad" in message and BEAMGRAD_INSTALL in message
    assert not work.exists()
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(config_path), "--data-bin", str(data_bin), "--work-dir", str(work),
                           "--arms", "beamgrad_mrt"])
    assert exit_info.value.code == 2 and BEAMGRAD_INSTALL in capsys.readouterr().err and not work.exists()
    config = load_config(config_path)
    assert ablation_runner.select_arms(config, ["tf", "beamgrad_mrt"]) == (["tf"], {
        "beamgrad_mrt": message.split("arm 'beamgrad_mrt': ", 1)[1]})
    monkeypatch.setitem(sys.modules, "beamgrad", types.ModuleType("beamgrad"))
    assert ablation_runner.select_arms(config, ["beamgrad_mrt"]) == (["tf", "beamgrad_mrt"], {})


def test_a_work_directory_with_other_flags_names_each_flag_with_both_values(tmp_path):
    """The refusal to mix two settings in one run directory lists flag names with the earlier and the new
    value (it listed bare values from both argument lists)."""
    save_dir = tmp_path / "run"
    flags = {"arch": "softtopk_lstm_tiny", "lr": 0.005, "max-update": 8, "no-epoch-checkpoints": True}
    earlier = ["data", *flags_to_args({"required-batch-size-multiple": 1, "log-format": "simple", **flags}),
               "--save-dir", str(save_dir)]
    save_dir.mkdir()
    (save_dir / "run.json").write_text(json.dumps({"args": earlier}))
    changed = {**flags, "lr": 0.1, "no-epoch-checkpoints": False, "clip-norm": 1.0}
    with pytest.raises(ValueError) as error:
        ablation_training.train_run(tmp_path / "other_data", changed, save_dir)
    message = str(error.value)
    assert "--lr: 0.005 -> 0.1" in message
    assert "--no-epoch-checkpoints: (set) -> (not set)" in message
    assert "--clip-norm: (not set) -> 1.0" in message
    assert "--max-update" not in message and "--arch" not in message  # unchanged flags are not listed


def _binarised_like(path: Path, seed: int) -> Path:
    """A fairseq-preprocess directory's files (dictionaries and data file sizes the same for every ``seed``, as
    for two corpora of one size binarised with one dictionary; index files of train, valid and test whose contents
    depend on ``seed``): what the fingerprint reads."""
    rng = random.Random(seed)
    path.mkdir(parents=True)
    for lang in ("src", "tgt"):
        (path / f"dict.{lang}.txt").write_text("a 1\nb 1\n")
        for split in ("train", "valid", "test"):
            (path / f"{split}.src-tgt.{lang}.idx").write_bytes(bytes(rng.randrange(256) for _ in range(64)))
            (path / f"{split}.src-tgt.{lang}.bin").write_bytes(bytes(200))
    return path


class _Stopped(Exception):
    """Stands for a stop in the middle of training (fairseq-train left checkpoint_last.pt)."""


@pytest.fixture
def training_stand_in(monkeypatch):
    """ablation_training._train replaced: each call appends its data directory to the returned list, writes
    checkpoint_last.pt and stops (raises _Stopped) while ``stops`` holds True, else finishes."""
    calls, stops = [], [True]

    def train(args, save_dir, verbose, record_child):
        calls.append(args[0])
        torch.save({"model": {"w": torch.zeros(3)}}, save_dir / "checkpoint_last.pt")
        if stops[0]:
            raise _Stopped()

    monkeypatch.setattr(ablation_training, "_train", train)
    return calls, stops


def test_a_run_is_not_resumed_nor_reported_on_other_data(tmp_path, training_stand_in):
    """A run stopped and rerun with --data-bin of another corpus (the same dictionaries and sizes) resumed from its
    checkpoint_last.pt and was marked done and scored after updates on both. Its data's fingerprint is recorded
    when it starts: the rerun on other data is refused naming both directories and fingerprints (nothing trains);
    on its own data (a copy elsewhere too) it resumes; finished, it is still refused on other data."""
    calls, stops = training_stand_in
    first, other = _binarised_like(tmp_path / "first", 1), _binarised_like(tmp_path / "other", 2)
    run, flags = tmp_path / "work" / "seed1" / "tf", {"arch": "softtopk_lstm_tiny", "max-update": 60}
    with pytest.raises(_Stopped):
        ablation_training.train_run(first, flags, run)
    with pytest.raises(ValueError) as error:
        ablation_training.train_run(other, flags, run)
    message = str(error.value)
    recorded = json.loads((run / "data.json").read_text())
    assert recorded["data_bin"] == str(first) and set(recorded["files"]) == {
        f"{name}.{lang}.{ext}" for name in ("dict", "train.src-tgt", "valid.src-tgt") for lang in ("src", "tgt")
        for ext in (("txt",) if name == "dict" else ("idx", "bin"))}  # test is not read in training
    assert message.startswith(f"{run} was started on other data: {first} (fingerprint {recorded['sha256'][:12]}), "
                              f"not {other} (fingerprint ")
    assert "differing: train.src-tgt.src.idx, train.src-tgt.tgt.idx, valid.src-tgt.src.idx, valid.src-tgt.tgt.idx); " \
           "nothing was trained or scored. Pass the data it started on as --data-bin" in message
    assert calls == [str(first)] and "\n" not in message
    import shutil

    shutil.copytree(first, tmp_path / "copy")  # the same corpus elsewhere: the same run
    stops[0] = False
    assert ablation_training.train_run(tmp_path / "copy", flags, run)["checkpoint_sha256"]
    assert calls == [str(first), str(tmp_path / "copy")]
    with pytest.raises(ValueError, match="was started on other data"):  # finished: not reported on other data
        ablation_training.train_run(other, flags, run)
    (tmp_path / "first" / "test.src-tgt.src.idx").write_bytes(b"another test set")  # not read in training
    assert ablation_training.train_run(first, flags, run)["checkpoint_sha256"]


def test_a_run_from_before_fingerprints_resumes_and_records_its_data(tmp_path, training_stand_in):
    """A run directory without data.json (an older work directory, or records restored by run_records, which keep
    none) still resumes, and records the fingerprint then; a finished one is reported without one."""
    calls, stops = training_stand_in
    first, other = _binarised_like(tmp_path / "first", 1), _binarised_like(tmp_path / "other", 2)
    run, flags = tmp_path / "work" / "seed1" / "tf", {"arch": "softtopk_lstm_tiny", "max-update": 60}
    with pytest.raises(_Stopped):
        ablation_training.train_run(first, flags, run)
    (run / "data.json").unlink()
    with pytest.raises(_Stopped):
        ablation_training.train_run(first, flags, run)
    assert calls == [str(first)] * 2 and json.loads((run / "data.json").read_text())["data_bin"] == str(first)
    with pytest.raises(ValueError, match="was started on other data"):
        ablation_training.train_run(other, flags, run)
    stops[0] = False
    ablation_training.train_run(first, flags, run)
    (run / "data.json").unlink()  # finished, as restored from records: skipped, nothing recorded
    assert ablation_training.train_run(other, flags, run)["checkpoint_sha256"]
    assert calls == [str(first)] * 3 and not (run / "data.json").exists()


# ----------------------------------------------------------------------------- bootstrap

@pytest.fixture
def synthetic_corpus():
    """300 references of 12 words, a baseline with half the words replaced and a clearly better
    system with a fifth replaced (seeded)."""
    rng = random.Random(7)
    words = [f"w{i}" for i in range(50)]
    refs = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)]

    def corrupt(line, p):
        return " ".join(w if rng.random() > p else "x" for w in line.split())

    return refs, [corrupt(r, 0.5) for r in refs], [corrupt(r, 0.2) for r in refs], [corrupt(r, 0.5) for r in refs]


def test_resample_statistics_reproduce_sacrebleu_corpus_scores(synthetic_corpus):
    """Summed per-sentence statistics of a resample give sacrebleu's score of that resampled corpus."""
    import numpy as np
    import sacrebleu

    from fairseq_softtopk.experiments.paired_bootstrap import BOOTSTRAP_METRICS

    refs, base, _, _ = synthetic_corpus
    refs = refs[:40] + ["Ein Mann.", "Zwei Hunde spielen im Schnee, nicht im Wasser!", "ja"]
    hyps = base[:40] + ["Ein Mann", "", "Zwei Hunde laufen im Schnee."]  # empty and too short for 6-grams
    metrics = {"bleu": sacrebleu.metrics.BLEU(), "chrf": sacrebleu.metrics.CHRF()}
    rng = np.random.default_rng(0)
    for draw in (np.arange(len(refs)), rng.integers(0, len(refs), len(refs)), rng.integers(0, len(refs), 5)):
        weights = np.bincount(draw, minlength=len(refs)).astype(np.float64)
        for name, (statistics, score) in BOOTSTRAP_METRICS.items():
            expected = metrics[name].corpus_score([hyps[i] for i in draw], [[refs[i] for i in draw]]).score
            assert score(weights @ statistics(hyps, refs)) == pytest.approx(expected, abs=1e-9), name


def test_bootstrap_delta_is_the_difference_of_the_scores_as_reported(synthetic_corpus):
    """The difference is taken of the rounded scores the tables show, so that a mean of differences agrees with
    the difference of the shown scores (rounding the raw difference instead is off by 0.01 on some pairs)."""
    import sacrebleu

    refs, base, better, _ = synthetic_corpus
    bleu, raw_rounding_differs = sacrebleu.metrics.BLEU(), 0
    for i in range(0, 300, 10):  # systems between the baseline and the better one
        system = better[:i] + base[i:]
        result = paired_bootstrap(base, system, refs, n_samples=2)["bleu"]
        raw_base = bleu.corpus_score(base, [refs]).score
        raw_system = bleu.corpus_score(system, [refs]).score
        assert (result["baseline"], result["system"]) == (round(raw_base, 2), round(raw_system, 2))
        assert result["delta"] == round(round(raw_system, 2) - round(raw_base, 2), 2)
        raw_rounding_differs += result["delta"] != round(raw_system - raw_base, 2)
    assert raw_rounding_differs  # the corpus has pairs where the two roundings disagree


def test_bootstrap_identical_systems_p_is_one(synthetic_corpus):
    refs, base, _, _ = synthetic_corpus
    result = paired_bootstrap(base, list(base), refs, n_samples=200)
    for metric in ("bleu", "chrf"):
        assert result[metric]["delta"] == 0.0
        assert result[metric]["p_value"] == pytest.approx(1.0)
        assert result[metric]["delta_ci95"] == [0.0, 0.0]


def test_bootstrap_clearly_better_system_small_p(synthetic_corpus):
    refs, base, better, _ = synthetic_corpus
    result = paired_bootstrap(base, better, refs, n_samples=200)
    for metric in ("bleu", "chrf"):
        assert result[metric]["delta"] > 10
        assert result[metric]["p_value"] < 0.02
        lo, hi = result[metric]["delta_ci95"]
        assert 0 < lo < result[metric]["delta"] < hi
        lo, hi = result[metric]["system_ci95"]
        assert lo < result[metric]["system"] < hi
    worse = paired_bootstrap(better, base, refs, n_samples=200)  # significance both ways
    assert worse["bleu"]["delta"] < -10 and worse["bleu"]["p_value"] < 0.02


def test_bootstrap_same_quality_not_significant_and_seeded(synthetic_corpus):
    refs, base, _, other = synthetic_corpus
    first = paired_bootstrap(base, other, refs, n_samples=300, seed=3)
    assert first == paired_bootstrap(base, other, refs, n_samples=300, seed=3)
    assert first["bleu"]["p_value"] > 0.05
    lo, hi = first["bleu"]["delta_ci95"]
    assert lo < 0 < hi


def test_bootstrap_rejects_mismatched_lengths(synthetic_corpus):
    refs, base, better, _ = synthetic_corpus
    with pytest.raises(ValueError, match="equal"):
        paired_bootstrap(base[:-1], better, refs)


def test_parse_targets_in_corpus_order_and_gaps_are_errors():
    from fairseq_softtopk.experiments.fairseq_generate import parse_targets

    stdout = "S-1\tb\nT-1\tB b\nH-1\t-0.1\tx\nT-0\tA a\nD-0\t-0.2\ty\n"
    assert parse_targets(stdout) == ["A a", "B b"]
    with pytest.raises(ValueError, match="not 0..1"):
        parse_targets("T-0\ta\nT-2\tc\n")


def test_nbest_candidates_are_ranked_at_each_length_penalty_as_fairseq_normalises():
    """parse_nbest reads each --nbest candidate's score (its D- line) and length (its P- line: tokens with EOS);
    best_at_lenpen takes the highest score / length ** lenpen, the first printed of a tie."""
    from fairseq_softtopk.experiments.fairseq_generate import best_at_lenpen, parse_nbest

    stdout = ("S-1\tq\nT-1\tr\n"
              "H-1\t-2.0\ta b\nD-1\t-2.0\tA b\nP-1\t-1.0 -0.5 -0.5\n"
              "H-1\t-3.0\tc d e f g\nD-1\t-3.0\tC d e f g\nP-1\t-1.0 -1.0 -0.5 -0.25 -0.125 -0.125\n"
              "H-0\t-1.0\tz\nD-0\t-1.0\tZ\nP-0\t-0.5 -0.5\nH-0\t-1.0\ty\nD-0\t-1.0\tY\nP-0\t-0.75 -0.25\n")
    candidates = parse_nbest(stdout, 2)
    assert candidates == [[(-1.0, 2, "Z"), (-1.0, 2, "Y")], [(-2.0, 3, "A b"), (-3.0, 6, "C d e f g")]]
    # -2 / 3 ** p against -3 / 6 ** p: the longer candidate wins above p = log(1.5) / log(2) = 0.585
    assert [best_at_lenpen(candidates[1], p) for p in (0.0, 0.5, 0.6, 1.0, 2.0)] == ["A b"] * 2 + ["C d e f g"] * 3
    assert best_at_lenpen(candidates[0], 1.0) == "Z"
    with pytest.raises(ValueError, match=r"no hypotheses for ids \[2\]"):
        parse_nbest(stdout, 3)
    with pytest.raises(ValueError, match="P- line of sentence 0 without its D- line"):
        parse_nbest("P-0\t-0.5\n", 1)
    with pytest.raises(ValueError, match="--nbest in the fairseq-generate arguments"):
        scoring.evaluate_checkpoint_at_lenpens("bin", "checkpoint.pt", None, [1.0], extra_args=["--nbest", "2"])


@pytest.mark.slow
def test_one_nbest_decode_gives_the_hypotheses_of_a_decode_at_each_length_penalty(micro, tmp_path):
    """The lenpen grid from one fairseq-generate --nbest (scoring.evaluate_checkpoint_at_lenpens) against
    fairseq-generate --lenpen at each value: the same hypotheses, scores and hypothesis files."""
    root, _, _ = micro
    checkpoint, ref = str(root / "work" / "seed1" / "soft" / "checkpoint_last.pt"), str(root / "raw" / "test.tgt")
    lenpens = [0.0, 1.0, 3.0]
    hyp_outs = {lenpen: str(tmp_path / f"test.lenpen{lenpen}.hyp") for lenpen in lenpens}
    together = scoring.evaluate_checkpoint_at_lenpens(str(root / "bin"), checkpoint, ref, lenpens, beam=4,
                                                      hyp_outs=hyp_outs, keep_hypotheses=True)
    for lenpen in lenpens:
        alone = scoring.evaluate_checkpoint(str(root / "bin"), checkpoint, ref, beam=4, keep_hypotheses=True,
                                            extra_args=["--lenpen", str(lenpen)])
        assert together[lenpen] == alone, lenpen
        assert Path(hyp_outs[lenpen]).read_text() == "".join(line + "\n" for line in alone["hypotheses"])
    # the penalty changes the choice here: the comparison above could tell a wrong ranking
    assert together[0.0]["hypotheses"] != together[3.0]["hypotheses"]


def test_evaluate_refuses_a_reference_of_another_length_before_translating(toy_data_bin, tmp_path, monkeypatch,
                                                                          capsys):
    """A reference file shorter than the subset: the error names the file and both counts, and comes before
    fairseq-generate (it came after generation, and blamed fairseq for dropping inputs)."""
    raw, data_bin = toy_data_bin
    lines = (raw / "test.tgt").read_text(encoding="utf-8").splitlines()
    short = tmp_path / "short.tgt"
    short.write_text("".join(line + "\n" for line in lines[:-3]), encoding="utf-8")
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({}, checkpoint)  # a whole checkpoint file: an empty one is refused before translating

    def generate(*args, **kwargs):
        raise AssertionError("fairseq-generate ran")

    monkeypatch.setattr(scoring, "run_fairseq_generate", generate)
    with pytest.raises(ValueError) as error:
        scoring.evaluate_checkpoint(str(data_bin), str(checkpoint), str(short), subset="test")
    message = str(error.value)
    assert str(short) in message and f"{len(lines) - 3} lines" in message and f"{len(lines)} sentences" in message
    with pytest.raises(SystemExit) as exit_info:
        bleu.main([str(data_bin), str(checkpoint), "--ref", str(short)])
    assert exit_info.value.code == 2 and str(short) in capsys.readouterr().err
    with pytest.raises(AssertionError, match="fairseq-generate ran"):  # the right reference passes the check
        scoring.evaluate_checkpoint(str(data_bin), str(checkpoint), str(raw / "test.tgt"), subset="test")


def _dictionaries_only(tmp_path: Path) -> Path:
    """A data directory with dictionaries and no binarised subset (its size cannot be read)."""
    data = tmp_path / "bin"
    data.mkdir(exist_ok=True)
    for lang in ("src", "tgt"):
        (data / f"dict.{lang}.txt").write_text("a 1\n", encoding="utf-8")
    return data


def test_evaluate_names_the_reference_when_every_sentence_was_translated(tmp_path, monkeypatch):
    """Where the subset's size cannot be read beforehand, a complete translation of another number of
    sentences than the reference has lines is the reference's fault, and the error says so."""
    ref = tmp_path / "ref.txt"
    ref.write_text("a\nb\nc\n", encoding="utf-8")
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({}, checkpoint)  # a whole checkpoint file: an empty one is refused before translating
    monkeypatch.setattr(scoring, "run_fairseq_generate",
                        lambda *args, **kwargs: "D-1\t-0.1\tb\nD-0\t-0.2\ta\n")
    with pytest.raises(ValueError, match=rf"reference file {ref} has 3 lines but fairseq-generate translated all 2"):
        scoring.evaluate_checkpoint(str(_dictionaries_only(tmp_path)), str(checkpoint), str(ref))


def _fake_eval(hypotheses, references):
    from fairseq_softtopk.experiments.scoring import score

    return {**score(hypotheses, references), "reference": "refs.txt", "hypotheses": hypotheses,
            "references": references}


@pytest.mark.parametrize("cuda, expected", [(False, ["--batch-size", "64", "--cpu"]), (True, ["--batch-size", "256"])])
def test_generation_batch_defaults_to_the_device(monkeypatch, cuda, expected):
    """fairseq-generate gets 64 sentences a batch on a CPU and 256 on a GPU unless told."""
    import subprocess

    calls = []

    def fake_run(command, **kwargs):
        calls.append([str(arg) for arg in command])
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(fairseq_generate, "_has_cuda", lambda: cuda)
    monkeypatch.setattr(fairseq_generate, "run_captured", fake_run)
    fairseq_generate.run_fairseq_generate("bin", "ckpt.pt")
    fairseq_generate.run_fairseq_generate("bin", "ckpt.pt", batch_size=8)
    first, second = calls
    at = first.index("--batch-size")
    assert first[at:at + 2] == expected[:2] and ("--cpu" in first) == (not cuda)
    assert second[second.index("--batch-size") + 1] == "8"


def test_summary_over_seeds_mean_spread_and_per_seed_bootstrap(synthetic_corpus):
    """Two seeds, two arms, without fairseq: the report's numbers come from the per-seed scores."""
    refs, base, better, other = synthetic_corpus
    config = {"path": "x.yaml", "stage": "scratch", "baseline": "tf", "model": {"arch": "a"}, "train": {"lr": 1},
              "arms": {"tf": {}, "soft": {"topk-mode": "soft"}}}
    train = {"wall_seconds": 10.0, "cpu_seconds": 8.0, "gnorm_median": 0.5, "clipped_percent": 20.0}
    runs = {"tf": {"1": {"train": train, "eval": {"test": _fake_eval(base, refs)}},
                   "2": {"train": train, "eval": {"test": _fake_eval(other, refs)}}},
            "soft": {"1": {"train": train, "eval": {"test": _fake_eval(better, refs)}},
                     "2": {"train": train, "eval": {"test": _fake_eval(better, refs)}}}}
    results = ablation_report.summarise(config, runs, ["tf", "soft"], [1, 2], bootstrap_samples=100)
    tf_bleu = [runs["tf"][s]["eval"]["test"]["bleu"] for s in ("1", "2")]
    assert results["summary"]["tf"]["test"]["bleu_mean"] == pytest.approx(sum(tf_bleu) / 2, abs=0.01)
    assert results["summary"]["tf"]["test"]["bleu_sd"] == pytest.approx(abs(tf_bleu[0] - tf_bleu[1]) / 2 ** 0.5,
                                                                        abs=0.01)
    assert results["summary"]["soft"]["test"]["bleu_sd"] == 0.0  # the same hypotheses twice
    deltas = [results["bootstrap"]["soft"][s]["test"]["bleu"]["delta"] for s in ("1", "2")]
    assert deltas == pytest.approx([runs["soft"][s]["eval"]["test"]["bleu"] - tf_bleu[i]
                                    for i, s in enumerate(("1", "2"))], abs=0.02)
    markdown = ablation_report.results_markdown({**results, "data_bin": "bin"})
    cells = next(line for line in markdown.splitlines() if line.startswith("| soft |")).split(" | ")
    assert cells[1].endswith(" ± 0.00") and cells[3].startswith("+") and " ± " in cells[3]  # means ± sd
    assert cells[4] == "0.0198, 0.0198"  # one p per seed: 2 / (100 + 1) for a clearly better system
    assert cells[7] == "0.5 (20%)"
    assert "| ΔBLEU vs tf (mean ± sd) | p per seed |" in markdown


def test_read_valid_curve_keeps_last_value_of_resumed_runs(tmp_path):
    log = tmp_path / "train.log"
    line = ("2026-01-01 00:00:00 | INFO | valid | epoch 001 | valid on 'valid' subset | loss {loss} | "
            "nll_loss {nll} | ppl 9 | num_updates {n}")
    log.write_text("\n".join([line.format(loss=5, nll=4, n=10), line.format(loss=4, nll=3, n=20),
                              "noise | valid on 'test' subset | loss 1 | num_updates 20",
                              line.format(loss=3.5, nll=2.5, n=20)]) + "\n")
    assert read_valid_curve(log) == [{"num_updates": 10, "loss": 5.0, "nll_loss": 4.0},
                                     {"num_updates": 20, "loss": 3.5, "nll_loss": 2.5}]
    assert read_valid_curve(tmp_path / "missing.log") == []


# ----------------------------------------------------------------------------- end to end

TINY_PRETRAIN = """
description: tiny pretrain (tests)
stage: pretrain
model: {arch: softtopk_lstm_tiny}
train: {criterion: soft_beam_search, teacher-forcing-ratio: 1.0, optimizer: adam, lr: 0.01, batch-size: 32,
        max-update: 30, num-workers: 0, no-epoch-checkpoints: true, log-interval: 10}
"""
TINY_FINETUNE = """
description: tiny ablation (tests)
stage: finetune
pretrain: pretrain.yaml
baseline: tf
compare_to: [hard]
default_arms: [tf, hard, soft]
notes: [a test run]
train: {criterion: soft_beam_search, train-beam: 2, optimizer: adam, lr: 0.005, batch-size: 32, max-update: 8,
        validate-interval-updates: 4, save-interval-updates: 4, keep-interval-updates: 2,
        no-epoch-checkpoints: true, num-workers: 0, log-interval: 4}
arms:
  tf: {teacher-forcing-ratio: 1.0}
  hard: {topk-mode: hard}
  soft: {topk-mode: soft}
eval: {beam: 2, subsets: [test]}
"""
ARMS = ("tf", "hard", "soft")


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A finished micro ablation (tiny corpus, softtopk_lstm_tiny, 8 updates per arm)."""
    root = tmp_path_factory.mktemp("ablation")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        write_toy_corpus(root / "raw", splits={"train": (300, 11), "valid": (30, 12), "test": (30, 13)})
        run_logged(fairseq_command("preprocess", [
            "--source-lang", "src", "--target-lang", "tgt", "--trainpref", root / "raw" / "train",
            "--validpref", root / "raw" / "valid", "--testpref", root / "raw" / "test",
            "--destdir", root / "bin", "--workers", "1"]), echo=False)
        (root / "pretrain.yaml").write_text(TINY_PRETRAIN)
        (root / "finetune.yaml").write_text(TINY_FINETUNE)
        config = load_config(root / "finetune.yaml")
        results = run_ablation(config, root / "bin", root / "work", ref_dir=root / "raw", bootstrap_samples=200)
        yield root, config, results


def _fingerprint(run_dir: Path) -> dict:
    return {name: ((run_dir / name).stat().st_mtime_ns, (run_dir / name).stat().st_size)
            for name in ("train.log", "checkpoint_last.pt", "done.json", "eval.json")}


@pytest.mark.slow
def test_micro_ablation_writes_results_table_and_curves(micro):
    root, _, results = micro
    work = root / "work"
    on_disk = json.loads((work / "results.json").read_text())
    assert on_disk["arms"] == list(ARMS) and on_disk["baseline"] == "tf"
    for arm in ("pretrained", *ARMS):
        test = on_disk["summary"][arm]["test"]
        assert 0.0 <= test["bleu_mean"] <= 100.0 and 0.0 < test["chrf_mean"] <= 100.0
    for arm in ("hard", "soft"):
        boot = on_disk["bootstrap"][arm]["1"]["test"]["bleu"]
        assert 0.0 < boot["p_value"] <= 1.0 and boot["delta_ci95"][0] <= boot["delta_ci95"][1]
    assert "tf" not in on_disk["bootstrap"]
    # compare_to: every other arm (the baseline too) against hard, with hard's own hypotheses
    against_hard = on_disk["bootstrap_vs"]["hard"]
    assert set(against_hard) == {"tf", "soft"}
    soft_vs_hard = against_hard["soft"]["1"]["test"]["bleu"]
    scores = on_disk["scores"]
    assert soft_vs_hard["delta"] == pytest.approx(scores["soft"]["1"]["test"]["bleu"] - scores["hard"]["1"]["test"]["bleu"],
                                                  abs=0.01)
    assert against_hard["tf"]["1"]["test"]["bleu"]["delta"] == pytest.approx(
        -on_disk["bootstrap"]["hard"]["1"]["test"]["bleu"]["delta"], abs=0.01)
    assert on_disk["signatures"]["bleu"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert on_disk["scores"]["tf"]["1"]["test"]["reference"] == str(root / "raw" / "test.tgt")
    # equal budgets: every arm stopped at update 8, started from the pretrained checkpoint
    for arm in ARMS:
        log = (work / "seed1" / arm / "train.log").read_text()
        assert "loading pretrained model from" in log
        assert read_valid_curve(work / "seed1" / arm / "train.log")[-1]["num_updates"] == 8
        assert len((work / "seed1" / arm / "test.hyp").read_text().splitlines()) == 30
        # fairseq-train validated: its checkpoint_best is recorded too (eval.checkpoint best may score it)
        done = json.loads((work / "seed1" / arm / "done.json").read_text())
        assert done["checkpoint_best_sha256"] == checkpoint_digest(work / "seed1" / arm / "checkpoint_best.pt")
    markdown = (work / "results.md").read_text()
    for row in ("| pretrained (no fine-tuning) |", "| tf (baseline) |", "| hard |", "| soft |", "a test run",
                "Against `hard` (test):"):
        assert row in markdown
    assert (work / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (work / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_stopped_run_is_not_resumed_on_another_corpus_with_the_same_dictionaries(micro, tmp_path):
    """(Before the next test, which resumes the fixture's soft arm from its update-4 checkpoint.) The micro
    ablation's soft arm, in a copy, stopped at update 4, rerun with --data-bin of another corpus binarised with the
    same dictionaries: it resumed from checkpoint_last.pt, trained the remaining updates on the other corpus and was
    marked done and scored. Now it is refused, naming both directories, before anything trains."""
    import shutil

    root, config, _ = micro
    work = tmp_path / "work"
    shutil.copytree(root / "work", work)
    soft = work / "seed1" / "soft"
    (soft / "checkpoint_1_4.pt").replace(soft / "checkpoint_last.pt")
    (soft / "done.json").unlink()
    log = (soft / "train.log").read_text()
    write_toy_corpus(tmp_path / "raw", splits={"train": (300, 21), "valid": (30, 22), "test": (30, 23)})
    run_logged(fairseq_command("preprocess", [
        "--source-lang", "src", "--target-lang", "tgt", "--trainpref", tmp_path / "raw" / "train",
        "--validpref", tmp_path / "raw" / "valid", "--testpref", tmp_path / "raw" / "test",
        "--srcdict", root / "bin" / "dict.src.txt", "--tgtdict", root / "bin" / "dict.tgt.txt",
        "--destdir", tmp_path / "bin", "--workers", "1"]), echo=False)
    # the first run of the schedule is named (the shared pretraining run, finished: not reported on other data)
    with pytest.raises(ValueError, match=rf"^{work / 'pretrain'} was started on other data: {root / 'bin'} "
                                         rf"\(fingerprint [0-9a-f]{{12}}\), not {tmp_path / 'bin'} \(fingerprint "):
        run_ablation(config, tmp_path / "bin", work, ref_dir=tmp_path / "raw", bootstrap_samples=20)
    assert (soft / "train.log").read_text() == log and not (soft / "done.json").exists()
    # given the pretrained checkpoint and run with the finished arms moved away, the soft arm itself is refused
    shutil.rmtree(work / "pretrain")
    for arm in ("tf", "hard"):
        shutil.rmtree(work / "seed1" / arm)
    with pytest.raises(ValueError, match=rf"^{soft} was started on other data: {root / 'bin'} \(fingerprint "):
        run_ablation(config, tmp_path / "bin", work, ref_dir=tmp_path / "raw", arms=["soft"], bootstrap_samples=20,
                     pretrained=root / "work" / "pretrain" / "checkpoint_last.pt", jobs=2)
    assert (soft / "train.log").read_text() == log and not (soft / "done.json").exists()


@pytest.mark.slow
def test_rerun_skips_finished_arms_and_half_finished_arm_resumes(micro, caplog):
    root, config, _ = micro
    work = root / "work"
    before = {arm: _fingerprint(work / "seed1" / arm) for arm in ARMS}
    pretrain_log = (work / "pretrain" / "train.log").stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="ablation"):
        run_ablation(config, root / "bin", work, ref_dir=root / "raw", bootstrap_samples=200)
    assert {arm: _fingerprint(work / "seed1" / arm) for arm in ARMS} == before
    assert (work / "pretrain" / "train.log").stat().st_mtime_ns == pretrain_log
    assert caplog.text.count("finished earlier, skipping training") == 4  # pretrain + 3 arms
    assert "training " not in caplog.text.replace("skipping training", "")

    # A half-finished arm: its update-4 checkpoint as checkpoint_last, no done marker.
    soft = work / "seed1" / "soft"
    (soft / "checkpoint_1_4.pt").replace(soft / "checkpoint_last.pt")
    (soft / "done.json").unlink()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        results = run_ablation(config, root / "bin", work, ref_dir=root / "raw", bootstrap_samples=200)
    log = (soft / "train.log").read_text()
    assert "Loaded checkpoint" in log and "@ 4 updates" in log  # resumed, not restarted
    assert [p["num_updates"] for p in read_valid_curve(soft / "train.log")][-1] == 8
    assert (soft / "done.json").exists()
    assert {arm: _fingerprint(work / "seed1" / arm) for arm in ("tf", "hard")} == \
        {arm: before[arm] for arm in ("tf", "hard")}
    assert set(results["summary"]) == {"pretrained", *ARMS}


@pytest.mark.slow
def test_changed_flags_missing_data_and_checkpoint_are_clear_errors(micro, tmp_path):
    root, config, _ = micro
    changed = load_config(root / "finetune.yaml", ["train.lr=0.1"])
    with pytest.raises(ValueError, match="other fairseq-train arguments"):
        run_ablation(changed, root / "bin", root / "work", ref_dir=root / "raw")
    with pytest.raises(FileNotFoundError, match="data directory not found"):
        run_ablation(config, tmp_path / "no_data", tmp_path / "work")
    with pytest.raises(FileNotFoundError, match="pretrained checkpoint not found"):
        run_ablation(config, root / "bin", tmp_path / "work", pretrained=tmp_path / "missing.pt")


@pytest.mark.slow
def test_a_copy_without_checkpoints_elsewhere_reports_the_same_table(micro, tmp_path):
    """results/ in git holds run directories without checkpoints, at another path: the runner
    recognises every finished arm there (no training, no evaluation) and writes the same scores."""
    import shutil

    root, config, _ = micro
    before = json.loads((root / "work" / "results.json").read_text())
    copy = tmp_path / "results"
    shutil.copytree(root / "work", copy, ignore=shutil.ignore_patterns("*.pt"))
    results = run_ablation(config, root / "bin", copy, ref_dir=root / "raw", bootstrap_samples=200)
    assert not list(copy.rglob("*.pt"))  # nothing was trained or needed
    assert results["scores"] == before["scores"] and results["summary"] == before["summary"]


@pytest.mark.slow
def test_records_of_the_finished_runs_restore_elsewhere_to_the_same_table(micro, tmp_path):
    """run_records: the finished runs saved without checkpoints (gzipped, no machine paths, the hypotheses byte for
    byte, the references as their digest only) and written into an empty work directory elsewhere, the references
    read again from the data: the runner trains and scores nothing there and writes the same table, paired tests
    included; saving and restoring again change nothing."""
    import shutil

    root, config, _ = micro
    before = json.loads((root / "work" / "results.json").read_text())
    records = tmp_path / "records"
    saved, present = run_records.save_records(root / "work", records)
    assert sorted(saved) == ["pretrain", *sorted(f"seed1/{arm}" for arm in ARMS)] and present == []
    assert not [p for p in records.rglob("*") if p.is_file() and not p.name.endswith(".gz")]
    for run in saved:
        texts = {p.name: gzip.decompress(p.read_bytes()).decode() for p in (records / run).glob("*.gz")}
        assert set(texts) == {"run.json.gz", "done.json.gz", "eval.json.gz", "train.log.gz"}
        scored = json.loads((root / "work" / run / "eval.json").read_text())
        recorded = json.loads(texts["eval.json.gz"])
        for subset, entry in scored["subsets"].items():
            kept = recorded["subsets"][subset]
            assert "references" not in kept and kept["hypotheses"] == entry["hypotheses"]
            assert kept["references_sha256"] == run_records.references_digest(entry["references"])
            assert kept["bleu"] == entry["bleu"] and kept["reference"] == f"{subset}.tgt"
        assert str(root) in (root / "work" / run / "run.json").read_text()
        assert not absolute_paths("".join(texts.values()))
    assert run_records.save_records(root / "work", records) == ([], saved)

    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(FileNotFoundError, match="pass the prepared data"):
        run_records.restore_records(records, elsewhere)
    assert not elsewhere.exists()
    assert run_records.restore_records(records, elsewhere, root / "bin", root / "raw") == (saved, [])
    results = run_ablation(config, root / "bin", elsewhere, ref_dir=root / "raw", bootstrap_samples=200)
    assert not list(elsewhere.rglob("*.pt"))  # nothing was trained or scored
    assert results["scores"] == before["scores"] and results["summary"] == before["summary"]
    assert results["bootstrap"] == before["bootstrap"]
    assert run_records.restore_records(records, elsewhere, root / "bin", root / "raw") == ([], saved)
    # restored from the same data under another path: the scores name that file, and saving them again is the same
    shutil.copytree(root / "raw", tmp_path / "moved_raw")
    run_records.restore_records(records, tmp_path / "moved", root / "bin", tmp_path / "moved_raw")
    assert str(tmp_path / "moved_raw" / "test.tgt") in (tmp_path / "moved" / "seed1" / "tf" / "eval.json").read_text()
    assert run_records.save_records(tmp_path / "moved", records) == ([], saved)


@pytest.mark.slow
def test_restored_records_leave_only_the_missing_run_to_train(micro, tmp_path):
    """A record set without one arm: the runner (from the same pretrained checkpoint, one thread as the fixture)
    trains that arm alone, to the fixture's scores, and reads the others from their records."""
    import shutil

    root, config, before = micro
    records = tmp_path / "records"
    run_records.save_records(root / "work", records)
    shutil.rmtree(records / "seed1" / "soft")
    work = tmp_path / "work"
    run_records.restore_records(records, work, root / "bin", root / "raw")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        results = run_ablation(config, root / "bin", work, ref_dir=root / "raw", bootstrap_samples=200,
                               pretrained=root / "work" / "pretrain" / "checkpoint_last.pt")
    trained = sorted(str(p.relative_to(work)) for p in work.rglob("checkpoint_last.pt"))
    assert trained == ["seed1/soft/checkpoint_last.pt"]
    for arm in ARMS:
        assert results["scores"][arm]["1"]["test"]["bleu"] == before["scores"][arm]["1"]["test"]["bleu"], arm


@pytest.mark.slow
def test_records_are_never_overwritten_nor_restored_over_another_run(micro, tmp_path, capsys):
    """A record holding other scores, or a work directory where a run of the record set trains (a checkpoint, no
    done.json), is an error naming the run and the differing files; nothing is written then. Unfinished runs are
    not saved; an empty records directory is an error of the command."""
    import shutil

    root, _, _ = micro
    records = tmp_path / "records"
    run_records.save_records(root / "work", records)
    copy = tmp_path / "copy"
    shutil.copytree(root / "work", copy, ignore=shutil.ignore_patterns("*.pt"))
    (copy / "seed2" / "tf").mkdir(parents=True)
    (copy / "seed2" / "tf" / "run.json").write_text("{}")
    scores = json.loads((copy / "seed1" / "hard" / "eval.json").read_text())
    scores["subsets"]["test"]["bleu"] += 1.0
    (copy / "seed1" / "hard" / "eval.json").write_text(json.dumps(scores))
    with pytest.raises(run_records.RecordConflict, match=r"seed1/hard records another run .*differing: eval.json"):
        run_records.save_records(copy, records)
    assert run_records.save_records(copy, tmp_path / "fresh")[0] == ["pretrain", "seed1/hard", "seed1/soft", "seed1/tf"]
    # a save cut short leaves its run aside, under a dot name: not a record
    shutil.copytree(tmp_path / "fresh" / "seed1" / "tf", tmp_path / "fresh" / "seed1" / ".tf.tmp")
    assert run_records.restore_records(tmp_path / "fresh", tmp_path / "again", root / "bin", root / "raw")[0] == [
        "pretrain", "seed1/hard", "seed1/soft", "seed1/tf"]

    target = tmp_path / "target"
    (target / "seed1" / "soft").mkdir(parents=True)
    (target / "seed1" / "soft" / "checkpoint_last.pt").write_bytes(b"training")
    with pytest.raises(run_records.RecordConflict, match=r"seed1/soft exists and differs from its record"):
        run_records.restore_records(records, target, root / "bin", root / "raw")
    assert sorted(p.name for p in target.rglob("*")) == ["checkpoint_last.pt", "seed1", "soft"]
    # references that are not those scored against (another corpus): named, nothing written
    shutil.copytree(root / "raw", tmp_path / "raw")
    lines = (tmp_path / "raw" / "test.tgt").read_text().splitlines()
    (tmp_path / "raw" / "test.tgt").write_text("\n".join(["changed", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="the test references read from the data .* are not those the run was"):
        run_records.restore_records(records, tmp_path / "other", root / "bin", tmp_path / "raw")
    assert not (tmp_path / "other").exists()

    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        run_records.main(["restore", str(tmp_path / "empty"), str(target)])
    assert exit_info.value.code == 2 and "holds no run records" in capsys.readouterr().err
    assert run_records.main(["save", str(root / "work"), str(records)]) == 0
    assert capsys.readouterr().out.startswith("saved 0 run(s); 4 already there: pretrain, seed1/hard")


@pytest.mark.slow
def test_references_of_the_binarised_target_read_without_a_model_equal_fairseq_generate_s(micro, tmp_path):
    """scoring.binarised_references gives the T- lines of fairseq-generate (what a subset is scored against when its
    raw file is not line-aligned), and a record scored against them restores from the binarised data alone."""
    root, _, _ = micro
    decoded = scoring.evaluate_checkpoint(str(root / "bin"), str(root / "work" / "pretrain" / "checkpoint_last.pt"),
                                          None, subset="valid", beam=1, keep_hypotheses=True)
    assert decoded["reference"] == run_records.BINARISED_TARGET
    assert scoring.binarised_references(str(root / "bin"), "valid", "src", "tgt") == decoded["references"]
    work = tmp_path / "work" / "seed1" / "tf"
    work.mkdir(parents=True)
    (work / "done.json").write_text("{}")
    (work / "eval.json").write_text(json.dumps({"settings": {}, "subsets": {"valid": decoded}}))
    run_records.save_records(tmp_path / "work", tmp_path / "records")
    run_records.restore_records(tmp_path / "records", tmp_path / "again", root / "bin", ref_dir=None)
    restored = json.loads((tmp_path / "again" / "seed1" / "tf" / "eval.json").read_text())
    assert restored["subsets"]["valid"]["references"] == decoded["references"]


@pytest.mark.slow
def test_runs_side_by_side_and_quiet_give_the_same_table(micro, tmp_path, capsys):
    """``jobs=2`` trains two arms at a time and ``verbose=False`` prints one line per validation;
    neither changes a number (same seed, same pretrained checkpoint, one thread per process)."""
    root, config, results = micro
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        side_by_side = run_ablation(config, root / "bin", tmp_path / "work", ref_dir=root / "raw",
                                    pretrained=root / "work" / "pretrain" / "checkpoint_last.pt",
                                    bootstrap_samples=200, verbose=False, jobs=2)
    for arm in ARMS:
        assert side_by_side["scores"][arm]["1"]["test"]["bleu"] == results["scores"][arm]["1"]["test"]["bleu"]
        assert json.loads((tmp_path / "work" / "seed1" / arm / "done.json").read_text())["cpu_seconds"] is None
    printed = capsys.readouterr().out
    assert "train_inner" not in printed  # fairseq's logs stay in the files
    for arm in ARMS:
        assert f"seed1/{arm}: epoch 1, update 8: valid loss" in printed
        assert "train_inner" in (tmp_path / "work" / "seed1" / arm / "train.log").read_text()


@pytest.mark.slow
def test_without_beamgrad_its_arm_is_skipped_and_reported_and_the_others_train(micro, tmp_path, monkeypatch, caplog):
    """``--arms tf mrt`` where mrt's criterion is beamgrad_risk and beamgrad is missing: one warning before
    anything runs, tf trains, mrt gets no run directory, and results.json/results.md name it with the reason."""
    root, _, _ = micro
    config = load_config(root / "finetune.yaml", ["arms.mrt={criterion: beamgrad_risk, teacher-forcing-ratio: 0.23}"])
    work = tmp_path / "work"
    monkeypatch.setitem(sys.modules, "beamgrad", None)  # import beamgrad raises ImportError
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with caplog.at_level(logging.INFO, logger="ablation"):
        results = run_ablation(config, root / "bin", work, ref_dir=root / "raw", arms=["tf", "mrt"],
                               pretrained=root / "work" / "pretrain" / "checkpoint_last.pt", bootstrap_samples=50)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("skipping arm(s) mrt: ") and BEAMGRAD_INSTALL in warnings[0]
    assert caplog.text.index("skipping arm(s) mrt") < caplog.text.index("training ")  # before anything ran
    assert sorted(p.name for p in (work / "seed1").iterdir()) == ["tf"]
    assert (work / "seed1" / "tf" / "done.json").exists()
    on_disk = json.loads((work / "results.json").read_text())
    assert on_disk["arms"] == results["arms"] == ["tf"] and set(on_disk["summary"]) == {"tf"}
    reason = on_disk["skipped"]["mrt"]
    assert list(on_disk["skipped"]) == ["mrt"] and BEAMGRAD_INSTALL in reason and "import beamgrad: " in reason
    assert f"- `mrt`: {reason}" in (work / "results.md").read_text()


def test_a_run_started_with_an_old_option_name_is_the_same_run():
    """run.json of a run begun before an option was renamed names the old flag; the same setting
    under the new name is not a change (and a changed value still is)."""
    earlier = ["BIN", "--topk-mode", "soft", "--selection-grad", "full", "--save-dir", "a"]
    assert ablation_training.differing_flags(earlier, ["BIN", "--topk-mode", "soft", "--topk-grad", "full",
                                                     "--save-dir", "b"]) == []
    assert ablation_training.differing_flags(earlier, ["BIN", "--topk-mode", "soft", "--topk-grad", "none",
                                                     "--save-dir", "a"]) == ["--topk-grad: full -> none"]


def test_bleu_command_passes_the_length_penalty_to_fairseq_generate(tmp_path, monkeypatch, capsys):
    """``fairseq-softtopk-bleu --lenpen 0.6`` decodes with fairseq-generate's --lenpen 0.6 (omitted: not passed)."""
    ref = tmp_path / "ref.txt"
    ref.write_text("a b\n", encoding="utf-8")
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({}, checkpoint)  # a whole checkpoint file: an empty one is refused before translating
    seen = []

    def generate(*args, **kwargs):
        seen.append([str(a) for value in (*args, *kwargs.values())
                     for a in (value if isinstance(value, (list, tuple)) else [value])])
        return "D-0\t-0.1\ta b\n"

    monkeypatch.setattr(scoring, "run_fairseq_generate", generate)
    for extra in (["--lenpen", "0.6"], []):
        assert bleu.main([str(_dictionaries_only(tmp_path)), str(checkpoint), "--ref", str(ref), *extra]) == 0
    with_penalty, without = seen
    assert "--lenpen" in with_penalty and with_penalty[with_penalty.index("--lenpen") + 1] == "0.6"
    assert "--lenpen" not in without
    assert "chrF 100.00" in capsys.readouterr().out  # the hypothesis is scored (too short for 4-gram BLEU)


@pytest.mark.slow
def test_translate_sources_decode_with_each_runs_scored_checkpoint_and_are_recorded(micro, tmp_path, monkeypatch):
    """--translate-sources: every finished run's scored checkpoint translates each NAME.SRC(.gz) of the directory
    as it decoded the test set (the toy corpus is binarised from its raw text, so the segmenter is the identity
    here: a source equal to the raw test set is translated to the run's test.hyp, line for line); a rerun
    translates nothing again; the translations go into the records and come back with them; a run restored
    without checkpoints keeps its translations."""
    import shutil

    from fairseq_softtopk.experiments import source_segmentation, source_translation

    root, config, before = micro
    work = tmp_path / "work"
    shutil.copytree(root / "work", work)
    sources = tmp_path / "heldout"
    sources.mkdir()
    test_lines = (root / "raw" / "test.src").read_text(encoding="utf-8").splitlines()
    (sources / "copy_of_test.src").write_text("\n".join(test_lines) + "\n", encoding="utf-8")
    (sources / "first_five.src.gz").write_bytes(gzip.compress(("\n".join(test_lines[:5]) + "\n").encode()))
    (sources / "notes.txt").write_text("not a source\n")
    monkeypatch.setattr(source_segmentation, "corpus_segmenter", lambda bpe_dir, lang: lambda line: line)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(ValueError, match="pass --data-dir"):
        run_ablation(config, root / "bin", work, ref_dir=root / "raw", translate_sources=sources)
    with pytest.raises(FileNotFoundError, match=r"holds no NAME.src or NAME.src.gz"):
        run_ablation(config, root / "bin", work, ref_dir=root / "raw", translate_sources=tmp_path, bpe_dir=tmp_path)
    assert not list(work.rglob("translations.json"))  # refused before any run
    results = run_ablation(config, root / "bin", work, ref_dir=root / "raw", bootstrap_samples=200,
                           translate_sources=sources, bpe_dir=tmp_path)
    assert results["scores"] == before["scores"]
    for run in ("pretrain", *(f"seed1/{arm}" for arm in ARMS)):
        run_dir = work / run
        hypotheses = (run_dir / "test.hyp").read_text(encoding="utf-8").splitlines()
        assert len(hypotheses) == len(test_lines) == 30
        assert (run_dir / "translations" / "copy_of_test.tgt").read_text(encoding="utf-8").splitlines() == hypotheses
        assert (run_dir / "translations" / "first_five.tgt").read_text(encoding="utf-8").splitlines() == hypotheses[:5]
        record = json.loads((run_dir / "translations.json").read_text())
        assert sorted(record) == ["copy_of_test", "first_five"] and record["first_five"]["lines"] == 5
        assert record["copy_of_test"]["checkpoint_sha256"] == checkpoint_digest(run_dir / "checkpoint_last.pt")
    stamp = (work / "seed1" / "soft" / "translations" / "copy_of_test.tgt").stat().st_mtime_ns
    translated = []
    monkeypatch.setattr(source_translation, "translate_lines", lambda *args, **kwargs: translated.append(args))
    run_ablation(config, root / "bin", work, ref_dir=root / "raw", bootstrap_samples=200,
                 translate_sources=sources, bpe_dir=tmp_path)
    assert translated == [] and \
        (work / "seed1" / "soft" / "translations" / "copy_of_test.tgt").stat().st_mtime_ns == stamp

    records = tmp_path / "records"
    run_records.save_records(work, records)
    assert (records / "seed1" / "hard" / "translations" / "first_five.tgt.gz").is_file()
    elsewhere = tmp_path / "elsewhere"
    run_records.restore_records(records, elsewhere, root / "bin", root / "raw")
    for name in ("copy_of_test.tgt", "first_five.tgt"):
        assert (elsewhere / "seed1" / "hard" / "translations" / name).read_bytes() == \
            (work / "seed1" / "hard" / "translations" / name).read_bytes()
    run_ablation(config, root / "bin", elsewhere, ref_dir=root / "raw", bootstrap_samples=200,
                 translate_sources=sources, bpe_dir=tmp_path)  # no checkpoint needed: translated already
    assert translated == [] and not list(elsewhere.rglob("*.pt"))
    assert run_records.save_records(elsewhere, records)[0] == []  # the same records


@pytest.mark.slow
def test_a_run_still_held_by_its_runner_is_saved_once_released(micro, tmp_path):
    """A run with its scores but still held by a live runner (translating --translate-sources after them) is not
    finished yet: run_records leaves it for the next save, which then keeps it whole."""
    import shutil

    from fairseq_softtopk.experiments.run_lock import run_lock

    root, _, _ = micro
    work = tmp_path / "work"
    shutil.copytree(root / "work", work, ignore=shutil.ignore_patterns("*.pt", "run.lock"))
    records = tmp_path / "records"
    with run_lock(work / "seed1" / "soft"):
        saved, _ = run_records.save_records(work, records)
    assert "seed1/soft" not in saved and "seed1/hard" in saved
    assert run_records.save_records(work, records)[0] == ["seed1/soft"]
