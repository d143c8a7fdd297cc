"""Tests of :class:`TopKMultiheadAttention` and the ``softtopk_transformer`` model."""

import argparse
import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_REGISTRY
from fairseq.models.transformer import TransformerModel
from fairseq.modules.multihead_attention import MultiheadAttention

from conftest import word_dictionary

import fairseq_softtopk
from fairseq_softtopk.models import topk_multihead_attention as tmha
from fairseq_softtopk.modules.attention_normalizer import AttentionNormalizer
from fairseq_softtopk.models.topk_multihead_attention import TopKMultiheadAttention

fairseq_softtopk.register()
from fairseq_softtopk.models import softtopk_transformer as stt  # noqa: E402  (after registering)

REPO = Path(__file__).resolve().parent.parent
PAD = 1


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(4321)


def _dictionary(n_words=20):
    return word_dictionary(n_words)


def build_model(seed=0, **options):
    """A tiny model for a 24-symbol joined dictionary; ``options`` as parsed args (e.g. attention_topk=1)."""
    dictionary = _dictionary()
    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    args = argparse.Namespace(arch="softtopk_transformer_tiny", dropout=0.0, **options)
    stt.softtopk_transformer_tiny(args)
    torch.manual_seed(seed)
    return stt.SoftTopKTransformerModel.build_model(args, task), args


def _batch(rng, bsz=3, src_len=7, tgt_len=6):
    """Left-padded sources, right-padded targets (fairseq's defaults), ids of real words (>= 4)."""
    src = torch.randint(4, 24, (bsz, src_len), generator=rng)
    src_lengths = torch.tensor([src_len, src_len - 3, 4])[:bsz]
    for b, length in enumerate(src_lengths):
        src[b, : src_len - length] = PAD
        src[b, -1] = 2  # eos
    prev = torch.randint(4, 24, (bsz, tgt_len), generator=rng)
    prev[:, 0] = 2
    prev[-1, -2:] = PAD
    return src, src_lengths, prev


def test_all_exports_exist():
    for module in (tmha, stt):
        for name in module.__all__:
            assert hasattr(module, name), name


def test_model_and_architectures_are_registered():
    assert MODEL_REGISTRY["softtopk_transformer"] is stt.SoftTopKTransformerModel
    for arch in ("softtopk_transformer_tiny", "softtopk_transformer_multi30k", "softtopk_transformer_wmt16"):
        assert ARCH_MODEL_REGISTRY[arch] is stt.SoftTopKTransformerModel


@pytest.mark.parametrize("arch_fn, sizes", [
    (stt.softtopk_transformer_tiny, (32, 64, 2, 2, 0.1)),
    (stt.softtopk_transformer_multi30k, (256, 512, 3, 4, 0.3)),
    (stt.softtopk_transformer_wmt16, (512, 2048, 6, 8, 0.1)),  # Transformer base
])
def test_architecture_sizes(arch_fn, sizes):
    args = argparse.Namespace()
    arch_fn(args)
    assert (args.encoder_embed_dim, args.encoder_ffn_embed_dim, args.encoder_layers,
            args.encoder_attention_heads, args.dropout) == sizes
    assert (args.decoder_embed_dim, args.decoder_layers, args.decoder_attention_heads) == (sizes[0], sizes[2], sizes[3])
    assert (args.attention_normalizer, args.attention_topk, args.attention_topk_epsilon,
            args.attention_normalize_self_attention, args.topk_self_attention) == ("softmax", 5, 0.1, False, None)
    assert args.attention_dropout == (0.1 if arch_fn is stt.softtopk_transformer_wmt16 else 0.0)


@pytest.mark.parametrize("self_attention", [False, True])
def test_normalised_attention_is_where_asked_for(self_attention):
    model, _ = build_model(attention_normalizer="soft_topk", attention_topk=2, attention_normalize_self_attention=self_attention)
    for layer in model.decoder.layers:
        assert isinstance(layer.encoder_attn, TopKMultiheadAttention)
        assert isinstance(layer.self_attn, TopKMultiheadAttention) == self_attention
        assert layer.encoder_attn.normalizer.name == "soft_topk" and layer.encoder_attn.normalizer.k == 2
    for layer in model.encoder.layers:
        assert isinstance(layer.self_attn, TopKMultiheadAttention) == self_attention


def test_state_dict_is_that_of_fairseq_transformer():
    model, args = build_model(attention_normalizer="soft_topk", attention_topk=2, attention_normalize_self_attention=True)
    dictionary = model.encoder.dictionary
    plain = TransformerModel.build_model(copy.deepcopy(args), SimpleNamespace(
        source_dictionary=dictionary, target_dictionary=dictionary))
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}


