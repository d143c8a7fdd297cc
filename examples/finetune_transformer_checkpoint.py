"""Fine-tune the shipped Multi30k En-De Transformer with soft beam-search training for a few updates, and translate
with it before and after.

    bash data_prep/prepare_multi30k.sh --out data/multi30k_en_de    # once (or --local DIR of the .gz files)
    python examples/finetune_transformer_checkpoint.py --data-dir data/multi30k_en_de --work-dir runs/finetune_example

The 20 default updates take a few minutes on 2 CPU cores (a soft beam-search update of 1,000 target tokens: 5-10 s).
"""

import argparse
import hashlib
import logging
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints/multi30k_en_de_transformer_tf/checkpoint_best.pt"
DICT_MD5 = "b8a542765475fec7cd51aacbc38edc9c"  # the joined dictionary the checkpoint was trained with
SENTENCES = ["A man is riding a bicycle down the street.", "Two dogs are playing in the snow."]


def data_problem(data_dir: Path):
    """What is wrong with ``data_dir`` for this checkpoint (missing files, another dictionary), or None."""
    prepare = f"bash data_prep/prepare_multi30k.sh --out {data_dir}   (--local DIR: read the .gz files from DIR)"
    for path in (data_dir / "bin" / "dict.en.txt", data_dir / "bpe" / "spm.model"):
        if not path.is_file():
            return f"--data-dir: {path} not found; prepare Multi30k En-De first:\n    {prepare}"
    md5 = hashlib.md5((data_dir / "bin" / "dict.en.txt").read_bytes()).hexdigest()
    if md5 != DICT_MD5:
        return (f"--data-dir: {data_dir}/bin/dict.en.txt has md5 {md5}, the checkpoint's dictionary has "
                f"{DICT_MD5} (other settings); prepare the data with the defaults into a new directory:\n    {prepare}")
    return None


def translator(checkpoint: Path, data_dir: Path):
    """A function English text -> German text: the data's tokenisation and SentencePiece model around the
    checkpoint's beam search (beam 4, length penalty 0.6, the checkpoint's published decoding)."""
    import sentencepiece
    from fairseq import checkpoint_utils
    from fairseq.hub_utils import GeneratorHubInterface
    from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                       arg_overrides={"data": str(data_dir / "bin")})
    hub = GeneratorHubInterface(cfg, task, models)
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(data_dir / "bpe" / "spm.model"))
    normalize, tokenize = MosesPunctNormalizer(lang="en", post_remove_control_chars=True), MosesTokenizer(lang="en")
    detokenize = MosesDetokenizer(lang="de")

    def translate(text: str) -> str:
        # as data_prep/prepare_multi30k.sh prepared the training data: normalise, tokenise, SentencePiece pieces
        tokens = tokenize.tokenize(normalize.normalize(text), aggressive_dash_splits=True, return_str=True, escape=True)
        output = hub.translate(" ".join(pieces.encode(tokens, out_type=str)), beam=4, lenpen=0.6)
        return detokenize.detokenize(pieces.decode(output.split()).split())

    return translate


def finetune(data_dir: Path, save_dir: Path, updates: int, max_tokens: int):
    """fairseq-train from the checkpoint (optimizer reset), the soft arm of
    configs/multi30k_en_de_transformer_finetune.yaml; returns ((loss, teacher-forcing loss, beam loss), seconds)."""
    from fairseq_softtopk.experiments.fairseq_commands import fairseq_command, run_logged

    args = [data_dir / "bin", "--arch", "softtopk_transformer_prenorm_multi30k", "--finetune-from-model", CHECKPOINT,
            # loss = 0.8 * teacher forcing + 0.2 * the gold-token NLL along a beam-5 search selected by the sorted
            # SOFT top-k (--topk-mode hard: the exact top-k, the ablation)
            "--criterion", "soft_beam_search", "--teacher-forcing-ratio", 0.8, "--train-beam", 5,
            "--topk-mode", "soft", "--label-smoothing", 0.1, "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
            "--lr", 1e-4, "--clip-norm", 1.0, "--max-tokens", max_tokens, "--max-update", updates, "--seed", 1,
            "--required-batch-size-multiple", 1, "--disable-validation", "--no-epoch-checkpoints",
            "--no-save-optimizer-state", "--num-workers", 0, "--log-format", "simple", "--log-interval", 1,
            "--save-dir", save_dir]
    save_dir.mkdir(parents=True, exist_ok=True)
    log = run_logged(fairseq_command("train", args), save_dir / "train.log", echo=False)
    # fairseq's summary of the updates run (its epoch-end line): the losses in bits per target token
    summary = re.findall(r"\| train \| epoch .*?\| loss ([\d.]+) \| tf_loss ([\d.]+) \| beam_loss ([\d.]+) ", log)[-1]
    seconds = float(re.search(r"done training in ([\d.]+) seconds", log).group(1))
    return tuple(map(float, summary)), seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="prepared Multi30k En-De (bin/, bpe/spm.model)")
    parser.add_argument("--work-dir", type=Path, required=True, help="new directory for the fine-tuned checkpoint")
    parser.add_argument("--updates", type=int, default=20, help="fine-tuning updates (default: 20)")
    parser.add_argument("--max-tokens", type=int, default=1000, help="target tokens a batch (default: 1000)")
    args = parser.parse_args(argv)
    problem = ((args.updates < 1 and f"--updates must be >= 1, got {args.updates}")
               or (args.max_tokens < 1 and f"--max-tokens must be >= 1, got {args.max_tokens}")
               or data_problem(args.data_dir))
    if (args.work_dir / "checkpoint_last.pt").exists():  # fairseq-train would resume it instead of starting anew
        problem = f"--work-dir {args.work_dir} already holds a fine-tuned checkpoint: pass a new directory"
    if problem:
        parser.error(problem)
    logging.getLogger("fairseq").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    import fairseq_softtopk

    fairseq_softtopk.register()  # the checkpoint's architecture and criterion
    before = translator(CHECKPOINT, args.data_dir)
    print(f"shipped checkpoint ({CHECKPOINT.parent.name}):")
    for text in SENTENCES:
        print(f"  {text} -> {before(text)}")
    print(f"fine-tuning {args.updates} updates (soft beam search, beam 5, p = 0.8, lr 1e-4) ...", flush=True)
    (loss, tf_loss, beam_loss), seconds = finetune(args.data_dir, args.work_dir, args.updates, args.max_tokens)
    print(f"  training loss {loss:.3f} bits/token (teacher forcing {tf_loss:.3f}, beam {beam_loss:.3f}), "
          f"mean over the updates; {seconds:.0f} s")
    after = translator(args.work_dir / "checkpoint_last.pt", args.data_dir)
    print(f"fine-tuned checkpoint ({args.work_dir / 'checkpoint_last.pt'}):")
    for text in SENTENCES:
        print(f"  {text} -> {after(text)}")


if __name__ == "__main__":
    sys.exit(main())
