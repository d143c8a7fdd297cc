"""fairseq-softtopk-bleu's bad input: one line naming the cause, exit status 2, before any translating.

fairseq-generate is replaced by a stand-in that fails the test if it is reached: every check here
must come first (it came after fairseq's config dump, or after the whole translation).
"""

import argparse
import os

import pytest
import torch

from conftest import overwrite_tensor_bytes
from fairseq_softtopk.cli import bleu
from fairseq_softtopk.experiments import scoring
from fairseq_softtopk.experiments.eval_inputs import refused_checkpoint


@pytest.fixture
def no_generation(monkeypatch):
    def generate(*args, **kwargs):
        raise AssertionError("fairseq-generate ran")

    monkeypatch.setattr(scoring, "run_fairseq_generate", generate)


def _checkpoint(path, src_rows: int, tgt_rows: int, legacy: bool = False):
    """A checkpoint of a translation model whose embeddings have ``src_rows``/``tgt_rows`` rows."""
    model = {"encoder.embed_tokens.weight": torch.zeros(src_rows, 4),
             "decoder.embed_tokens.weight": torch.zeros(tgt_rows, 4)}
    config = {"args": argparse.Namespace(task="translation")} if legacy else {"cfg": {"task": {"_name": "translation"}}}
    torch.save({**config, "model": model}, path)
    return path


def _dictionary_size(data_bin, lang: str) -> int:
    from fairseq.data import Dictionary

    return len(Dictionary.load(str(data_bin / f"dict.{lang}.txt")))


def _run(capsys, *argv) -> str:
    """bleu.main's exit status must be 2; returns its one-line error."""
    with pytest.raises(SystemExit) as exit_info:
        bleu.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("flag, value, shown", [("--beam", "0", "0"), ("--beam", "-2", "-2"),
                                                ("--batch-size", "0", "0"), ("--lenpen", "nan", "nan"),
                                                ("--lenpen", "inf", "inf")])
def test_bad_decoding_numbers_are_named(toy_data_bin, tmp_path, capsys, no_generation, flag, value, shown):
    """--beam 0 ended in fairseq's "cannot reshape tensor of 0 elements" after the config dump."""
    raw, data_bin = toy_data_bin
    ckpt = _checkpoint(tmp_path / "c.pt", 1, 1)
    err = _run(capsys, data_bin, ckpt, "--ref", raw / "test.tgt", flag, value)
    assert f"{flag} must be" in err and err.endswith(f"got {shown}")


def test_unwritable_outputs_are_found_before_translating(toy_data_bin, tmp_path, capsys, no_generation):
    """--json and --hyp-out under a file, or naming a directory: the scores were lost after the translation."""
    raw, data_bin = toy_data_bin
    ckpt = _checkpoint(tmp_path / "c.pt", 1, 1)
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    base = [data_bin, ckpt, "--ref", raw / "test.tgt"]
    err = _run(capsys, *base, "--json", blocker / "out" / "scores.json")
    assert err.endswith(f"--json {blocker / 'out' / 'scores.json'} cannot be written: {blocker} is a file, "
                        f"not a directory")
    err = _run(capsys, *base, "--hyp-out", tmp_path)
    assert f"--hyp-out {tmp_path} is a directory" in err
    assert blocker.read_text() == "x"


