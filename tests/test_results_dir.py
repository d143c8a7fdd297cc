"""results/ holds summaries (at most 2 MB on disk, no machine's absolute paths), and the publisher that
keeps it so (fairseq_softtopk.experiments.publish)."""

import gzip
import json

import pytest

from fairseq_softtopk.experiments.publish import (PNG_COLOURS, RUNS, absolute_paths, compact_png, publish,
                                                  read_runs_archive, replace_paths, strip_absolute_paths,
                                                  tidy_in_place)
from fairseq_softtopk.experiments.publish import main as publish_main


def _texts(root):
    """``(path, text)`` of every text file under ``root``, gzipped ones unpacked, and of every member of a runs
    archive (its path: the archive's, then the member's name)."""
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.suffix == ".png":
            continue
        if path.name == RUNS:
            yield from ((path / name, text) for name, text in sorted(read_runs_archive(path).items()))
        else:
            yield path, (gzip.open(path, "rt", encoding="utf-8").read() if path.suffix == ".gz"
                         else path.read_text(encoding="utf-8"))


def _disk_bytes(root) -> int:
    """What ``du`` counts for ``root`` on a file system of 4 KiB blocks: each file and directory rounded up."""
    return sum(-(-p.stat().st_size // 4096) * 4096 if p.is_file() else 4096 for p in [root, *root.rglob("*")])


def test_results_are_small_summaries_without_absolute_paths(repo_root):
    results = repo_root / "results"
    files = [p for p in results.rglob("*") if p.is_file()]
    assert _disk_bytes(results) <= 2 * 1024 * 1024  # `du -s results`: small files take a block each
    for experiment in (p for p in results.iterdir() if p.is_dir()):  # summaries: logs and hypotheses go to records/
        assert sum(p.stat().st_size for p in experiment.rglob("*") if p.is_file()) <= 512 * 1024, experiment
    named = [*files, *(p for p, _ in _texts(results))]  # the runs' archives' members too
    assert not [p for p in named if p.suffix in (".pt", ".hyp") or p.name in ("eval.json", "train.log.gz")]
    assert not [p for p in files if p.name in ("run.json", "done.json", "train.log")], "runs' files go in runs.tar.xz"
    offending = {str(p.relative_to(repo_root)): found[:3] for p, text in _texts(results)
                 if (found := absolute_paths(text))}
    assert not offending
    for experiment in (p for p in results.iterdir() if p.is_dir()):
        assert (experiment / "results.md").is_file() or (experiment / "README.md").is_file(), experiment


def test_records_hold_finished_runs_without_checkpoints_or_machine_paths(repo_root):
    """records/ (run_records' form): per run its gzipped arguments, end, log and scores, and (from the runs that
    translated held-out sources) its translations, nothing else; the arguments, ends, logs and translation
    records without absolute paths; each run under 1 MB."""
    records = repo_root / "records"
    assert (records / "README.md").is_file()
    for scores in records.rglob("eval.json.gz"):
        run = scores.parent
        names = sorted(p.name for p in run.iterdir())
        assert set(names) <= {"run.json.gz", "done.json.gz", "eval.json.gz", "train.log.gz",
                              "translations.json.gz", "translations"}, run
        assert ("translations" in names) == ("translations.json.gz" in names), run
        files = [p for p in run.rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in files) < 1024 * 1024, run
        json.loads(gzip.decompress(scores.read_bytes()))
        for name in set(names) - {"eval.json.gz", "translations"}:
            assert not absolute_paths(gzip.decompress((run / name).read_bytes()).decode()), run / name
        for hypotheses in (run / "translations").glob("*") if "translations" in names else ():
            assert hypotheses.suffix == ".gz" and gzip.decompress(hypotheses.read_bytes()).decode().strip()
    assert not [p for p in records.rglob("*") if p.is_file() and p.suffix not in (".gz", ".md")]


@pytest.mark.parametrize("text, expected", [
    ("--save-dir /work/exp_1/runs/main_job/seed1/tf", "--save-dir runs/main_job/seed1/tf"),
    ("data: /work/data/multi30k/bin", "data: data/multi30k/bin"),
    ("user_dir: /home/me/clone/fairseq_softtopk", "user_dir: fairseq_softtopk"),
    ("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/fairseq/x.py:12",
     "site-packages/fairseq/x.py:12"),
    ("at /tmp/plasma", "at .../plasma"),
    ("see https://hydra.cc/docs/1.2/upgrades and 3/4 or runs/a/b", "see https://hydra.cc/docs/1.2/upgrades and 3/4 or runs/a/b"),
])
def test_absolute_paths_are_cut_to_what_a_reader_can_resolve(text, expected):
    assert strip_absolute_paths(text) == expected
    assert not absolute_paths(strip_absolute_paths(text))


def _line_plot(path):
    """A figure as the ablation's plots are: matplotlib's RGBA PNG of a few antialiased lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(6, 3))
    x = np.linspace(0, 1, 50)
    for i in range(6):
        ax.plot(x, np.sin(3 * x + i), label=f"arm {i}", linestyle=("-", "--", ":")[i % 3])
    ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def test_published_figures_keep_the_picture_in_fewer_bytes(tmp_path):
    from PIL import Image
    import numpy as np
    _line_plot(tmp_path / "plot.png")
    compact_png(tmp_path / "plot.png", tmp_path / "small.png")
    before, after = Image.open(tmp_path / "plot.png"), Image.open(tmp_path / "small.png")
    assert before.mode == "RGBA" and after.mode == "P" and after.size == before.size
    assert len(after.getpalette()) // 3 <= PNG_COLOURS
    assert (tmp_path / "small.png").stat().st_size < (tmp_path / "plot.png").stat().st_size / 2
    # the same picture: colours moved to the nearest of the palette, by little on average
    diff = np.abs(np.asarray(before.convert("RGB"), float) - np.asarray(after.convert("RGB"), float))
    assert diff.mean() < 2.0 and np.percentile(diff, 99) < 40
    # a file Pillow cannot read is kept byte for byte
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not an image")
    compact_png(tmp_path / "broken.png", tmp_path / "copy.png")
    assert (tmp_path / "copy.png").read_bytes() == b"\x89PNG not an image"


def _run_dir(root):
    (root / "seed1" / "tf").mkdir(parents=True)
    (root / "results.md").write_text("# table\nconfig `/work/x/configs/demo.yaml`\n")
    (root / "results.json").write_text(json.dumps({"work_dir": "/work/x/runs/main_job"}))
    _line_plot(root / "curves.png")
    (root / "seed1" / "tf" / "run.json").write_text(json.dumps({"args": ["/work/x/runs/main_job/bin"]}))
    (root / "seed1" / "tf" / "train.log").write_text("save_dir /work/x/runs/main_job/seed1/tf\n" * 100)
    for name in ("checkpoint_last.pt", "test.hyp", "eval.json"):
        (root / "seed1" / "tf" / name).write_text("large")


def test_publish_keeps_the_summaries_and_refuses_to_overwrite(tmp_path):
    _run_dir(tmp_path / "run")
    publish(tmp_path / "run", tmp_path / "published")
    kept = sorted(str(p.relative_to(tmp_path / "published")) for p in (tmp_path / "published").rglob("*")
                  if p.is_file())
    assert kept == ["curves.png", "results.json", "results.md", RUNS]
    assert sorted(read_runs_archive(tmp_path / "published" / RUNS)) == ["seed1/tf/run.json", "seed1/tf/train.log"]
    texts = dict(_texts(tmp_path / "published"))
    assert not any(absolute_paths(t) for t in texts.values())
    assert "runs/main_job/seed1/tf" in texts[tmp_path / "published" / RUNS / "seed1" / "tf" / "train.log"]
    with pytest.raises(FileExistsError):
        publish(tmp_path / "run", tmp_path / "published")
    with pytest.raises(FileNotFoundError, match="results.md"):
        publish(tmp_path / "published" / "seed1", tmp_path / "elsewhere")


def test_tidy_in_place_gives_the_published_form(tmp_path):
    """A directory published before runs.tar.xz (one directory per run, the log gzipped) is brought to the same
    form: its runs' files in the archive, their texts unchanged but for the paths, the directories gone."""
    _run_dir(tmp_path / "old")
    (tmp_path / "old" / "pretrain").mkdir()
    (tmp_path / "old" / "pretrain" / "done.json").write_text('{"finished": "2026-01-01 00:00:00"}')
    log = tmp_path / "old" / "seed1" / "tf" / "train.log"
    log.with_name("train.log.gz").write_bytes(gzip.compress(log.read_bytes()))
    log.unlink()
    tidy_in_place(tmp_path / "old")
    names = sorted(str(p.relative_to(tmp_path / "old")) for p in (tmp_path / "old").rglob("*"))
    assert names == ["curves.png", "results.json", "results.md", RUNS]
    runs = read_runs_archive(tmp_path / "old" / RUNS)
    assert sorted(runs) == ["pretrain/done.json", "seed1/tf/run.json", "seed1/tf/train.log"]
    assert runs["pretrain/done.json"] == '{"finished": "2026-01-01 00:00:00"}'
    assert runs["seed1/tf/train.log"] == "save_dir runs/main_job/seed1/tf\n" * 100
    assert not any(absolute_paths(t) for _, t in _texts(tmp_path / "old"))
    # tidying again is a no-op, byte for byte (an archive without times or owners, figures already compact)
    before = {p: p.read_bytes() for p in (tmp_path / "old").rglob("*") if p.is_file()}
    tidy_in_place(tmp_path / "old")
    assert before == {p: p.read_bytes() for p in (tmp_path / "old").rglob("*") if p.is_file()}


def test_a_placeholder_names_a_file_the_reader_does_not_have_in_every_form(tmp_path):
    """--placeholder PATH=NAME: the path as given, as another machine's copy is cut, and relative with ../ before
    it, each a whole path; other files of the same name and longer paths are left alone."""
    checkpoint = "/work/shared/models/tf/checkpoint_best.pt"
    text = (f"--restore-file {checkpoint} | restore_file='/mnt/x/shared/models/tf/checkpoint_best.pt' | "
            "--pretrained ../shared/models/tf/checkpoint_best.pt | shared/models/tf/checkpoint_best.pt | "
            "/work/runs/seed1/checkpoint_best.pt | shared/models/tf/checkpoint_best.pt.bak | my/shared/models/tf/"
            "checkpoint_best.pt")
    assert replace_paths(text, {checkpoint: "TF_CHECKPOINT"}).split(" | ") == [
        "--restore-file TF_CHECKPOINT", "restore_file='TF_CHECKPOINT'", "--pretrained TF_CHECKPOINT",
        "TF_CHECKPOINT", "runs/seed1/checkpoint_best.pt", "shared/models/tf/checkpoint_best.pt.bak",
        "my/shared/models/tf/checkpoint_best.pt"]
    # no placeholder: only the absolute paths are cut
    assert replace_paths(text) == strip_absolute_paths(text)


def test_publish_and_tidy_write_the_placeholder_everywhere(tmp_path):
    _run_dir(tmp_path / "run")
    log = tmp_path / "run" / "seed1" / "tf" / "train.log"
    log.write_text(log.read_text() + "restore_file='/work/x/shared/tf.pt'\n")
    (tmp_path / "run" / "results.json").write_text(json.dumps({"command": "--pretrained ../shared/tf.pt"}))
    publish(tmp_path / "run", tmp_path / "published", {"/work/x/shared/tf.pt": "TF_CHECKPOINT"})
    texts = {p.name: t for p, t in _texts(tmp_path / "published")}
    assert json.loads(texts["results.json"]) == {"command": "--pretrained TF_CHECKPOINT"}
    assert texts["train.log"].endswith("restore_file='TF_CHECKPOINT'\n")
    assert not any("shared/" in t for t in texts.values())
    # tidying a directory published without it names the same file the same way
    _run_dir(tmp_path / "old")
    (tmp_path / "old" / "results.md").write_text("`--pretrained shared/tf.pt`\n")
    tidy_in_place(tmp_path / "old", {"shared/tf.pt": "TF_CHECKPOINT"})
    assert (tmp_path / "old" / "results.md").read_text() == "`--pretrained TF_CHECKPOINT`\n"


@pytest.mark.parametrize("spec, message", [
    ("shared/tf.pt", "write PATH=NAME"),
    ("shared/tf.pt=TF CHECKPOINT", "write PATH=NAME"),
    ("checkpoint_best.pt=TF_CHECKPOINT", "at least one directory"),
    ("/checkpoint_best.pt=TF_CHECKPOINT", "at least one directory"),
])
def test_a_bad_placeholder_is_refused_before_anything_is_written(tmp_path, spec, message, capsys):
    _run_dir(tmp_path / "run")
    with pytest.raises(SystemExit) as stop:
        publish_main(["--placeholder", spec, str(tmp_path / "run"), str(tmp_path / "published")])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "published").exists()


def test_the_long_protocol_hard_risk_rows_are_the_recorded_scores(repo_root):
    """results/multi30k_long_finetune's hard_risk table: per seed, test2016 (lenpen chosen on valid), test at lenpen
    1.0 and valid BLEU of tf / soft_risk / hard_risk as the runs' records scored them, and the test difference."""
    import re

    readme = (repo_root / "results" / "multi30k_long_finetune" / "README.md").read_text(encoding="utf-8")
    records = repo_root / "records" / "multi30k_long_finetune"
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d) \| (\d.*)$", readme, re.M)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for seed, row in rows.items():
        cells = [cell.strip() for cell in row.strip(" |").split("|")]
        scores = {arm: json.loads(gzip.decompress((records / f"seed{seed}" / arm / "eval.json.gz").read_bytes()))
                  ["subsets"] for arm in ("tf", "soft_risk", "hard_risk")}
        for cell, read in zip(cells[:3], (lambda s: s["test"]["bleu"], lambda s: s["test"]["at_lenpen"]["1.0"]["bleu"],
                                           lambda s: s["valid"]["bleu"])):
            assert cell == " / ".join(f"{read(scores[arm]):.2f}" for arm in ("tf", "soft_risk", "hard_risk")), cell
        delta = scores["hard_risk"]["test"]["bleu"] - scores["soft_risk"]["test"]["bleu"]
        assert cells[3].startswith(f"{delta:+.2f} ("), cells[3]
