"""Score a fairseq checkpoint with sacrebleu against a raw reference file: ``fairseq-softtopk-bleu``.

fairseq-generate -> hypotheses in corpus order -> remove BPE (fairseq's ``--post-process``)
-> detokenise (sacremoses, optional) -> sacrebleu BLEU and chrF against the untouched reference
(:mod:`fairseq_softtopk.experiments.scoring`). Every source line must get exactly one hypothesis:
fairseq-generate has been seen to drop long inputs without a word, so a missing or duplicated id is
an error, not a silently lower BLEU. Bad input is found before translating and reported in one line,
exit status 2: a reference file with another number of lines than the binarised subset has sentences
(it names the file and both counts), ``--beam``/``--batch-size`` below 1 or a non-finite ``--lenpen``,
a ``--json``/``--hyp-out`` that cannot be written, a missing data directory or subset, a checkpoint
that is missing, truncated or damaged, or trained with another dictionary than the data directory's.

Example::

    fairseq-softtopk-bleu data-bin/multi30k_en_de checkpoints/checkpoint_best.pt \\
        --ref raw/test.de --post-process sentencepiece --detok-lang de --json out/test.json

(or ``python -m fairseq_softtopk.cli.bleu ...``).
"""

import argparse
import json
import logging
import sys
from pathlib import Path

from fairseq_softtopk.experiments.eval_inputs import check_decoding_numbers, check_output_file
from fairseq_softtopk.experiments.fairseq_generate import DEFAULT_BATCH_SIZE
from fairseq_softtopk.experiments.scoring import evaluate_checkpoint
from fairseq_softtopk.extras import exit_unless_installed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_bin", help="fairseq-preprocess output directory")
    parser.add_argument("checkpoint", help="checkpoint .pt file")
    parser.add_argument("--ref", required=True, help="raw (untokenised) reference file of the subset")
    parser.add_argument("--subset", default="test", help="fairseq split to translate (default: test)")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--lenpen", type=float, default=None,
                        help="fairseq-generate's length penalty (omit: fairseq's default, 1)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"sentences per generation batch (default: {DEFAULT_BATCH_SIZE['cpu']} on a CPU, "
                             f"{DEFAULT_BATCH_SIZE['cuda']} on a GPU)")
    parser.add_argument("--post-process", default=None,
                        help="fairseq --post-process (e.g. sentencepiece, subword_nmt) to remove BPE")
    parser.add_argument("--detok-lang", default=None, help="sacremoses detokeniser language (omit: none)")
    parser.add_argument("--hyp-out", default=None, help="write detokenised hypotheses here")
    parser.add_argument("--json", default=None, help="write the scores as JSON here")
    args = parser.parse_args(argv)
    exit_unless_installed(parser, "experiments")  # one line naming the extra, before anything imports it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s")
    try:
        check_decoding_numbers(args.beam, args.batch_size, args.lenpen)
        if args.json:  # before translating: the scores are not lost to an unwritable path
            check_output_file(args.json, "--json")
        result = evaluate_checkpoint(args.data_bin, args.checkpoint, args.ref, args.subset, args.beam,
                                     args.batch_size, args.post_process, args.detok_lang, args.hyp_out,
                                     extra_args=[] if args.lenpen is None else ["--lenpen", str(args.lenpen)])
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        parser.exit(1 if isinstance(error, RuntimeError) else 2, f"{parser.prog}: error: {error}\n")
    print(f"BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  ({result['n_sentences']} sentences)")
    print(f"signature: {result['bleu_signature']}")
    if args.json:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=2))
        except OSError as error:  # checked before translating; changed since: the scores are printed above
            parser.exit(1, f"{parser.prog}: error: cannot write --json {args.json} ({error}); the scores are above\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