def test_an_output_directory_without_write_permission_is_named(toy_data_bin, tmp_path, capsys, no_generation):
    raw, data_bin = toy_data_bin
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):
        pytest.skip("file permissions do not bind this user (root with CAP_DAC_OVERRIDE)")
    err = _run(capsys, data_bin, _checkpoint(tmp_path / "c.pt", 1, 1), "--ref", raw / "test.tgt",
               "--json", locked / "new" / "scores.json")
    assert f"no permission to create files in {locked}" in err


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's /sys, where nobody creates files")
def test_an_output_where_even_root_cannot_create_files_is_found_by_trying(toy_data_bin, tmp_path, capsys,
                                                                         no_generation):
    """--hyp-out in /sys (or another place where os.access says yes to root and the write fails): the whole subset
    was translated, then a PermissionError traceback, no BLEU printed. Now a file is created there first (and
    removed), so the error comes before translating; a place that takes files passes and leaves nothing behind."""
    raw, data_bin = toy_data_bin
    ckpt = _checkpoint(tmp_path / "c.pt", _dictionary_size(data_bin, "src"), _dictionary_size(data_bin, "tgt"))
    hyp = "/sys/kernel/softtopk_test.hyp"
    err = _run(capsys, data_bin, ckpt, "--ref", raw / "test.tgt", "--hyp-out", hyp)
    assert f"--hyp-out {hyp} cannot be written: " in err and "/sys/kernel" in err.split("cannot be written: ")[1]
    (tmp_path / "out").mkdir()
    (tmp_path / "scores.json").write_text("earlier")
    with pytest.raises(AssertionError, match="fairseq-generate ran"):
        bleu.main([str(data_bin), str(ckpt), "--ref", str(raw / "test.tgt"), "--hyp-out", str(tmp_path / "out" / "h"),
                   "--json", str(tmp_path / "scores.json")])
    assert not list((tmp_path / "out").iterdir()) and (tmp_path / "scores.json").read_text() == "earlier"


def test_a_missing_data_directory_or_subset_is_named(toy_data_bin, tmp_path, capsys, no_generation):
    """fairseq's FileNotFoundError traceback came after the config dump."""
    raw, data_bin = toy_data_bin
    ckpt = _checkpoint(tmp_path / "c.pt", 1, 1)
    err = _run(capsys, tmp_path / "no_such_bin", ckpt, "--ref", raw / "test.tgt")
    assert err.endswith(f"data directory not found: {tmp_path / 'no_such_bin'} (give fairseq-preprocess's --destdir)")
    err = _run(capsys, data_bin, ckpt, "--ref", raw / "test.tgt", "--subset", "test1")
    assert f"no 'test1' subset in {data_bin} (it has test, train, valid)" in err


@pytest.mark.parametrize("legacy", [False, True])
def test_a_checkpoint_of_another_dictionary_is_named_with_both_sizes(toy_data_bin, tmp_path, capsys, monkeypatch,
                                                                     legacy):
    """fairseq failed with "size mismatch for encoder.embed_tokens.weight" after loading everything; a
    checkpoint of the same dictionaries goes on to translate."""
    raw, data_bin = toy_data_bin
    src, tgt = _dictionary_size(data_bin, "src"), _dictionary_size(data_bin, "tgt")
    other = _checkpoint(tmp_path / "other.pt", src, tgt + 3, legacy)
    err = _run(capsys, data_bin, other, "--ref", raw / "test.tgt")
    assert f"checkpoint {other} was trained with another dictionary than {data_bin}" in err
    assert f"decoder embedding has {tgt + 3} rows, {data_bin / 'dict.tgt.txt'} holds {tgt} symbols" in err
    ran = []
    monkeypatch.setattr(scoring, "run_fairseq_generate", lambda *args, **kwargs: ran.append(args) or "")
    with pytest.raises(ValueError, match="returned 0 hypotheses"):  # the stand-in translates nothing
        scoring.evaluate_checkpoint(str(data_bin), str(_checkpoint(tmp_path / "same.pt", src, tgt, legacy)),
                                    str(raw / "test.tgt"))
    assert len(ran) == 1


