"""Beam-search training ablation: one teacher-forcing checkpoint, several fine-tuning arms:
``fairseq-softtopk-ablation``.

A ``finetune`` config (``configs/*_finetune.yaml``) names its ``pretrain`` config. The
pretrained checkpoint is trained first if it is missing (or given with ``--pretrained``);
every arm (teacher forcing continued = the baseline, beam ``hard``, beam ``soft``, ...) is
then fine-tuned from it with ``--finetune-from-model``, the same update budget, batch size
and seed, and its ``checkpoint_last.pt`` (the config's ``eval: checkpoint: best``: its ``checkpoint_best.pt``) is
translated and scored as by ``fairseq-softtopk-bleu`` (``eval: lenpen_grid``: at the length penalty that scores
best on valid). ``--score-pretrained`` scores the ``--pretrained`` checkpoint the same way (the report's first
row). A
``scratch`` config (attention normalisers) trains every arm from scratch instead.
The runner writes ``results.md``, ``results.json`` (BLEU, chrF, sacrebleu signatures,
paired bootstrap against the baseline, mean and spread over ``--seeds``) and ``curves.png``.

Re-running skips finished arms (``done.json``, written atomically after training); a
half-finished arm resumes from its ``checkpoint_last.pt``. A work directory refuses to
continue a run whose fairseq-train arguments have changed (naming each flag, earlier and new
value), or whose data have (``data.json``: the dictionaries and the training and validation
splits' index files by digest, their data files by size, recorded when the run starts). Before
anything runs, every flag of every stage and arm is checked against fairseq-train's parser (with
this package as ``--user-dir``): an unknown flag is named with the config section that sets it.
A requested arm that cannot train here (``--criterion
beamgrad_risk`` without the optional package beamgrad) is skipped then, with a warning naming
the install command, and listed in the report; a request of such arms only is an error.

Ctrl-C or SIGTERM stops every fairseq process the runner started (within seconds), starts no
further run, keeps every finished run and prints what finished, what will resume and the
command to rerun; the exit status is 130 (SIGINT) or 143 (SIGTERM). The work directory is
locked from the start, and each run directory while a process trains in it (``run.lock``): a
second runner on the same directory is refused at once, naming the process. A finished run's
``checkpoint_last.pt`` is checked against the SHA-256 recorded in its ``done.json`` before it is
fine-tuned from or scored; ``--pretrained`` (before anything runs) and a ``checkpoint_last.pt`` to
resume from are read whole (every zip member's CRC-32: torch checks none). The same command with
``--status`` prints what each of its runs has done (also while it runs) and exits.

Example (``DIR`` as written by ``data_prep/prepare_multi30k.sh --out DIR``: ``DIR/bin``
and ``DIR/raw``)::

    fairseq-softtopk-ablation configs/multi30k_en_de_finetune.yaml --data-dir DIR \\
        --work-dir runs/multi30k_ablation --seeds 1 2 3 --set train.max-update=3000

(or ``python -m fairseq_softtopk.cli.ablation ...``; the runner is
:mod:`fairseq_softtopk.experiments.ablation_runner`).
"""

import argparse
import functools
import logging
import shlex
import sys
from pathlib import Path
from typing import Sequence

from fairseq_softtopk.experiments.ablation_config import load_config
from fairseq_softtopk.experiments.ablation_report import results_markdown
from fairseq_softtopk.experiments.ablation_runner import (check_jobs, check_seeds, check_work_dir, run_ablation,
                                                           run_plan, select_arms)
