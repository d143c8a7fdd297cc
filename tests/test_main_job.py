"""The main job (fairseq-softtopk-main-job: python -m fairseq_softtopk.cli.main_job, what `make demo` runs), on a
shrunken demo corpus."""

import json
import re
import subprocess
import sys

import pytest

from conftest import clean_env


@pytest.mark.slow
def test_main_job_is_quiet_and_ends_with_the_table(tmp_path, repo_root):
    work = tmp_path / "main_job"
    cmd = [sys.executable, "-m", "fairseq_softtopk.cli.main_job", "--work-dir", str(work),
           "--sizes", "200", "20", "30", "--seeds", "1", "2",
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
    # each seed pretrained its own model (with its seed), and its arms started from it
    assert results["pretrain_per_seed"] and sorted(results["scores"]["pretrained"]) == ["1", "2"]
    for seed in (1, 2):
        pretrain_args = json.loads((work / f"seed{seed}" / "pretrain" / "run.json").read_text())["args"]
        assert pretrain_args[pretrain_args.index("--seed") + 1] == str(seed)
        soft_args = json.loads((work / f"seed{seed}" / "soft" / "run.json").read_text())["args"]
        assert soft_args[soft_args.index("--finetune-from-model") + 1] == str(
            work / f"seed{seed}" / "pretrain" / "checkpoint_last.pt")
    assert not (work / "pretrain").exists()
    assert "Not compared with README's table" in out  # shrunken settings: no comparison
    # provenance: the command as typed and the commit of the code that ran
    assert results["command"].startswith("fairseq-softtopk-main-job --work-dir ")
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", results["commit"])
    assert f"- command: `{results['command']}` at commit `{results['commit']}`" in table
    assert len((work / "raw" / "train.src").read_text().splitlines()) == 200