@pytest.mark.parametrize("self_attention, expected_calls", [(False, 2), (True, 2 + 2 + 2)])
def test_normalizer_is_not_bypassed_in_training(rng, self_attention, expected_calls):
    """fairseq's MultiheadAttention would take its fused path here (training, no incremental state)."""
    model, _ = build_model(attention_normalizer="soft_topk", attention_topk=2, attention_normalize_self_attention=self_attention)
    calls = []
    for module in model.modules():
        if isinstance(module, AttentionNormalizer):
            module.register_forward_hook(lambda m, inputs, output: calls.append(output.shape))
    model.train()
    src, src_lengths, prev = _batch(rng)
    logits, _ = model(src, src_lengths, prev)
    logits.sum().backward()
    assert len(calls) == expected_calls  # tiny: 2 encoder and 2 decoder layers


def _attention_pair(rng, normalizer, dropout=0.0, **kwargs):
    """A TopKMultiheadAttention and a fairseq MultiheadAttention with the same parameters."""
    torch.manual_seed(0)
    ours = TopKMultiheadAttention(16, 4, normalizer, dropout=dropout, **kwargs)
    theirs = MultiheadAttention(16, 4, dropout=dropout, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("training", [False, True])
def test_softmax_normaliser_reproduces_fairseq_attention(rng, training):
    ours, theirs = _attention_pair(rng, AttentionNormalizer("softmax"), self_attention=True)
    ours.train(training), theirs.train(training)
    x = torch.randn(5, 3, 16, generator=rng)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])  # every query sees a key
    causal = torch.triu(torch.full((5, 5), float("-inf")), 1)
    out, weights = ours(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=True)
    ref, ref_weights = theirs(x, x, x, key_padding_mask=pad, attn_mask=causal, need_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(weights, ref_weights)


def test_hard_top1_attention_is_one_hot_in_training(rng):
    ours, theirs = _attention_pair(rng, AttentionNormalizer("hard_topk", k=1), encoder_decoder_attention=True)
    ours.train(), theirs.train()
    query, memory = torch.randn(4, 2, 16, generator=rng), torch.randn(6, 2, 16, generator=rng)
    pad = torch.tensor([[False] * 6, [True] * 2 + [False] * 4])
    out, weights = ours(query, memory, memory, key_padding_mask=pad, need_head_weights=True)
    ref, ref_weights = theirs(query, memory, memory, key_padding_mask=pad, need_weights=True)
    assert weights.shape == (4, 2, 4, 6)  # heads x batch x tgt x src
    assert torch.all((weights == 0) | (weights == 1)) and torch.all(weights.sum(-1) == 1)
    assert torch.all(weights[:, 1, :, :2] == 0)  # padding
    assert (weights.mean(0) - ref_weights).abs().max() > 0.1  # fairseq's softmax is not one-hot
    assert (out - ref).abs().max() > 1e-3


def test_beam_shortcut_of_encoder_decoder_attention_gives_the_same_output(rng):
    """With ``set_beam_size``, fairseq keeps one copy of the keys per sentence (the einsum branch)."""
    attention = TopKMultiheadAttention(16, 4, AttentionNormalizer("soft_topk", k=2, epsilon=0.3),
                                       encoder_decoder_attention=True).eval()
    bsz, beam = 2, 3
    memory = torch.randn(6, bsz, 16, generator=rng).repeat_interleave(beam, dim=1)  # S x (B * beam) x C
    pad = torch.tensor([[False] * 6, [True] * 2 + [False] * 4]).repeat_interleave(beam, dim=0)
    query = torch.randn(1, bsz * beam, 16, generator=rng)
    outputs = []
    for beam_size in (1, beam):
        attention.set_beam_size(beam_size)
        out, weights = attention(query, memory, memory, key_padding_mask=pad, incremental_state={},
                                 static_kv=True, need_weights=True)
        outputs.append((out, weights))
    torch.testing.assert_close(outputs[1][0], outputs[0][0])
    torch.testing.assert_close(outputs[1][1], outputs[0][1])


@pytest.mark.parametrize("normalizer", ["soft_topk", "hard_topk", "entmax15"])
def test_incremental_decoding_matches_teacher_forcing(rng, normalizer):
    model, _ = build_model(attention_normalizer=normalizer, attention_topk=2, attention_topk_epsilon=0.2,
                           attention_normalize_self_attention=True)
    model.eval()
    src, src_lengths, prev = _batch(rng)
    prev = prev[:2]  # no target padding: incremental decoding has none
    src, src_lengths = src[:2], src_lengths[:2]
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src_lengths)
        full, extra = model.decoder(prev, encoder_out=encoder_out)
        state, steps, attns = {}, [], []
        for t in range(prev.size(1)):
            step, step_extra = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            steps.append(step)
            attns.append(step_extra["attn"][0])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(attns, 1), extra["attn"][0], atol=1e-5, rtol=1e-4)