def test_a_truncated_or_missing_checkpoint_is_named(toy_data_bin, tmp_path, capsys, no_generation):
    raw, data_bin = toy_data_bin
    whole = _checkpoint(tmp_path / "whole.pt", 600, 600).read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole[:len(whole) // 3])
    err = _run(capsys, data_bin, cut, "--ref", raw / "test.tgt")
    assert f"{cut} is not a complete checkpoint: " in err and f"{len(whole) // 3:,} bytes" in err
    err = _run(capsys, data_bin, tmp_path / "none.pt", "--ref", raw / "test.tgt")
    assert err.endswith(f"checkpoint not found: {tmp_path / 'none.pt'}")


def test_a_checkpoint_whose_tensor_bytes_changed_is_named_before_translating(toy_data_bin, tmp_path, capsys,
                                                                             no_generation):
    """Bytes overwritten inside a tensor (same size, the zip's CRC-32 wrong): torch loads the file without a word,
    and it was translated and scored; now the whole file is read first, and the error names it and the member."""
    raw, data_bin = toy_data_bin
    damaged = _checkpoint(tmp_path / "damaged.pt", _dictionary_size(data_bin, "src"), _dictionary_size(data_bin, "tgt"))
    size = damaged.stat().st_size
    member = overwrite_tensor_bytes(damaged)
    assert damaged.stat().st_size == size and torch.load(damaged, weights_only=True)  # loads: nothing said
    err = _run(capsys, data_bin, damaged, "--ref", raw / "test.tgt")
    assert f"{damaged} is not a complete checkpoint: its member {member} fails its CRC-32 check" in err
    assert err.endswith("Nothing was translated: score a whole copy of it.")


class _Call:
    """Pickles as a call of os.getcwd: harmless, but code that the weights-only unpickler refuses."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_a_checkpoint_with_code_is_kept_from_fairseq_under_forced_unsafe_loading(toy_data_bin, tmp_path, capsys,
                                                                                  monkeypatch, no_generation):
    """With TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set fairseq-generate would unpickle it (run the code); without
    it fairseq-generate refuses it itself (tests/test_fairseq_integration.py)."""
    raw, data_bin = toy_data_bin
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "extra": _Call()}, evil)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    err = _run(capsys, data_bin, evil, "--ref", raw / "test.tgt")
    assert f"{evil} was not loaded" in err and "(posix.getcwd)" in err
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set" in err
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    with pytest.raises(AssertionError, match="fairseq-generate ran"):
        bleu.main([str(data_bin), str(evil), "--ref", str(raw / "test.tgt")])


# fairseq-generate's last lines for a checkpoint trained with a dictionary of 624 symbols, given one of 629
_SIZE_MISMATCH = """\
2026-11-26 13:30:01 | INFO | fairseq_cli.generate | loading model(s) from ck1/checkpoint_last.pt
Traceback (most recent call last):
RuntimeError: Error(s) in loading state_dict for SoftTopKLSTMModel:
\tsize mismatch for encoder.embed_tokens.weight: copying a param with shape torch.Size([624, 8]) from checkpoint, \
the shape in current model is torch.Size([629, 8]).
\tsize mismatch for decoder.output_proj.bias: copying a param with shape torch.Size([624]) from checkpoint, \
the shape in current model is torch.Size([629]).
"""


def test_fairseqs_size_mismatch_and_missing_files_become_one_line():
    """What the ablation runner and the scoring report when fairseq itself fails on a checkpoint."""
    assert refused_checkpoint(_SIZE_MISMATCH) == (
        "checkpoint ck1/checkpoint_last.pt does not fit the model fairseq built for this data: its "
        "encoder.embed_tokens.weight has shape [624, 8], the model's [629, 8]; it was trained with another "
        "dictionary (624 symbols; the data directory's has 629)")
    layers = _SIZE_MISMATCH.replace("encoder.embed_tokens.weight", "encoder.layers.0.weight")
    assert refused_checkpoint(layers).endswith("trained with another architecture or model settings")
    assert refused_checkpoint("...\nValueError: --finetune-from-model /x/pre.pt does not exist\n") == \
        "/x/pre.pt: no such checkpoint file"
    assert refused_checkpoint("...\nfairseq_softtopk.checkpoint_safety.CorruptCheckpointError: a.pt is not a "
                              "complete checkpoint: ...\n") == "a.pt is not a complete checkpoint: ..."
    assert refused_checkpoint("Traceback\nKeyError: 'x'\n") is None
