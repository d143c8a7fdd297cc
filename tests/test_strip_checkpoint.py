"""scripts/strip_checkpoint.py: a checkpoint without its optimizer state, loaded weights-only, never overwriting."""

import argparse
import hashlib

import pytest
import torch

from conftest import script_module


@pytest.fixture
def checkpoint(tmp_path):
    shared = torch.randn(6, 4)
    state = {"args": argparse.Namespace(arch="softtopk_lstm_tiny"),  # what the allowlist must let through
             "model": {"encoder.embed_tokens.weight": shared, "decoder.embed_tokens.weight": shared,
                       "decoder.out.bias": torch.randn(6)},
             "last_optimizer_state": {"state": {0: {"exp_avg": torch.randn(6, 4)}}},
             "extra_state": {"epoch": 3}}
    path = tmp_path / "checkpoint_last.pt"
    torch.save(state, path)
    return path, state


def test_strips_the_optimizer_state_and_keeps_the_rest(checkpoint, tmp_path, capsys):
    source, state = checkpoint
    target = tmp_path / "out" / "checkpoint_best.pt"
    assert script_module("strip_checkpoint.py").main([str(source), str(target)]) == 0
    stripped = torch.load(target, weights_only=False)
    assert "last_optimizer_state" not in stripped and stripped["extra_state"] == {"epoch": 3}
    assert stripped["args"].arch == "softtopk_lstm_tiny"
    for name, tensor in state["model"].items():
        assert torch.equal(stripped["model"][name], tensor)
    out = capsys.readouterr().out
    assert out.startswith(hashlib.sha256(target.read_bytes()).hexdigest())
    assert "30 model parameters" in out  # 6 x 4 tied once, plus 6
    assert not list(target.parent.glob("*.partial"))


def test_cuts_the_configs_machine_paths(tmp_path):
    """A shipped checkpoint's config named the training machine's directories (``task.data``, ``save_dir``, a
    worktree's ``user_dir``): cut as results/ are; every other value, and the model, unchanged."""
    from fairseq_softtopk.experiments.publish import absolute_paths

    cfg = {"common": {"user_dir": "/work/wt_t28/fairseq_softtopk", "seed": 3, "log_format": "simple"},
           "task": {"data": "/home/me/data/multi30k_en_de/bin", "source_lang": "en"},
           "checkpoint": {"save_dir": "/work/main/runs/transformer_ablation/pretrain", "keep_last_epochs": -1},
           "generation": {"lenpen": 1.0, "print_alignment": None}, "model": {"layers": [256, 256]}}
    state = {"cfg": cfg, "args": None, "model": {"w": torch.ones(2)}, "extra_state": {"epoch": 1}}
    torch.save(state, tmp_path / "source.pt")
    script_module("strip_checkpoint.py").strip_checkpoint(tmp_path / "source.pt", tmp_path / "target.pt")
    stripped = torch.load(tmp_path / "target.pt", weights_only=False)
    assert stripped["cfg"]["common"] == {"user_dir": "fairseq_softtopk", "seed": 3, "log_format": "simple"}
    assert stripped["cfg"]["task"] == {"data": "data/multi30k_en_de/bin", "source_lang": "en"}
    assert stripped["cfg"]["checkpoint"] == {"save_dir": "runs/transformer_ablation/pretrain", "keep_last_epochs": -1}
    assert stripped["cfg"]["generation"] == cfg["generation"] and stripped["cfg"]["model"] == cfg["model"]
    assert stripped["args"] is None and not absolute_paths(repr(stripped["cfg"]))
    namespace = script_module("strip_checkpoint.py").without_machine_paths(
        argparse.Namespace(data="/srv/x/runs/bin", arch="lstm", lr=[0.1]))
    assert vars(namespace) == {"data": "runs/bin", "arch": "lstm", "lr": [0.1]}


def test_refuses_to_overwrite_and_names_bad_input(checkpoint, tmp_path):
    module = script_module("strip_checkpoint.py")
    source, _ = checkpoint
    target = tmp_path / "checkpoint_best.pt"
    target.write_bytes(b"finished output")
    with pytest.raises(FileExistsError, match="not overwritten"):
        module.strip_checkpoint(source, target)
    assert target.read_bytes() == b"finished output"
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        module.strip_checkpoint(tmp_path / "missing.pt", tmp_path / "x.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a fairseq checkpoint"):
        module.strip_checkpoint(tmp_path / "plain.pt", tmp_path / "y.pt")
