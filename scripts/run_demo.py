#!/usr/bin/env python
"""The main job on the embedded default: no download, no GPU.

Generates the toy language pair (:mod:`fairseq_softtopk.data.toy_language_pair`), binarises
it, trains fairseq's built-in ``lstm`` for about a minute on a CPU, translates the test set
with beam search and prints sacrebleu BLEU. Finished steps are reused on a re-run; pass
``--fresh`` to train again from scratch in a new directory.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from evaluate import evaluate_checkpoint
from fairseq_commands import binarize_generated_corpus, fairseq_command, run_logged

LSTM_ARGS = [
    "--arch", "lstm", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-hidden-size", "128", "--decoder-hidden-size", "128", "--decoder-out-embed-dim", "64",
    "--encoder-bidirectional", "--dropout", "0.1",
    "--optimizer", "adam", "--lr", "0.01", "--clip-norm", "1.0",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "1000", "--seed", "1", "--num-workers", "0",
]


def train(data_bin: Path, save_dir: Path, epochs: int) -> Path:
    checkpoint = save_dir / "checkpoint_last.pt"
    run_logged(fairseq_command("train", [
        data_bin, *LSTM_ARGS, "--max-epoch", epochs, "--save-dir", save_dir, "--cpu",
        "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "50"]),
        log_path=save_dir.parent / "train.log")
    return checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--work-dir", default="runs/demo", help="where data, checkpoints and results go")
    parser.add_argument("--epochs", type=int, default=8, help="training epochs (8: about a minute on an idle 2-core CPU)")
    parser.add_argument("--fresh", action="store_true", help="discard an earlier run's checkpoints")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    if args.fresh and (work / "checkpoints").exists():
        shutil.rmtree(work / "checkpoints")
    (work / "checkpoints").mkdir(parents=True, exist_ok=True)

    start = time.time()
    data_bin = binarize_generated_corpus(work)
    checkpoint = train(data_bin, work / "checkpoints", args.epochs)
    train_seconds = time.time() - start
    result = evaluate_checkpoint(str(data_bin), str(checkpoint), str(work / "raw" / "test.tgt"),
                                 beam=5, hyp_out=str(work / "test.hyp"))
    result["train_and_prepare_seconds"] = round(train_seconds, 1)
    (work / "results.json").write_text(json.dumps(result, indent=2))
    print(f"\nToy language pair, fairseq lstm, {args.epochs} epochs ({train_seconds:.0f} s), beam 5:")
    print(f"  BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  on {result['n_sentences']} test sentences")
    print(f"  {result['bleu_signature']}")
    print(f"  results: {work / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
