"""scripts/examples/hf_multi30k.py on a tiny prepared corpus: every stage runs, the table and results.json are
written, a rerun trains nothing again, and bad data is named."""

import json
import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import script_module  # noqa: E402

example = script_module("examples/hf_multi30k.py")

WORDS_EN = ["▁a", "▁man", "▁dog", "▁runs", "▁on", "▁the", "▁grass", "▁."]
WORDS_DE = ["▁ein", "▁Mann", "▁Hund", "▁läuft", "▁auf", "▁dem", "▁Gras", "▁."]


def _prepared(root, n_train=24, n_test=6):
    """The layout of data_prep/prepare_multi30k.sh's output: bpe/, bin/dict.en.txt, raw/test.de."""
    for sub in ("bpe", "bin", "raw"):
        (root / sub).mkdir(parents=True)
    lines = {"en": [], "de": []}
    for i in range(n_train + n_test):
        picks = [(i * 3 + j) % 7 for j in range(2 + i % 3)]
        lines["en"].append(" ".join(WORDS_EN[p] for p in picks) + " ▁.")
        lines["de"].append(" ".join(WORDS_DE[p] for p in picks) + " ▁.")
    for lang in ("en", "de"):
        (root / "bpe" / f"train.{lang}").write_text("\n".join(lines[lang][:n_train]) + "\n")
        (root / "bpe" / f"test.{lang}").write_text("\n".join(lines[lang][n_train:]) + "\n")
    (root / "raw" / "test.de").write_text("\n".join(
        "".join(line.split()).replace("▁", " ").strip() for line in lines["de"][n_train:]) + "\n")
    (root / "bin" / "dict.en.txt").write_text("".join(f"{w} 5\n" for w in WORDS_EN + WORDS_DE))
    return root


ARGS = ["--d-model", "16", "--layers", "1", "--tf-epochs", "2", "--batch-size", "8", "--beam-updates", "2",
        "--beam-batch-size", "4", "--beam", "2", "--threads", "1"]


def test_every_stage_runs_and_a_rerun_trains_nothing_again(tmp_path, capsys):
    data, out = _prepared(tmp_path / "data"), tmp_path / "out"
    assert example.main(["--data", str(data), "--out", str(out), *ARGS]) == 0
    table = capsys.readouterr().out
    assert "| teacher forcing |" in table and "| + 2 soft beam-search updates |" in table and "nrefs:1" in table
    results = json.loads((out / "results.json").read_text())
    assert results["bleu_before"]["n_sentences"] == results["bleu_after"]["n_sentences"] == 6
    beam_steps = [entry for entry in results["soft_beam_search"]["log"] if "train_runtime" in entry]
    assert beam_steps and results["soft_beam_search"]["log"][-1]["step"] == 2
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("model.safetensors")}
    assert len(stamps) == 2
    assert example.main(["--data", str(data), "--out", str(out), *ARGS]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("model.safetensors")} == stamps
    # minimum risk from the same teacher-forcing model: only the fine-tuning stage runs
    risk_out = tmp_path / "risk"
    shutil.copytree(out / "teacher_forcing", risk_out / "teacher_forcing")
    (risk_out / "results.json").write_text(json.dumps({key: results[key] for key in ("teacher_forcing",
                                                                                    "bleu_before")}))
    assert example.main(["--data", str(data), "--out", str(risk_out), *ARGS, "--beam-loss", "risk",
                         "--teacher-forcing-ratio", "0.5"]) == 0
    risk = json.loads((risk_out / "results.json").read_text())
    assert risk["soft_beam_search"]["args"]["beam_loss"] == "risk" and risk["soft_beam_search"]["log"][-1]["step"] == 2
    assert risk["bleu_after"]["n_sentences"] == 6 and "teacher_forcing" in risk


def test_bad_data_is_named(tmp_path):
    data = _prepared(tmp_path / "data")
    (data / "bpe" / "test.de").write_text("▁ein ▁Mann\n")
    with pytest.raises(ValueError, match="test: 6 source lines but 1 target lines"):
        example.main(["--data", str(data), "--out", str(tmp_path / "out"), *ARGS])
    with pytest.raises(FileNotFoundError, match="no dictionary at .*run data_prep/prepare_multi30k.sh first"):
        example.main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out2"), *ARGS])
