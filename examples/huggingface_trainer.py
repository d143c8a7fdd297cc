"""Soft beam-search training with Hugging Face's ``Seq2SeqTrainer``: a small Marian model built from a config (random
weights, no download) learns 8 pairs by heart (a sequence of token ids and its reverse: a check that the path trains,
not a translation). Its own collator pads the batches (sources and an attention mask, labels padded with -100,
``decoder_input_ids`` the labels shifted right after the start token); ``Seq2SeqBeamSearchLoss`` is the trainer's
``compute_loss_func`` (``p * teacher forcing + (1 - p) * the gold-token loss along the soft search's best beam``, per
label token); ``generate(num_beams=4)`` decodes before and after.

    pip install '.[hf]' && python examples/huggingface_trainer.py   # about 15 s on a CPU
"""

import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from fairseq_softtopk.adapters.huggingface_loss import Seq2SeqBeamSearchLoss, default_config  # noqa: E402

PAD, EOS, START = 0, 1, 0  # Marian starts decoding with its pad token
VOCAB, FIRST_WORD = 24, 3  # ids 0-2: pad, EOS, unused; words from 3
TEACHER_FORCING_RATIO, BEAM, BATCH = 0.5, 4, 4


def build_model() -> transformers.MarianMTModel:
    """A seeded Marian model, 1 + 1 layers of 32 (about 40k parameters)."""
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=START, dropout=0.0)
    return transformers.MarianMTModel(config)


def reversal_pairs(n: int, seed: int):
    """``n`` rows ``{"input_ids": words + [EOS], "labels": the words reversed + [EOS]}``, 3 to 6 random words each."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 7, (1,), generator=g))
        words = torch.randint(FIRST_WORD, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": words + [EOS], "labels": words[::-1] + [EOS]})
    return rows


def collate(features):
    """Pads a list of rows (lists of ids) into a batch of ``(batch, length)`` tensors: ``input_ids`` padded with the
    pad token and its ``attention_mask``; ``labels`` padded with -100 (not trained); ``decoder_input_ids`` the
    labels shifted right after the start token, the pad token where the labels are padding."""
    src_len = max(len(f["input_ids"]) for f in features)
    tgt_len = max(len(f["labels"]) for f in features)
    input_ids = torch.tensor([f["input_ids"] + [PAD] * (src_len - len(f["input_ids"])) for f in features])
    labels = torch.tensor([f["labels"] + [-100] * (tgt_len - len(f["labels"])) for f in features])
    decoder_input_ids = torch.cat([torch.full_like(labels[:, :1], START), labels[:, :-1].masked_fill(
        labels[:, :-1] == -100, PAD)], 1)
    return {"input_ids": input_ids, "attention_mask": input_ids.ne(PAD).long(), "decoder_input_ids": decoder_input_ids,
            "labels": labels}


def train(model, rows, steps: int, out_dir: str):
    """``steps`` updates of ``Seq2SeqTrainer`` with the soft beam-search loss; returns the logged losses."""
    loss_fn = Seq2SeqBeamSearchLoss(model, default_config(TEACHER_FORCING_RATIO, beam=BEAM),
                                    teacher_forcing_ratio=TEACHER_FORCING_RATIO)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-2, logging_steps=20,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Seq2SeqTrainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                                          compute_loss_func=loss_fn)
    trainer.remove_callback(transformers.PrinterCallback)  # the losses are printed below
    trainer.train()
    loss_fn.remove()
    return [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


@torch.no_grad()
def decode(model, rows):
    """``generate(num_beams=4)`` of each row's source: the output ids after the start token, up to the first EOS."""
    model.eval()
    batch = collate(rows)
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=4,
                         max_new_tokens=8, do_sample=False)
    hypotheses = [row.tolist()[1:] for row in out]
    return [ids[:ids.index(EOS) + 1] if EOS in ids else ids for ids in hypotheses]


def right(hypotheses, rows) -> int:
    return sum(hypothesis == row["labels"] for hypothesis, row in zip(hypotheses, rows))


def main(steps: int = 200):
    torch.set_num_threads(1)
    model = build_model()
    rows = reversal_pairs(8, seed=1)
    print(f"{len(rows)} pairs (token ids -> the same reversed), Marian built from a config "
          f"({sum(p.numel() for p in model.parameters()):,} parameters)")
    print(f"generate(num_beams=4) before training: {right(decode(model, rows), rows)} of {len(rows)} right")
    with tempfile.TemporaryDirectory() as out_dir:
        losses = train(model.train(), rows, steps, out_dir)
    print(f"Seq2SeqTrainer, {steps} updates of {BATCH} pairs, loss {TEACHER_FORCING_RATIO} * teacher forcing + "
          f"{1 - TEACHER_FORCING_RATIO} * soft beam search (beam {BEAM}) per label token:")
    print("  " + ", ".join(f"{loss:.2f}" for _, loss in losses) + f" (every {losses[0][0]} updates)")
    hypotheses = decode(model, rows)
    print(f"generate(num_beams=4) after: {right(hypotheses, rows)} of {len(rows)} right")
    for row, hypothesis in zip(rows, hypotheses):
        print(f"  {row['input_ids']} -> {hypothesis}")


if __name__ == "__main__":
    main()
