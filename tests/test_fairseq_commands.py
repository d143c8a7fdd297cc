"""fairseq_softtopk.experiments.fairseq_commands: running fairseq's tools with logs kept and a quiet progress mode."""

import sys

import pytest

from fairseq_softtopk.experiments.fairseq_commands import progress_line, run_logged

VALID = ("2026-11-23 11:42:55 | INFO | valid | epoch 003 | valid on 'valid' subset | loss 4.849 | nll_loss 2.494 "
         "| ppl 5.63 | wps 1000 | wpb 900 | bsz 50 | num_updates 300 | best_loss 4.8")


def test_progress_line_summarises_fairseq_validation_lines_only():
    assert progress_line("seed1/hard", VALID) == "seed1/hard: epoch 3, update 300: valid loss 4.849"
    assert progress_line("x", "2026-11-23 | INFO | train_inner | epoch 001: 10 / 486 loss=4.478") is None


@pytest.mark.parametrize("echo", [True, False])
def test_run_logged_keeps_every_line_in_the_log_and_prints_per_mode(tmp_path, capsys, echo):
    lines = ["starting", VALID, "done"]
    code = "import sys; sys.stdout.write(" + repr("".join(line + "\n" for line in lines)) + ")"
    log = tmp_path / "train.log"
    out = run_logged([sys.executable, "-c", code], log_path=log, echo=echo, progress="arm")
    assert out.splitlines() == lines and log.read_text().splitlines() == lines
    printed = capsys.readouterr().out.splitlines()
    assert printed == (lines if echo else ["arm: epoch 3, update 300: valid loss 4.849"])


def test_run_logged_raises_with_the_output_tail(tmp_path):
    with pytest.raises(RuntimeError, match="exit code 3.*boom"):
        run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], echo=False)
