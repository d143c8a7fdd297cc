"""fairseq-softtopk-options: every option the plugin adds, with its default and help (fairseq's --help omits them)."""

import dataclasses
import re
import subprocess
import sys

import pytest

from conftest import clean_env

from fairseq_softtopk.cli import options
from fairseq_softtopk.criterions.soft_beam_search import SoftBeamSearchConfig
from fairseq_softtopk.models.softtopk_lstm import SoftTopKLSTMConfig
from fairseq_softtopk.models.softtopk_transformer import SoftTopKAttentionConfig


@pytest.mark.parametrize("component, config", [("soft_beam_search", SoftBeamSearchConfig),
                                               ("softtopk_lstm", SoftTopKLSTMConfig),
                                               ("softtopk_transformer", SoftTopKAttentionConfig)])
def test_markdown_lists_every_field_with_its_default_and_help(capsys, component, config):
    assert options.main(["--format", "markdown", "--component", component]) == 0
    out = capsys.readouterr().out
    rows = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^\| `(--[\w-]+)` \| (.*?) \| (.*) \|$", out, re.M)}
    fields = [f for f in dataclasses.fields(config) if not str(f.default).startswith("${") and not f.name.startswith("_")]

    def kind(f):
        return 2 if f.metadata.get("deprecated") else 1 if f.metadata.get("advanced") else 0

    # every option once: the main ones, then the advanced, then the deprecated names, each in field order
    assert list(rows) == ["--" + f.name.replace("_", "-") for f in sorted(fields, key=kind)]
    for f in fields:
        default, meaning = rows["--" + f.name.replace("_", "-")]
        value = f.default.value if hasattr(f.default, "value") else f.default
        if kind(f) == 2:
            assert default == "" and "deprecated alias of --" in meaning
        else:
            assert default == ({True: "on", False: "off"}[value] if isinstance(value, bool) else str(value))
        assert f.metadata["help"].replace("|", "/") in meaning
    if any(kind(f) == 1 for f in fields):
        assert "Advanced (experiments and tuning):" in out
    if any(kind(f) == 2 for f in fields):
        assert "Deprecated names (still accepted, with a warning):" in out
    if component == "soft_beam_search":
        assert "{capped, full, none}" in rows["--topk-grad"][1]  # the choices of an enum option
    if component == "softtopk_lstm":
        assert "softtopk_lstm_multi30k" in out and "softtopk_lstm_tiny" in out  # the named architectures


def test_an_unknown_component_is_named(capsys):
    with pytest.raises(SystemExit):
        options.main(["--component", "soft_beam"])
    assert "unknown components ['soft_beam']" in capsys.readouterr().err


def test_runs_as_a_module_from_outside_the_repository(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fairseq_softtopk.cli.options"], cwd=tmp_path, capture_output=True,
                          text=True, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    for title in ("criterion soft_beam_search", "model softtopk_lstm", "model softtopk_transformer"):
        assert title in proc.stdout
    assert "--teacher-forcing-ratio (default: 0.8)" in proc.stdout


def test_console_script_is_declared(repo_root):
    text = (repo_root / "pyproject.toml").read_text()
    assert 'fairseq-softtopk-options = "fairseq_softtopk.cli.options:main"' in text


@pytest.mark.slow
def test_the_plugin_trains_and_generates_from_outside_the_repository(toy_data_bin, tmp_path):
    """The absolute --user-dir that `fairseq-softtopk-options --user-dir` prints: fairseq-train and
    fairseq-generate run from a directory that is not the repository, as on a user's own project."""
    from conftest import run_fairseq

    _, data_bin = toy_data_bin
    user_dir = subprocess.run([sys.executable, "-m", "fairseq_softtopk.cli.options", "--user-dir"], cwd=tmp_path,
                              capture_output=True, text=True, env=clean_env(), check=True).stdout.strip()
    assert user_dir.endswith("fairseq_softtopk") and user_dir.startswith("/")
    save = tmp_path / "checkpoints"
    run_fairseq("train", [data_bin, "--user-dir", user_dir, "--arch", "softtopk_lstm_tiny", "--criterion",
                          "soft_beam_search", "--train-beam", "2", "--optimizer", "adam", "--lr", "0.01",
                          "--max-tokens", "1000", "--max-update", "3", "--cpu", "--no-progress-bar",
                          "--disable-validation", "--num-workers", "0", "--save-dir", save], cwd=tmp_path)
    gen = run_fairseq("generate", [data_bin, "--user-dir", user_dir, "--path", save / "checkpoint_last.pt",
                                   "--gen-subset", "test", "--beam", "2", "--batch-size", "16", "--cpu",
                                   "--required-batch-size-multiple", "1"], cwd=tmp_path)
    assert len(re.findall(r"^H-\d+\t", gen.stdout, flags=re.M)) == 40
