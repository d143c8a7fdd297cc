"""README.md and docs/: links that resolve, a README of at most 250 lines without commit hashes, issue
numbers or machine paths, and option tables equal to the plugin's dataclass fields."""

import dataclasses
import re

import pytest

from fairseq_softtopk.criterions.soft_beam_search import SoftBeamSearchConfig
from fairseq_softtopk.models._attention_config import AttentionNormalizerConfig
from fairseq_softtopk.models.softtopk_lstm import SoftTopKLSTMConfig
from fairseq_softtopk.models.softtopk_transformer import SoftTopKAttentionConfig


def _documents(repo_root):
    return [repo_root / "README.md", *sorted((repo_root / "docs").glob("*.md"))]


def test_every_relative_link_points_to_a_file_that_exists(repo_root):
    broken = []
    for doc in _documents(repo_root):
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same document
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{doc.relative_to(repo_root)}: {target}")
    assert not broken, broken
    assert len(_documents(repo_root)) >= 7  # README and the six documents it links


def test_readme_is_short_and_has_no_commit_hashes_issue_numbers_or_machine_paths(repo_root):
    text = (repo_root / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text), "a commit hash"
    assert not re.search(r"\bissues? \d+", text, re.I), "an issue number"
    assert not re.search(r"(/work/|/home/|/tmp/|/root/|\.\./shared)", text), "a machine path"


def _readme_row(repo_root, start):
    """README's line that begins with ``start`` (a table row)."""
    return next(line for line in (repo_root / "README.md").read_text().splitlines() if line.startswith(start))


def _table(text, first_option):
    """``{option: default}`` of the README table whose first row is ``first_option``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| `{first_option}` |"))
    rows = {}
    for line in lines[start:]:
        if not line.startswith("| `"):
            break
        option, default = re.match(r"\| `(--[\w-]+)` \| ([^|]*?) \|", line).groups()
        rows[option] = default
    return rows


def _defaults(config, names=None, advanced=None):
    """``{option: default}`` of a config's fields (deprecated aliases left out; ``advanced``: True or
    False for only the advanced or only the main options)."""
    out = {}
    for field in dataclasses.fields(config):
        if field.name.startswith("_") or str(field.default).startswith("${") or (names and field.name not in names):
            continue
        if field.metadata.get("deprecated") or (
                advanced is not None and bool(field.metadata.get("advanced")) != advanced):
            continue
        value = getattr(field.default, "value", field.default)
        out["--" + field.name.replace("_", "-")] = {True: "on", False: "off"}.get(value, value) \
            if isinstance(value, bool) else str(value)
    return out


def test_readme_option_tables_are_the_dataclass_fields_with_their_defaults(repo_root):
    text = (repo_root / "README.md").read_text()
    assert _table(text, "--train-beam") == _defaults(SoftBeamSearchConfig, advanced=False)  # the main table
    advanced = (repo_root / "docs" / "beam_search_training.md").read_text()  # README links the advanced table
    assert _table(advanced, "--topk-cost") == _defaults(SoftBeamSearchConfig, advanced=True)
    deprecated = [f.name for c in (SoftBeamSearchConfig, SoftTopKAttentionConfig) for f in dataclasses.fields(c)
                  if f.metadata.get("deprecated")]
    renamed = text.split("deprecated aliases")[1].split("\n\n")[0]
    assert deprecated and all(f"`--{name.replace('_', '-')}`" in renamed for name in deprecated)
    attention = _table(text, "--attention-normalizer")
    assert attention == _defaults(SoftTopKAttentionConfig)
    lstm_only = {f.name for f in dataclasses.fields(SoftTopKLSTMConfig)} - {
        f.name for f in dataclasses.fields(AttentionNormalizerConfig)}
    docs = (repo_root / "docs" / "beam_search_training.md").read_text()  # the sizes are there (README's length)
    sizes = dict(re.findall(r"`(--[\w-]+)` \(([^);]*)[^)]*\)",
                            docs.split("`softtopk_lstm`'s size options (defaults):")[1].split("\n\n")[0]))
    assert sizes == _defaults(SoftTopKLSTMConfig, lstm_only)


@pytest.mark.parametrize("option", ["--teacher-forcing-ratio"])
def test_the_teacher_forcing_ratio_is_explained_as_a_loss_weight(repo_root, option):
    row = _readme_row(repo_root, f"| `{option}`")
    assert "weight p of the teacher-forcing loss" in row and "not scheduled sampling" in row


def test_readme_demo_row_is_the_published_main_job_run(repo_root):
    """README's demo numbers are those of results/main_job_demo/results.json, the run that the main
    job compares a user's run with."""
    import json
    import statistics

    results = json.loads((repo_root / "results" / "main_job_demo" / "results.json").read_text())
    row = _readme_row(repo_root, "| the demo language pair")
    for arm in ("pretrained", "tf", "hard", "soft"):
        s = results["summary"][arm]["test"]
        shown = f"{arm} {s['bleu_mean']:.2f}" + (f" ± {s['bleu_sd']:.2f}" if s["n_seeds"] > 1 else "")
        assert re.search(re.escape(shown) + r"(?!\d| ±)", row), shown
    for label, by_seed in (("hard − tf", results["bootstrap"]["hard"]),
                           ("soft − hard", results["bootstrap_vs"]["hard"]["soft"])):
        deltas = [d["test"]["bleu"]["delta"] for d in by_seed.values()]
        assert f"{label} {statistics.fmean(deltas):+.2f} ± {statistics.stdev(deltas):.2f}".replace("-", "−") in row


