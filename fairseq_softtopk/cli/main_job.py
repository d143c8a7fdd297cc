"""The main job: the beam-search training ablation on the embedded demo language pair (no download, no GPU):
``fairseq-softtopk-main-job`` (what ``make demo`` runs).

1. Generates the demo language pair (:mod:`fairseq_softtopk.data.demo_language_pair`: 8,000
   training, 400 valid and 500 test sentences of 15-40 tokens) into ``WORK/raw`` and
   binarises it into ``WORK/bin`` (separate source and target dictionaries).
2. Runs ``configs/demo_finetune.yaml`` with the ablation runner
   (:mod:`fairseq_softtopk.experiments.ablation_runner`): for each of three seeds, fine-tunes the
   arms ``tf`` (baseline), ``hard`` and ``soft`` from the shipped teacher-forcing model
   (:data:`PRETRAINED`, trained by ``configs/demo_pretrain.yaml``, 30 epochs) with
   equal update budgets (two runs side by side, the cores shared among them), evaluates every
   model and the pretrained one on the test set with sacrebleu and paired bootstrap. The model is
   shipped, not trained here: its training crosses two loss plateaus whose lengths change with the
   float arithmetic (the same config with AVX2 kernels was still on the second after 30 epochs, at
   valid loss 2.35 against 1.81), and 30 epochs take longer than the whole job (about 25 minutes
   on one core). ``--pretrain`` trains it (expect another model).
3. Prints one line per stage and validation (fairseq's logs go to each run's ``train.log``;
   ``--verbose`` prints them), then the results table (``WORK/results.md``; also
   ``results.json`` and ``curves.png``), then whether the run agrees with README's table
   (``WORK/agreement.md``; :mod:`fairseq_softtopk.experiments.reference_comparison`).

Re-running reuses the data and every finished stage; ``--fresh`` trains again (the data are
kept): it removes only what the main job recorded creating in ``WORK/main_job.json``, and refuses
a non-empty directory without that file (naming it). Ctrl-C or SIGTERM stops every fairseq
process (exit status 130 or 143) and prints what finished and the command that resumes the rest. The pair is generated, so the table shows what the pipeline measures, not the paper's
claim about real translation (see the notes in results.md).

    fairseq-softtopk-main-job [--work-dir runs/main_job] [--seeds 1 2 3] [--set train.max-update=200] [--pretrain]

(or ``python -m fairseq_softtopk.cli.main_job``). It reads ``configs/`` and ``results/`` of the
repository, so it runs from a clone of it (an editable install), not from an installed wheel.
"""

import argparse
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

from fairseq_softtopk.data.demo_language_pair import DEMO_SPLITS
from fairseq_softtopk.experiments.ablation_config import load_config
from fairseq_softtopk.experiments.ablation_report import results_markdown
from fairseq_softtopk.cli.ablation import stopped_message
from fairseq_softtopk.experiments.ablation_runner import check_jobs, check_seeds, check_work_dir, run_ablation
from fairseq_softtopk.experiments.child_processes import RunStopped, stop_on_signals
from fairseq_softtopk.experiments.fairseq_commands import PACKAGE_DIR, binarize_generated_corpus
from fairseq_softtopk.experiments.reference_comparison import compare, comparison_markdown
from fairseq_softtopk.experiments.run_lock import WORK_DIR_IN_USE, run_lock
from fairseq_softtopk.experiments.work_dir_marker import clear_for_fresh, record_created
from fairseq_softtopk.extras import exit_unless_installed