def test_alignment_weights_are_normalised_and_skip_source_padding(rng):
    model, _ = build_model(attention_normalizer="hard_topk", attention_topk=1)
    model.eval()
    src, src_lengths, prev = _batch(rng)
    with torch.no_grad():
        _, extra = model(src, src_lengths, prev)
    attn = extra["attn"][0]  # batch x tgt_len x src_len, mean over the heads of the last layer
    assert attn.shape == (3, 6, 7)
    torch.testing.assert_close(attn.sum(-1), torch.ones(3, 6))
    assert torch.all(attn.masked_select(src.eq(PAD).unsqueeze(1).expand_as(attn)) == 0)
    assert torch.all((attn > 0).sum(-1) <= 2)  # top-1 per head, 2 heads


def test_bad_normaliser_options_raise_value_error():
    with pytest.raises(ValueError, match="--attention-topk must be an integer >= 1, got 0"):
        build_model(attention_normalizer="soft_topk", attention_topk=0)


def _run(cmd, timeout=120):
    # one thread: tiny matrices gain nothing from more, and a busy machine's cores oversubscribed
    # by OpenMP make the run many times slower
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *map(str, cmd)], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_train_generate_and_plot_end_to_end(tmp_path):
    from fairseq_softtopk.data.toy_language_pair import write_toy_corpus

    raw, data_bin, ckpt = tmp_path / "raw", tmp_path / "bin", tmp_path / "ckpt"
    write_toy_corpus(raw, splits={"train": (300, 11), "valid": (30, 12), "test": (30, 13)})
    _run(["-m", "fairseq_cli.preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", raw / "train",
          "--validpref", raw / "valid", "--testpref", raw / "test", "--destdir", data_bin, "--joined-dictionary",
          "--workers", "1"])
    user_dir = ["--user-dir", REPO / "fairseq_softtopk", "--cpu"]
    log = _run(["-m", "fairseq_cli.train", data_bin, *user_dir, "--arch", "softtopk_transformer_tiny",
                "--attention-normalizer", "soft_topk", "--attention-topk", "2", "--share-all-embeddings",
                "--optimizer", "adam", "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20",
                "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "1000",
                "--max-update", "50", "--disable-validation", "--save-interval", "1000", "--no-epoch-checkpoints",
                "--save-dir", ckpt, "--log-format", "simple", "--log-interval", "5", "--seed", "1",
                "--num-workers", "0"], timeout=240)
    losses = [float(x) for x in re.findall(r"train_inner \|.*? loss=([\d.]+)", log)]
    assert len(losses) == 10, log[-2000:]
    assert losses[-1] < losses[0] - 1.0, losses  # about 9.5 -> 7.2 by update 50
    out = _run(["-m", "fairseq_cli.generate", data_bin, *user_dir, "--path", ckpt / "checkpoint_last.pt",
                "--gen-subset", "test", "--beam", "3", "--batch-size", "16", "--print-alignment",
                "--required-batch-size-multiple", "1"])
    alignments = re.findall(r"^A-\d+\t(.*)$", out, flags=re.M)
    assert len(alignments) == 30 and all(re.fullmatch(r"(\d+-\d+ ?)+", a) for a in alignments)
    png = tmp_path / "attention.png"
    _run([REPO / "scripts" / "diagnostics" / "plot_attention.py", ckpt / "checkpoint_last.pt", data_bin, "--index", "3",
          "--output", png])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and min(image.shape[:2]) > 100 and image.std() > 0


@pytest.mark.parametrize("gpu, device_env, expect_cpu", [(False, None, True), (True, None, False), (True, "--cpu", True),
                                                         (False, "", False)])
def test_recipe_script_picks_the_gpu_when_torch_finds_one(tmp_path, gpu, device_env, expect_cpu):
    """configs/softtopk_transformer_multi30k.sh: --cpu only where torch finds no GPU, unless DEVICE says otherwise
    (a stand-in Python records the commands and answers the GPU question)."""
    import os
    import subprocess

    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [[ "$1" == -c ]]; then exit {0 if gpu else 1}; fi
echo "$*" >> {calls}
mkdir -p "{tmp_path}/save"
""")
    fake.chmod(0o755)
    env = {key: os.environ[key] for key in ("PATH", "HOME") if key in os.environ}
    env["PYTHON"] = str(fake)
    if device_env is not None:
        env["DEVICE"] = device_env
    subprocess.run(["bash", REPO / "configs" / "softtopk_transformer_multi30k.sh", tmp_path / "bin", tmp_path / "save"],
                   env=env, check=True, capture_output=True, text=True)
    train, generate = calls.read_text().splitlines()
    assert train.startswith("-m fairseq_cli.train") and generate.startswith("-m fairseq_cli.generate")
    assert (" --cpu " in f" {train} ") == expect_cpu and (" --cpu " in f" {generate} ") == expect_cpu