from fairseq_softtopk.experiments.run_status import status_lines
from fairseq_softtopk.experiments.child_processes import RunStopped, stop_on_signals
from fairseq_softtopk.extras import exit_unless_installed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a finetune (or scratch) stage config, e.g. configs/toy_finetune.yaml")
    parser.add_argument("--data-dir", help="prepared data: DIR/bin (fairseq-preprocess) and DIR/raw (references)")
    parser.add_argument("--data-bin", help="fairseq-preprocess directory (default: DATA_DIR/bin)")
    parser.add_argument("--ref-dir", help="raw references {subset}.{tgt} (default: DATA_DIR/raw; "
                                          "none: score against the binarised target)")
    parser.add_argument("--work-dir", required=True, help="checkpoints, logs, results.{md,json}, curves.png")
    parser.add_argument("--pretrained", help="teacher-forcing checkpoint to fine-tune (default: train the "
                                             "config's pretrain stage into WORK_DIR/pretrain if missing)")
    parser.add_argument("--score-pretrained", action="store_true",
                        help="also score the --pretrained checkpoint with the config's eval settings (the report's "
                             "'pretrained' row)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="fine-tuning seeds (default: 1)")
    parser.add_argument("--arms", nargs="+", help="arms to run (default: the config's default_arms)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FLAG=VALUE",
                        help="override a config value, e.g. train.max-update=300 or pretrain.train.max-epoch=2")
    parser.add_argument("--bootstrap-samples", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=1,
                        help="fine-tuning runs at the same time (e.g. one per core with OMP_NUM_THREADS=1)")
    parser.add_argument("--quiet", action="store_true",
                        help="print one line per validation instead of fairseq's logs (kept in each train.log)")
    parser.add_argument("--translate-sources", metavar="DIR",
                        help="also translate every NAME.SRC (or NAME.SRC.gz) file of DIR, sources without references "
                             "such as held-out test sets, with each run's scored checkpoint at its chosen length "
                             "penalty: RUN/translations/NAME.TGT, detokenised, one line a source line; not scored "
                             "(segmented with DATA_DIR/bpe: needs --data-dir)")
    parser.add_argument("--status", action="store_true",
                        help="print what each run of this command has done (finished with its BLEU, training at "
                             "update N, stopped, not started) and exit; safe beside the running command")
    args = parser.parse_args(argv)
    exit_unless_installed(parser, "experiments")  # one line naming the extra, before anything imports it
    typed = ["fairseq-softtopk-ablation", *(sys.argv[1:] if argv is None else argv)]
    command = " ".join(typed)
    work_dir_check = functools.partial(check_work_dir, writable=not args.status)  # --status writes nothing
    for flag, check, value in (("--seeds", check_seeds, args.seeds), ("--jobs", check_jobs, args.jobs),
                               ("--work-dir", work_dir_check, Path(args.work_dir))):
        try:
            check(value)
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {flag}: {error}\n")
    if args.score_pretrained and not args.pretrained:
        parser.exit(2, f"{parser.prog}: error: --score-pretrained scores the --pretrained checkpoint: pass one\n")
    if args.status:
        try:
            print("\n".join(status_report(load_config(args.config, args.set), Path(args.work_dir), args)))
        except (FileNotFoundError, ValueError) as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    with stop_on_signals():
        try:
            config = load_config(args.config, args.set)
            if not (args.data_dir or args.data_bin):
                raise ValueError(f"pass --data-dir or --data-bin ({args.config} expects: {config.get('data')})")
            data_bin = Path(args.data_bin or Path(args.data_dir) / "bin")
            ref_dir = args.ref_dir or (Path(args.data_dir) / "raw" if args.data_dir else None)
            results = run_ablation(config, data_bin, args.work_dir, ref_dir, args.seeds, args.arms, args.pretrained,
                                   args.bootstrap_samples, verbose=not args.quiet, jobs=args.jobs,
                                   command=command, score_pretrained=args.score_pretrained,
                                   translate_sources=args.translate_sources,
                                   bpe_dir=Path(args.data_dir) / "bpe" if args.data_dir else None)
        except (FileNotFoundError, ValueError, RuntimeError) as error:
            parser.exit(1 if isinstance(error, RuntimeError) else 2, f"{parser.prog}: error: {error}\n")
        except RunStopped as stop:
            sys.stderr.write(stopped_message(parser.prog, stop, typed))
            return stop.exit_status
    print(results_markdown(results))
    return 0


def status_report(config: dict, work_dir: Path, args: argparse.Namespace) -> list:
    """``--status``: the lines of :func:`~fairseq_softtopk.experiments.run_status.status_lines` for the runs
    these arguments schedule (with the pretrained checkpoint's scoring where ``--score-pretrained``)."""
    if not work_dir.is_dir():
        raise FileNotFoundError(f"--work-dir {work_dir} does not exist: nothing has run there yet")
    arms, _ = select_arms(config, args.arms)
    lines = [f"{work_dir}: {config['path']}, seeds {' '.join(map(str, args.seeds))}, arms {' '.join(arms)}"]
    if args.score_pretrained and args.pretrained:
        scored = (work_dir / "pretrained" / "eval.json").exists()
        lines.append(f"  pretrained checkpoint: {'scored' if scored else 'not scored yet'}")
    lines += status_lines(run_plan(config, work_dir, args.seeds, arms, args.pretrained))
    if (work_dir / "results.md").exists():
        lines.append(f"report: {work_dir / 'results.md'}")
    return lines


def stopped_message(prog: str, stop: RunStopped, typed: Sequence[str]) -> str:
    """The message of a stopped command (``typed``: its words, to rerun): what finished, what resumes."""
    lines = [f"{prog}: stopped by {stop.signal_name}; every fairseq process it started has ended.",
             *(stop.lines or ["  (stopped before any run started)"]),
             "Finished runs are kept and unfinished ones resume from their last checkpoint; to go on, rerun:",
             f"  {shlex.join(typed)}"]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    sys.exit(main())
