#!/usr/bin/env python
"""A small fixture of real beam-search steps: the candidate scores that reach a soft beam search's selection.

The soft beam search of a checkpoint (the ``soft_beam_search`` criterion's defaults: ``--train-beam 5
--teacher-forcing-ratio 0.8``, epsilon 0.03; no gradient) runs over ``--sentences`` sentences of ``--subset``;
every decoding step's ``(sentences, beam * V)`` scores given to ``select_beams`` are recorded (through
:func:`~fairseq_softtopk.search.observe_selections`). A seeded sample of ``--rows`` of those rows, each cut to its
``--keep`` best scores (sorted, largest first, float32; ``-inf`` past a row's finite ones), is written as a
compressed npz with each row's true candidate count ``n`` and finite count, its sentence and step, and a JSON
``meta`` entry saying how it was made. The fixture of tests/test_window_real_steps.py (1.5 MB; 20 s on a CPU)::

    python scripts/diagnostics/capture_beam_steps.py checkpoints/multi30k_en_de_transformer_tf/checkpoint_best.pt \\
        data/multi30k_en_de/bin --out tests/fixtures/beam_steps_multi30k_transformer.npz --threads 1

(``data/multi30k_en_de/bin``: ``bash data_prep/prepare_multi30k.sh --out data/multi30k_en_de --local PATH``.) The
search turns at near ties, so another thread count or torch release gives other scores in some later steps; the
``meta`` records both.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.experiments.checkpoint_sample import (add_sample_arguments, load_model,  # noqa: E402
                                                            quiet_logging, sample_sentences, training_cfg)
from fairseq_softtopk.search import StepSelection, observe_selections  # noqa: E402

#: the criterion's flags of the search recorded (its other options keep their defaults)
FLAGS = ("--train-beam", "5", "--teacher-forcing-ratio", "0.8")


def record_rows(task, model, arch: str, data_bin: str, batches: List[dict]) -> List[Tuple[int, int, torch.Tensor]]:
    """``(sentence, step, scores (beam * V,))`` of every decoding step of each batch's soft beam search."""
    criterion = task.build_criterion(training_cfg(data_bin, arch, list(FLAGS)).criterion)
    recorded: List[Tuple[int, int, torch.Tensor]] = []
    model.eval()
    for sample in batches:
        ids = sample["id"].tolist()

        def record(selection: StepSelection) -> None:
            recorded.extend((ids[b], selection.step, row.float().clone()) for b, row in enumerate(selection.scores))

        with torch.no_grad(), observe_selections(record):
            criterion(model, sample)
    return recorded


def fixture_arrays(recorded: Sequence[Tuple[int, int, torch.Tensor]], rows: int, keep: int, seed: int) -> dict:
    """A seeded sample of ``rows`` recorded rows (in (sentence, step) order), each cut to its ``keep`` best."""
    chosen = torch.randperm(len(recorded), generator=torch.Generator().manual_seed(seed))[:rows]
    chosen = sorted(chosen.tolist(), key=lambda i: recorded[i][:2])
    scores = torch.stack([recorded[i][2] for i in chosen])  # (rows, beam * V)
    return {"scores": scores.topk(min(keep, scores.shape[1]), dim=1).values.numpy(),
            "n": np.full(len(chosen), scores.shape[1], dtype=np.int64),
            "n_finite": torch.isfinite(scores).sum(1).numpy(),
            "sentence": np.array([recorded[i][0] for i in chosen], dtype=np.int64),
            "step": np.array([recorded[i][1] for i in chosen], dtype=np.int64)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sample_arguments(parser, "the plugin's LSTM or Transformer", "valid", 32)
    parser.add_argument("--rows", type=int, default=128, help="rows (sentence, step) kept")
    parser.add_argument("--keep", type=int, default=4096, help="best candidates kept a row")
    parser.add_argument("--out", type=Path, required=True, help="the npz written")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = build_parser().parse_args(argv)
    quiet_logging(opts.threads)
    task, model, arch = load_model(opts.checkpoint, opts.data_bin)
    batches = sample_sentences(task, opts.subset, opts.sentences, opts.seed, opts.max_len)
    recorded = record_rows(task, model, arch, opts.data_bin, batches)
    arrays = fixture_arrays(recorded, opts.rows, opts.keep, opts.seed)
    meta = {"checkpoint": opts.checkpoint.as_posix(), "arch": arch, "subset": opts.subset,
            "sentences": opts.sentences, "max_len": opts.max_len, "seed": opts.seed,
            "criterion": "soft_beam_search " + " ".join(FLAGS) + " (epsilon 0.03, its default; eval, no gradient)",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "rows_recorded": len(recorded), "rows": len(arrays["step"]), "keep": opts.keep,
            "steps": sorted(set(arrays["step"].tolist())),
            "command": "python scripts/diagnostics/capture_beam_steps.py " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv)}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(opts.out, meta=np.array(json.dumps(meta)), **arrays)
    print(f"{opts.out}: {meta['rows']} of {len(recorded)} rows ({arrays['n'][0]} candidates, the best "
          f"{arrays['scores'].shape[1]} kept), steps {meta['steps']}, {opts.out.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
