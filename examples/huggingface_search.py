"""Soft beam search on a Hugging Face model through the search API: a tiny Marian model built from a config
(random weights, no download: its beams are not translations), its search output, the gold-token loss and its
gradient; the hard search (the exact top-k, the ablation) beside it.

    pip install -e '.[hf]' && python examples/huggingface_search.py   # a few seconds on a CPU
"""

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from fairseq_softtopk.adapters.huggingface import Seq2SeqSearchDecoder  # noqa: E402
from fairseq_softtopk.search import BeamSearchConfig, beam_search, gold_token_loss  # noqa: E402

PAD, EOS = 0, 2


def tiny_marian():
    """A seeded, randomly initialised Marian model (vocabulary 100, 2 + 2 layers of 32) in eval mode (no dropout,
    so that the numbers are reproducible), two source sentences ``(2, 7)`` and their labels ``(2, 5)``, EOS last
    (labels of different lengths are padded with -100, as Hugging Face pads them)."""
    torch.manual_seed(1)
    config = transformers.MarianConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                       pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, init_std=0.15)
    model = transformers.MarianMTModel(config).eval()
    src = torch.randint(3, 100, (2, 7))
    labels = torch.tensor([[11, 42, 7, 93, EOS], [25, 60, 18, 5, EOS]])
    return model, src, labels


def search_loss(model, src, labels, mode):
    """One search along ``labels`` (``mode`` "soft" or "hard"); returns the output and the loss per label token."""
    decoder = Seq2SeqSearchDecoder(model)  # the adapter: embeds tokens, steps the decoder, mixes its cache
    out = beam_search(decoder, decoder.encode(src), labels, pad=-100, bos=decoder.bos,
                      config=BeamSearchConfig(beam=5, mode=mode, epsilon=0.1))
    # the paper's beam loss: the NLL of the gold tokens along the best final beam, averaged over the label tokens;
    # soft mode adds the scale probe (a zero), through which the selection gradient's cap (the default) counts in
    # gold-token gradients (BeamSearchConfig(selection_grad="full") for the paper's exact gradient)
    loss = gold_token_loss(out, labels, pad=-100).loss
    if out.scale_probe is not None:
        loss = loss + out.scale_probe
    return out, loss / labels.ne(-100).sum()


def main():
    model, src, labels = tiny_marian()
    for mode in ("soft", "hard"):
        model.zero_grad()
        out, loss = search_loss(model, src, labels, mode)
        loss.backward()  # soft: the gradient also flows through the selection of the beams
        grad_norm = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
        best = out.tokens[torch.arange(len(src)), out.best_beam]  # (batch, steps): each sentence's best beam
        print(f"{mode} search: tokens {tuple(out.tokens.shape)} (batch, beam, steps), "
              f"final scores {tuple(out.final_scores.shape)}")
        for i, scores in enumerate(out.final_scores.tolist()):
            print(f"  sentence {i}: beam scores {' '.join(f'{s:.2f}' for s in scores)}; "
                  f"best beam {out.best_beam[i].item()}: {best[i].tolist()}")
        print(f"  loss {loss.item():.4f} per label token, gradient norm {grad_norm.item():.4f}")


if __name__ == "__main__":
    main()