#: The repository: the parent of the fairseq_softtopk directory (a clone; an installed wheel has no configs/).
REPO = PACKAGE_DIR.parent
CONFIG = REPO / "configs" / "demo_finetune.yaml"
#: The run README's table shows (its results.json), and its seeds.
PUBLISHED = REPO / "results" / "main_job_demo" / "results.json"
PUBLISHED_SEEDS = [1, 2, 3]
#: The difference README's reading of the table rests on (arm, reference): the agreement check rejects a run where
#: it has the other sign (tests/test_reference_comparison.py doctors the published run to show it).
MAIN_DIFFERENCE = ("soft", "pretrained")
#: The teacher-forcing model every arm starts from, and the dictionaries it was trained with.
PRETRAINED = REPO / "checkpoints" / "demo_lstm_tf" / "checkpoint_best.pt"
PRETRAINED_DICTIONARIES = PRETRAINED.parent / "dictionaries.md5"
logger = logging.getLogger("main_job")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default="runs/main_job", help="data, checkpoints and results")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                        help="seeds of the fine-tuning; every arm of every seed starts from the one teacher-forcing "
                             "model, shipped or trained by --pretrain (default: 1 2 3)")
    parser.add_argument("--arms", nargs="+", help="arms of configs/demo_finetune.yaml (default: tf hard soft)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="training runs side by side (default: 2); the cores are shared among them")
    parser.add_argument("--verbose", action="store_true", help="print fairseq's logs (default: one line per validation)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FLAG=VALUE",
                        help="override the config, e.g. train.max-update=200 or pretrain.train.max-epoch=4")
    parser.add_argument("--sizes", type=int, nargs=3, metavar=("TRAIN", "VALID", "TEST"),
                        help="sentence pairs per split (default: 8000 400 500; smaller for smoke tests)")
    parser.add_argument("--pretrain", action="store_true",
                        help="train the teacher-forcing model (configs/demo_pretrain.yaml, about 25 minutes on one core) "
                             "instead of starting from the shipped one (checkpoints/demo_lstm_tf)")
    parser.add_argument("--fresh", action="store_true", help="discard earlier checkpoints and results")
    args = parser.parse_args(argv)
    exit_unless_installed(parser, "experiments")  # one line naming the extra, before anything imports it
    if args.sizes and not args.pretrain:
        parser.error("--sizes makes another corpus, whose dictionaries are not the shipped model's "
                     "(checkpoints/demo_lstm_tf): add --pretrain")
    typed = ["fairseq-softtopk-main-job", *(sys.argv[1:] if argv is None else argv)]
    command = " ".join(typed)
    if not CONFIG.parent.is_dir():  # a non-editable install: the package without the repository around it
        parser.exit(2, f"{parser.prog}: error: no configs/ next to {REPO / 'fairseq_softtopk'}: the main job runs "
                       f"from a clone of the repository (it reads configs/demo_finetune.yaml and results/), "
                       f"e.g. `make demo` there, not from an installed package\n")
    work = Path(args.work_dir)
    for flag, check, value in (("--seeds", check_seeds, args.seeds), ("--jobs", check_jobs, args.jobs),
                               ("--work-dir", check_work_dir, work)):
        try:
            check(value)
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {flag}: {error}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(message)s" if not args.verbose else
                        "%(asctime)s | %(levelname)s | %(name)s | %(message)s", datefmt="%H:%M:%S")
    if not args.verbose:  # fairseq's info lines (the runner's flag check) and sacrebleu's advice on
        # tokenised references (the generated pair is tokenised by construction) are noise here
        logging.getLogger("fairseq").setLevel(logging.WARNING)
        logging.getLogger("sacrebleu").setLevel(logging.ERROR)
    start = time.time()
    with stop_on_signals():
        try:
            config = load_config(CONFIG, args.set)
            work.mkdir(parents=True, exist_ok=True)
            with run_lock(work, WORK_DIR_IN_USE):  # one job per work directory, before --fresh deletes anything
                if args.fresh:
                    removed = clear_for_fresh(work)
                    if removed:
                        print(f"main job: --fresh removed {', '.join(p.name for p in removed)} from {work}", flush=True)
                # what this run will create, recorded before it exists: --fresh removes only that
                runs = [f"seed{seed}" for seed in args.seeds] + (["pretrain"] if args.pretrain else ["pretrained"])
                record_created(work, ["raw", "bin", *runs, "results.json", "results.md", "curves.png", "agreement.md"])
                results = run_main_job(config, args, work, command)
        except (FileNotFoundError, ValueError, RuntimeError) as error:
            parser.exit(1 if isinstance(error, RuntimeError) else 2, f"{parser.prog}: error: {error}\n")
        except RunStopped as stop:  # the rerun must not discard what this one trained: no --fresh
            sys.stderr.write(stopped_message(parser.prog, stop, [word for word in typed if word != "--fresh"]))
            return stop.exit_status
    print()
    print(results_markdown(results))
    print(agreement_with_published(results, args, work))
    print(f"main job: {time.time() - start:.0f} s this call; results in {work / 'results.md'}, "
          f"{work / 'results.json'} and {work / 'curves.png'}")
    return 0


def run_main_job(config: dict, args, work: Path, command: str) -> dict:
    """Generates and binarises the demo pair into ``work`` (kept when there) and runs the ablation."""
    print(f"main job: generating and binarising the demo language pair into {work}", flush=True)
    splits = None
    if args.sizes:
        splits = {split: (n, seed) for (split, (_, seed)), n in zip(DEMO_SPLITS.items(), args.sizes)}
    data_bin = binarize_generated_corpus(work, splits=splits, corpus="demo")
    pretrained = None if args.pretrain else check_pretrained_dictionaries(data_bin)
    return run_ablation(config, data_bin, work, ref_dir=work / "raw", seeds=args.seeds, arms=args.arms,
                        verbose=args.verbose, jobs=args.jobs, command=command, pretrained=pretrained,
                        score_pretrained=True)


def check_pretrained_dictionaries(data_bin: Path) -> Path:
    """:data:`PRETRAINED`, after checking that ``data_bin``'s dictionaries are the ones it was trained
    with (:data:`PRETRAINED_DICTIONARIES`, ``md5sum`` format).

    Raises:
        FileNotFoundError: the checkpoint or its checksums are missing.
        ValueError: a dictionary differs (another corpus): the message names it and ``--pretrain``.
    """
    for path in (PRETRAINED, PRETRAINED_DICTIONARIES):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (part of the repository): restore it with git, or pass "
                                    f"--pretrain to train the model instead")
    for line in PRETRAINED_DICTIONARIES.read_text(encoding="utf-8").splitlines():
        expected, name = line.split()
        found = hashlib.md5((data_bin / name).read_bytes()).hexdigest()
        if found != expected:
            raise ValueError(f"{data_bin / name} (md5 {found}) is not the dictionary the shipped model "
                             f"{PRETRAINED.relative_to(REPO)} was trained with (md5 {expected}): the corpus in "
                             f"{data_bin.parent} is not the default demo pair; use another --work-dir, or --pretrain")
    return PRETRAINED


def agreement_with_published(results: dict, args, work: Path) -> str:
    """The comparison with README's table (:data:`PUBLISHED`), also written to WORK/agreement.md;
    a run with other settings than the published one is not compared."""
    if (args.set or args.sizes or args.arms or args.pretrain or sorted(args.seeds) != PUBLISHED_SEEDS
            or not PUBLISHED.is_file()):
        return ("Not compared with README's table: this run's settings (--set, --sizes, --arms, --seeds or "
                "--pretrain) differ from the published run's.")
    published = json.loads(PUBLISHED.read_text(encoding="utf-8"))
    table, _ = comparison_markdown(compare(published, results), "README's table")
    text = f"## Agreement with README's table ({PUBLISHED.parent.name})\n\n{table}\n"
    (work / "agreement.md").write_text(text, encoding="utf-8")
    return text


if __name__ == "__main__":
    sys.exit(main())
