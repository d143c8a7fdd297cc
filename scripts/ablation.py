#!/usr/bin/env python
"""Stands for the console script ``fairseq-softtopk-ablation`` (:mod:`fairseq_softtopk.cli.ablation`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package (a pinned worktree's too)
from fairseq_softtopk.cli.ablation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
