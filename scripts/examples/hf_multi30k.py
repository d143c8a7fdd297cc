#!/usr/bin/env python
"""Soft beam-search fine-tuning of a Hugging Face encoder-decoder on Multi30k En-De.

A small Marian model built from a config (no download) is trained with teacher forcing by ``Seq2SeqTrainer``,
then fine-tuned with the soft beam-search loss (:class:`fairseq_softtopk.adapters.huggingface_loss.
Seq2SeqBeamSearchLoss`: teacher forcing mixed with the gold-token NLL along the soft search's best beam, as the
fairseq criterion ``soft_beam_search``); BLEU (sacrebleu) of ``generate(num_beams=5)`` on test2016 before and
after. It shows the Hugging Face path on real data; no gain is expected from a few hundred updates.

The data: the output directory of ``data_prep/prepare_multi30k.sh`` (its sentencepiece text under ``bpe/``, the
joined dictionary ``bin/dict.en.txt``, the untouched reference ``raw/test.de``). Each stage saves its model under
``--out`` and is skipped when rerun (delete a stage's directory to redo it)::

    bash data_prep/prepare_multi30k.sh --out data/multi30k_en_de
    python scripts/examples/hf_multi30k.py --data data/multi30k_en_de --out runs/hf_multi30k
"""

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Dict, List

import torch

logger = logging.getLogger("hf_multi30k")