def test_readme_long_protocol_row_is_the_published_run(repo_root):
    """README's row of the longer fine-tuning protocol gives the numbers of results/multi30k_long_finetune:
    each arm's test2016 mean ± sd (length penalty chosen on valid) and its mean at lenpen 1.0, and the t-tests."""
    import json
    import statistics

    results = json.loads((repo_root / "results" / "multi30k_long_finetune" / "results.json").read_text())
    row = _readme_row(repo_root, "| Multi30k En-De, beam-search fine-tuning for 3 epochs")
    assert len(results["seeds"]) == 5 and "LSTM, 5 seeds" in row
    tuned, untuned = row.split("at lenpen 1.0")
    for arm in ("tf", "hard", "soft", "soft_risk", "hard_risk"):
        s = results["summary"][arm]["test"]
        assert re.search(re.escape(f"{arm} {s['bleu_mean']:.2f} ± {s['bleu_sd']:.2f}") + r"(?!\d)", tuned), arm
        at_1 = statistics.fmean(scores["test"]["at_lenpen"]["1.0"]["bleu"]
                                for scores in results["scores"][arm].values())
        assert re.search(re.escape(f"{arm} {at_1:.2f}") + r"(?![\d ±])", untuned), arm
    for arm, base in (("soft_risk", "tf"), ("soft_risk", "hard"), ("hard", "tf"), ("soft", "hard"), ("hard_risk", "tf"),
                      ("soft_risk", "hard_risk")):
        t = results["ttest"][base][arm]["test"]
        delta = f"{t['delta_mean']:+.2f}".replace("-", "−")
        assert f"{arm} − {base} {delta} ± {t['delta_sd']:.2f} (p {t['p_value']:.2g})" in untuned, (arm, base)


def test_the_readme_hugging_face_example_prints_what_it_says(repo_root, capsys):
    """The Quick start's search API block runs as written and prints the output its last comment shows."""
    pytest.importorskip("transformers")
    text = (repo_root / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "Seq2SeqSearchDecoder" in b)
    shown = re.search(r"# (\(.*?\) [\d.]+)", block.strip().splitlines()[-1]).group(1)
    exec(compile(block, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == shown


def test_the_readme_first_python_lines_print_what_they_show(repo_root):
    """The first screen's interpreter session (``>>>`` lines) prints, line for line, the output shown under it."""
    import contextlib
    import io

    text = (repo_root / "README.md").read_text()
    session = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(">>> "))
    scope, expected, produced = {}, [], []
    for line in session.strip().splitlines():
        if line.startswith(">>> "):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                try:
                    value = eval(compile(line[4:], "README.md", "eval"), scope)
                except SyntaxError:
                    value = None
                    exec(compile(line[4:], "README.md", "exec"), scope)
                if value is not None:
                    print(repr(value))
            produced += out.getvalue().splitlines()
        else:
            expected.append(line)
    assert expected and produced == expected


def test_the_search_api_docs_trainer_block_runs_as_written(repo_root, tmp_path):
    """docs/search_api.md's Seq2SeqTrainer block is complete (every name defined) and runs: a Marian model from a
    config, its collator, Seq2SeqTrainer with the soft beam-search loss, then generate."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from conftest import clean_env

    text = (repo_root / "docs" / "search_api.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "Seq2SeqTrainer(" in b)
    proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=tmp_path, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"tensor\(\[\[0, [\d, ]+\],\s+\[0, [\d, ]+\]\]\)", proc.stdout), proc.stdout[-2000:]
