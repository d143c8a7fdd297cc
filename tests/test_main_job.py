"""The main job (fairseq-softtopk-main-job: python -m fairseq_softtopk.cli.main_job, what `make demo` runs), on a
shrunken demo corpus."""

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import clean_env
from fairseq_softtopk.cli import main_job
from fairseq_softtopk.experiments.work_dir_marker import MARKER, clear_for_fresh, record_created


@pytest.mark.slow
def test_main_job_is_quiet_and_ends_with_the_table(tmp_path, repo_root):
    work = tmp_path / "main_job"
    cmd = [sys.executable, "-m", "fairseq_softtopk.cli.main_job", "--work-dir", str(work),
           "--sizes", "200", "20", "30", "--seeds", "1", "2", "--pretrain",
           "--set", "pretrain.train.max-epoch=1", "--set", "train.max-update=2",
           "--set", "train.validate-interval-updates=2", "--set", "train.save-interval-updates=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "train_inner" not in out and "train_inner" not in proc.stderr  # fairseq's logs are in the files
    for noise in ("tensorboardX", "user-dir", "detokenize"):
        assert noise not in proc.stderr and noise not in out
    for seed in (1, 2):
        for arm in ("tf", "hard", "soft"):
            assert f"seed{seed}/{arm}: epoch 1, update 2: valid loss" in out
            assert "valid on 'valid' subset" in (work / f"seed{seed}" / arm / "train.log").read_text()
    table = out[out.index("# Ablation: demo_finetune"):]
    for row in ("| pretrained (no fine-tuning) |", "| tf (baseline) |", "| hard |", "| soft |", "Against `hard`"):
        assert row in table
    assert out.rstrip().splitlines()[-1].startswith("main job: ")
    results = json.loads((work / "results.json").read_text())
    assert sorted(results["scores"]["soft"]) == ["1", "2"]
    # --pretrain: one teacher-forcing model for every seed, trained here; every arm started from it
    assert not results["pretrain_per_seed"] and sorted(results["scores"]["pretrained"]) == ["0"]
    for seed in (1, 2):
        soft_args = json.loads((work / f"seed{seed}" / "soft" / "run.json").read_text())["args"]
        assert soft_args[soft_args.index("--finetune-from-model") + 1] == str(work / "pretrain" / "checkpoint_last.pt")
    assert (work / "pretrain" / "done.json").is_file() and not (work / "seed1" / "pretrain").exists()
    assert "Not compared with README's table" in out  # shrunken settings: no comparison
    # provenance: the command as typed and the commit of the code that ran
    assert results["command"].startswith("fairseq-softtopk-main-job --work-dir ")
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", results["commit"])
    assert f"- command: `{results['command']}` at commit `{results['commit']}`" in table
    assert len((work / "raw" / "train.src").read_text().splitlines()) == 200


def _listing(root):
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def _ablation_work_dir(work):
    """What fairseq-softtopk-ablation leaves in its work directory."""
    for run in ("pretrain", "seed1/tf", "seed1/soft"):
        (work / run).mkdir(parents=True)
        for name in ("checkpoint_last.pt", "done.json", "train.log"):
            (work / run / name).write_text(name)
    (work / "results.json").write_text("{}")


@pytest.mark.parametrize("make", [
    lambda work: (work / "seed_corpus_do_not_delete").mkdir(parents=True) or
    (work / "seed_corpus_do_not_delete" / "corpus.txt").write_text("mine"),
    _ablation_work_dir], ids=["foreign seed* directory", "an ablation's work directory"])
def test_fresh_refuses_a_directory_the_main_job_did_not_make(tmp_path, capsys, make):
    """--fresh deleted WORK/pretrain and every WORK/seed* of any directory; now a non-empty one without the main
    job's marker is refused, naming it, and nothing is deleted."""
    work = tmp_path / "work"
    make(work)
    before = _listing(work)
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--work-dir", str(work), "--fresh", "--seeds", "1"])
    message = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"{work} was not made by the main job (no {MARKER}" in message
    assert len(message.strip().splitlines()) == 1 and _listing(work) == before


def test_fresh_removes_only_what_the_main_job_recorded_creating(tmp_path):
    work = tmp_path / "work"
    (work / "seed_corpus_do_not_delete").mkdir(parents=True)  # the user's, there before the main job
    record_created(work, ["raw", "bin", "seed1", "seed_corpus_do_not_delete", "results.md"])
    assert json.loads((work / MARKER).read_text())["created"] == ["raw", "bin", "seed1", "results.md"]
    for path in ("raw/train.src", "bin/dict.src.txt", "seed1/tf/checkpoint_last.pt", "results.md",
                 "seed_corpus_do_not_delete/corpus.txt"):
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text("x")
    (work / "seed2").mkdir()  # a run directory the marker does not list: refused, nothing removed
    with pytest.raises(ValueError, match=r"holds seed2, which the main job did not create"):
        clear_for_fresh(work)
    (work / "seed2").rmdir()
    assert clear_for_fresh(work) == [work / "seed1", work / "results.md"]
    assert _listing(work) == ["bin", "bin/dict.src.txt", MARKER, "raw", "raw/train.src", "seed_corpus_do_not_delete",
                              "seed_corpus_do_not_delete/corpus.txt"]


@pytest.mark.parametrize("entry", ["../victim", "{victim}", ".", "", "seed1/../../victim"])
def test_fresh_refuses_a_marker_naming_anything_but_an_entry_of_the_work_directory(tmp_path, capsys, entry):
    """main_job.json is a file anyone can edit: listing "../victim" or an absolute path, --fresh deleted a directory
    outside the work directory ("." or "": the work directory itself, data and all). Now it is one line naming the
    entry, and nothing is deleted."""
    work, victim = tmp_path / "work", tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    (victim / "keep" / "thesis.tex").write_text("mine")
    record_created(work, ["bin", "seed1", "results.md"])
    (work / "seed1").mkdir()
    (work / "bin").mkdir()
    marker = json.loads((work / MARKER).read_text())
    marker["created"].append(entry.format(victim=victim))
    (work / MARKER).write_text(json.dumps(marker))
    before, outside = _listing(work), _listing(tmp_path)
    with pytest.raises(ValueError, match=r"not the name of an entry of .*nothing was deleted"):
        clear_for_fresh(work)
    assert _listing(tmp_path) == outside
    # through the command (--arms nope: were the check missing, the job would stop soon after, not train)
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--work-dir", str(work), "--fresh", "--seeds", "1", "--sizes", "20", "5", "5", "--pretrain",
                       "--arms", "nope"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"--fresh: {work / MARKER} lists {entry.format(victim=victim)!r}, not the name of an entry of {work}" in err
    assert _listing(work) == before and (victim / "keep" / "thesis.tex").read_text() == "mine"


@pytest.mark.parametrize("args, message", [
    (["--seeds", "1", "2", "1"], "--seeds: seeds [1] are given more than once (1 2 1)"),
    (["--jobs", "0"], "--jobs: runs trained at the same time must be an integer >= 1, got 0"),
    (["--work-dir", "{file}"], "--work-dir: work directory {file} is a file")])
def test_bad_seeds_jobs_and_work_dir_are_one_line_errors(tmp_path, capsys, args, message):
    file = tmp_path / "notes.txt"
    file.write_text("not a directory")
    args = [arg.format(file=file) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--work-dir", str(tmp_path / "work"), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message.format(file=file) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()


def test_a_work_directory_under_a_file_or_unwritable_is_one_line(tmp_path, capsys):
    """--work-dir under a regular file ended in a NotADirectoryError traceback (and one this user cannot write, in a
    PermissionError traceback: tried only where file modes bind the user, not as root)."""
    file = tmp_path / "notes.txt"
    file.write_text("not a directory")
    cases = [(file / "work", f"cannot be created: {file} is a file, not a directory")]
    if os.geteuid() != 0:
        (tmp_path / "locked").mkdir(mode=0o500)
        cases.append((tmp_path / "locked" / "work", f"cannot be created: creating a file in {tmp_path / 'locked'}"))
    for work, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main_job.main(["--work-dir", str(work), "--seeds", "1"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
        assert f"--work-dir: work directory {work} {message}" in err
    assert file.read_text() == "not a directory"


def test_an_incomplete_bin_holding_other_files_is_not_deleted(tmp_path):
    """The data step redoes a bin/ without its last file by deleting it: only one that holds nothing but its own
    output (a user's fairseq-preprocess directory of other data is left as it is, and named)."""
    from fairseq_softtopk.experiments.fairseq_commands import binarize_generated_corpus

    splits = {"train": (20, 11), "valid": (5, 12), "test": (5, 13)}
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "train.en-de.en.idx").write_text("mine")
    with pytest.raises(ValueError, match=r"bin is not an incomplete binarisation .* train\.en-de\.en\.idx"):
        binarize_generated_corpus(tmp_path, splits=splits)
    assert (tmp_path / "bin" / "train.en-de.en.idx").read_text() == "mine"


def test_sizes_without_pretrain_is_refused_before_anything_runs(tmp_path, capsys):
    """A shrunken corpus has other dictionaries than the shipped model's: --sizes needs --pretrain."""
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--work-dir", str(tmp_path / "work"), "--sizes", "20", "5", "5"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--sizes makes another corpus" in err and "add --pretrain" in err
    assert not (tmp_path / "work").exists()


def test_another_corpus_is_refused_naming_the_dictionary_and_pretrain(tmp_path):
    """The shipped model's dictionaries are checked by md5 before any fine-tuning starts from it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for line in main_job.PRETRAINED_DICTIONARIES.read_text().splitlines():
        (bin_dir / line.split()[1]).write_text("x 1\n")
    with pytest.raises(ValueError, match=r"dict\.src\.txt \(md5 [0-9a-f]{32}\) is not the dictionary .*--pretrain"):
        main_job.check_pretrained_dictionaries(bin_dir)


@pytest.mark.slow
def test_the_shipped_model_scores_as_published_and_every_arm_starts_from_it(tmp_path, repo_root):
    """The default path: the demo corpus regenerated here has the shipped model's dictionaries, the model
    is scored as README's table says (to the check's tolerance for one checkpoint on two machines), and
    the arms fine-tune from it."""
    from fairseq_softtopk.experiments.checkpoint_integrity import checkpoint_digest
    from fairseq_softtopk.experiments.reference_comparison import SAME_CHECKPOINT_TOLERANCE

    work = tmp_path / "main_job"
    cmd = [sys.executable, "-m", "fairseq_softtopk.cli.main_job", "--work-dir", str(work), "--seeds", "1",
           "--arms", "tf", "--set", "train.max-update=1", "--set", "train.validate-interval-updates=1",
           "--set", "train.save-interval-updates=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((work / "results.json").read_text())
    published = json.loads((repo_root / "results" / "main_job_demo" / "results.json").read_text())
    ours, theirs = (r["summary"]["pretrained"]["test"]["bleu_mean"] for r in (results, published))
    assert abs(ours - theirs) <= SAME_CHECKPOINT_TOLERANCE, (ours, theirs)
    assert results["pretrained_sha256"] == published["pretrained_sha256"] == \
        checkpoint_digest(main_job.PRETRAINED)
    tf_args = json.loads((work / "seed1" / "tf" / "run.json").read_text())["args"]
    assert tf_args[tf_args.index("--finetune-from-model") + 1] == str(main_job.PRETRAINED)
    assert not (work / "pretrain").exists() and (work / "pretrained" / "eval.json").is_file()