PAD, EOS, UNK = 1, 2, 3  # fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3; decoding starts from EOS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the output directory of data_prep/prepare_multi30k.sh")
    p.add_argument("--out", required=True, help="where the models, the log and results.json go")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=3, help="encoder and decoder layers each")
    p.add_argument("--tf-epochs", type=float, default=6.0, help="teacher-forcing epochs")
    p.add_argument("--tf-lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64, help="sentences per teacher-forcing update")
    p.add_argument("--beam-updates", type=int, default=300, help="soft beam-search fine-tuning updates")
    p.add_argument("--beam-batch-size", type=int, default=32)
    p.add_argument("--beam-lr", type=float, default=1e-4)
    p.add_argument("--beam", type=int, default=5, help="the training search's beam (the paper: 5)")
    p.add_argument("--epsilon", type=float, default=0.1, help="the soft top-k's epsilon (the paper: 0.1)")
    p.add_argument("--teacher-forcing-ratio", type=float, default=0.8, help="p (the paper: 0.8)")
    p.add_argument("--selection-grad", choices=["capped", "full", "none"], default="capped",
                   help="the gradient through the soft selection: capped (the criterion's default), full (the paper's)")
    p.add_argument("--grad-cap", type=float, default=0.3,
                   help="capped: per sentence and step, in label-token gradients")
    p.add_argument("--beam-loss", choices=["gold", "risk"], default="gold",
                   help="the beam term: the labels' NLL along the best beam (the paper's), or minimum risk of the "
                        "hypotheses of a search until EOS (with --teacher-forcing-ratio 0.5 and --risk-cost "
                        "bleu_points: the setting measured on Multi30k to gain over teacher forcing)")
    p.add_argument("--risk-cost", choices=["bleu", "bleu_points", "minmax"], default="bleu_points",
                   help="risk: the cost's unit (1 - BLEU+1, in BLEU points, or min-max scaled per sentence)")
    p.add_argument("--test-sentences", type=int, default=0, help="score the first N test sentences (0: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def read_dictionary(path: Path) -> Dict[str, int]:
    """fairseq's ``dict.txt``: one ``symbol count`` per line, ids from 4."""
    if not path.is_file():
        raise FileNotFoundError(f"no dictionary at {path}: run data_prep/prepare_multi30k.sh first")
    symbols = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        symbols.setdefault(line.rsplit(" ", 1)[0], 4 + len(symbols))
    return symbols


def encode_lines(path: Path, vocab: Dict[str, int], max_tokens: int = 126) -> List[List[int]]:
    if not path.is_file():
        raise FileNotFoundError(f"no {path}: run data_prep/prepare_multi30k.sh first")
    return [[vocab.get(tok, UNK) for tok in line.split()][:max_tokens] + [EOS]
            for line in path.read_text(encoding="utf-8").splitlines()]


def paired(data: Path, split: str, src: str, tgt: str, vocab) -> List[dict]:
    sources, targets = (encode_lines(data / "bpe" / f"{split}.{lang}", vocab) for lang in (src, tgt))
    if len(sources) != len(targets):
        raise ValueError(f"{split}: {len(sources)} source lines but {len(targets)} target lines")
    return [{"input_ids": s, "labels": t} for s, t in zip(sources, targets)]


def collate(rows: List[dict]) -> dict:
    """Sources padded with PAD (and their mask), labels with -100, decoder inputs = EOS + labels shifted right."""
    batch = len(rows)
    S, T = max(len(r["input_ids"]) for r in rows), max(len(r["labels"]) for r in rows)
    ids = torch.full((batch, S), PAD, dtype=torch.long)
    labels = torch.full((batch, T), -100, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        labels[b, :len(r["labels"])] = torch.tensor(r["labels"])
    shifted = torch.cat([torch.full((batch, 1), EOS), labels[:, :-1]], 1)
    decoder_inputs = shifted.masked_fill(shifted == -100, PAD)
    return {"input_ids": ids, "attention_mask": ids.ne(PAD).long(), "decoder_input_ids": decoder_inputs,
            "labels": labels}


def build_model(vocab_size: int, d_model: int, layers: int, seed: int):
    import transformers

    torch.manual_seed(seed)
    config = transformers.MarianConfig(
        vocab_size=vocab_size, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model, max_position_embeddings=256, dropout=0.1, scale_embedding=True,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=0, decoder_start_token_id=EOS, forced_eos_token_id=None)
    return transformers.MarianMTModel(config)


def generation_config(model):
    config = model.generation_config
    config.update(num_beams=5, decoder_start_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
                  bos_token_id=0, forced_eos_token_id=None, bad_words_ids=[[PAD], [0]], length_penalty=1.0,
                  early_stopping=True)
    return config


def translate_and_score(model, rows: List[dict], symbols: List[str], reference: List[str], tgt: str,
                        batch_size: int = 50) -> dict:
    """BLEU of ``generate(num_beams=5)`` (sentencepiece joined, Moses-detokenised) against the raw reference."""
    from tqdm import tqdm

    from fairseq_softtopk.experiments.scoring import detokenize, score

    model.eval()
    config = generation_config(model)
    hypotheses = []
    with torch.no_grad():
        for start in tqdm(range(0, len(rows), batch_size), desc="translate", unit="batch"):
            batch = collate(rows[start:start + batch_size])
            out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 generation_config=config,
                                 max_new_tokens=int(1.2 * batch["input_ids"].shape[1]) + 10)
            for ids in out[:, 1:].tolist():
                tokens = [symbols[i] for i in ids if i not in (PAD, EOS, 0)]
                hypotheses.append("".join(tokens).replace("\u2581", " ").strip())
    return score(detokenize(hypotheses, tgt), reference[:len(hypotheses)])


def train(model, rows, args, out_dir: Path, loss_fn=None, max_steps=-1, epochs=1.0, lr=1e-3, batch_size=64):
    import transformers

    training = transformers.Seq2SeqTrainingArguments(
        output_dir=str(out_dir / "trainer"), max_steps=max_steps, num_train_epochs=epochs, learning_rate=lr,
        per_device_train_batch_size=batch_size, warmup_steps=0 if loss_fn else 200, weight_decay=0.0,
        lr_scheduler_type="constant" if loss_fn else "inverse_sqrt", logging_steps=25, save_strategy="no",
        report_to=[], use_cpu=True, seed=args.seed, dataloader_num_workers=0, max_grad_norm=1.0)
    trainer = transformers.Seq2SeqTrainer(model=model, args=training, train_dataset=rows, data_collator=collate,
                                          compute_loss_func=loss_fn)
    result = trainer.train()
    return trainer.state.log_history, result.metrics


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out, data = Path(args.out), Path(args.data)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out / "run.log")])
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from fairseq_softtopk.adapters.huggingface_loss import Seq2SeqBeamSearchLoss, default_config

    vocab = read_dictionary(data / "bin" / f"dict.{args.src}.txt")
    symbols = ["<s>", "<pad>", "</s>", "<unk>"] + list(vocab)
    train_rows = paired(data, "train", args.src, args.tgt, vocab)
    test_rows = paired(data, "test", args.src, args.tgt, vocab)
    reference = (data / "raw" / f"test.{args.tgt}").read_text(encoding="utf-8").splitlines()
    if len(reference) != len(test_rows):
        raise ValueError(f"raw/test.{args.tgt} has {len(reference)} lines but bpe/test {len(test_rows)}")
    if args.test_sentences:
        test_rows = test_rows[:args.test_sentences]
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}  # each stage keeps its args
    vocab_size = (len(symbols) + 7) // 8 * 8

    tf_dir = out / "teacher_forcing"
    if not (tf_dir / "config.json").is_file():
        model = build_model(vocab_size, args.d_model, args.layers, args.seed)
        logger.info("teacher forcing: %d sentences, %.1f epochs, %d parameters", len(train_rows), args.tf_epochs,
                    sum(p.numel() for p in model.parameters()))
        start = time.time()
        history, _ = train(model, train_rows, args, tf_dir, epochs=args.tf_epochs, lr=args.tf_lr,
                           batch_size=args.batch_size)
        results["teacher_forcing"] = {"args": vars(args), "seconds": round(time.time() - start), "log": history}
        model.save_pretrained(tf_dir)
        results_path.write_text(json.dumps(results, indent=1))
    if "bleu_before" not in results:
        model = transformers.MarianMTModel.from_pretrained(tf_dir)
        results["bleu_before"] = translate_and_score(model, test_rows, symbols, reference, args.tgt)
        logger.info("test BLEU after teacher forcing: %s", results["bleu_before"]["bleu"])
        results_path.write_text(json.dumps(results, indent=1))

    beam_dir = out / "soft_beam_search"
    if not (beam_dir / "config.json").is_file():
        model = transformers.MarianMTModel.from_pretrained(tf_dir)
        config = dataclasses.replace(default_config(args.teacher_forcing_ratio, args.beam, args.epsilon, args.grad_cap),
                                     selection_grad=args.selection_grad)
        loss_fn = Seq2SeqBeamSearchLoss(model, config, teacher_forcing_ratio=args.teacher_forcing_ratio,
                                        beam_loss=args.beam_loss, risk_cost=args.risk_cost)
        logger.info("soft beam-search fine-tuning: %d updates of %d sentences, beam %d, epsilon %g, p %g, "
                    "selection gradient %s, beam loss %s", args.beam_updates, args.beam_batch_size, args.beam,
                    args.epsilon, args.teacher_forcing_ratio, args.selection_grad,
                    args.beam_loss if args.beam_loss == "gold" else f"risk ({args.risk_cost})")
        start = time.time()
        history, _ = train(model, train_rows, args, beam_dir, loss_fn=loss_fn, max_steps=args.beam_updates,
                           lr=args.beam_lr, batch_size=args.beam_batch_size)
        loss_fn.remove()
        results["soft_beam_search"] = {"args": vars(args), "seconds": round(time.time() - start), "log": history}
        model.save_pretrained(beam_dir)
        results.pop("bleu_after", None)
        results_path.write_text(json.dumps(results, indent=1))
    if "bleu_after" not in results:
        model = transformers.MarianMTModel.from_pretrained(beam_dir)
        results["bleu_after"] = translate_and_score(model, test_rows, symbols, reference, args.tgt)
        results_path.write_text(json.dumps(results, indent=1))
    updates = "soft beam-search" if args.teacher_forcing_ratio < 1 else "teacher-forcing"
    before, after = results["bleu_before"], results["bleu_after"]
    print(f"| model | test2016 BLEU | chrF |\n|---|---:|---:|\n"
          f"| teacher forcing | {before['bleu']} | {before['chrf']} |\n"
          f"| + {args.beam_updates} {updates} updates | {after['bleu']} | {after['chrf']} |\n{after['bleu_signature']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
