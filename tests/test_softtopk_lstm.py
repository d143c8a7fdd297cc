"""Tests of the ``softtopk_lstm`` model: one-step API, fairseq decoding contracts, CLI smoke test."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.sequence_generator import SequenceGenerator

from conftest import script_module, word_dictionary

import fairseq_softtopk.models.softtopk_lstm as softtopk_lstm
import fairseq_softtopk.modules.additive_attention as additive_attention
from fairseq_softtopk.models.softtopk_lstm import SoftTopKLSTMConfig, SoftTopKLSTMDecoderState, SoftTopKLSTMModel
from fairseq_softtopk.modules.additive_attention import AdditiveAttention

USER_DIR = Path(__file__).parents[1] / "fairseq_softtopk"
TIGHT = dict(rtol=0.0, atol=1e-10)  # float64: the same computation up to summation order


@pytest.fixture
def rng() -> torch.Generator:
    torch.manual_seed(0)  # parameter initialisation
    return torch.Generator().manual_seed(1234)  # data


@pytest.fixture
def dictionary():
    return word_dictionary(17)


def build_model(dictionary, dtype=torch.float64, **overrides) -> SoftTopKLSTMModel:
    """Small model with all sizes different (catches transposed dimensions), in eval mode."""
    values = dict(dropout=0.0, encoder_embed_dim=6, encoder_hidden_size=7, decoder_embed_dim=8,
                  decoder_hidden_size=12, decoder_out_embed_dim=8, attention_dim=10,
                  max_source_positions=64, max_target_positions=64)
    values.update(overrides)
    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    return SoftTopKLSTMModel.build_model(SoftTopKLSTMConfig(**values), task).to(dtype).eval()


def sharpened(model: SoftTopKLSTMModel) -> SoftTopKLSTMModel:
    """Weights scaled up so that outputs depend strongly on state and source (untrained models are near-uniform)."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(10)
    return model


def random_tokens(dictionary, rng, batch: int, length: int) -> torch.Tensor:
    return torch.randint(dictionary.nspecial, len(dictionary), (batch, length), generator=rng)


def source_batch(dictionary, rng, lengths, left_pad=True):
    """``(src_tokens, src_lengths)`` as fairseq collates them (left padding by default)."""
    tokens = torch.full((len(lengths), max(lengths)), dictionary.pad())
    for row, n in enumerate(lengths):
        sentence = random_tokens(dictionary, rng, 1, n)[0]
        sentence[-1] = dictionary.eos()
        if left_pad:
            tokens[row, tokens.size(1) - n:] = sentence
        else:
            tokens[row, :n] = sentence
    return tokens, torch.tensor(lengths)


def target_prefix(dictionary, rng, batch: int, length: int) -> torch.Tensor:
    prev = random_tokens(dictionary, rng, batch, length)
    prev[:, 0] = dictionary.eos()
    return prev


def step_chain(decoder, prev_output_tokens, encoder_out) -> torch.Tensor:
    """Log-probabilities ``(batch, tgt_len, vocab)`` by chaining ``decoder.step``."""
    state = decoder.initial_state(encoder_out)
    out = []
    for t in range(prev_output_tokens.size(1)):
        log_probs, state = decoder.step(decoder.embed(prev_output_tokens[:, t]), state, encoder_out)
        out.append(log_probs)
    return torch.stack(out, dim=1)


def test_all_exports_exist():
    for module in (softtopk_lstm, additive_attention):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ lists missing {name}"


@pytest.mark.parametrize("num_layers, share, dtype", [
    (1, False, torch.float64), (2, False, torch.float64), (2, True, torch.float64), (1, True, torch.float32),
])
def test_step_chain_equals_forward_equals_incremental(dictionary, rng, num_layers, share, dtype):
    model = build_model(dictionary, dtype=dtype, encoder_layers=num_layers, decoder_layers=num_layers,
                        share_decoder_input_output_embed=share)
    src_tokens, src_lengths = source_batch(dictionary, rng, [6, 3, 5])
    prev = target_prefix(dictionary, rng, 3, 5)
    encoder_out = model.encoder(src_tokens, src_lengths)
    with torch.no_grad():
        net_output = model(src_tokens, src_lengths, prev)
        forward = model.get_normalized_probs(net_output, log_probs=True)
        chained = step_chain(model.decoder, prev, encoder_out)
        incremental_state = {}
        incremental = torch.cat([
            model.get_normalized_probs(model.decoder(prev[:, : t + 1], encoder_out, incremental_state), log_probs=True)
            for t in range(prev.size(1))
        ], dim=1)
    assert forward.shape == (3, 5, len(dictionary)) and chained.dtype == dtype
    tolerance = TIGHT if dtype == torch.float64 else {}
    torch.testing.assert_close(chained, forward, **tolerance)
    torch.testing.assert_close(incremental, forward, **tolerance)
    assert not torch.allclose(forward[:, 1:], forward[:, :-1])  # the steps are not all alike
    torch.testing.assert_close(model.get_normalized_probs(net_output, log_probs=False), forward.exp(), **tolerance)


def test_reorder_incremental_state_and_encoder_out(dictionary, rng):
    """Incremental decoding with a beam-style reorder midway == forward on the reordered batch."""
    model = build_model(dictionary, decoder_layers=2)
    src_tokens, src_lengths = source_batch(dictionary, rng, [6, 4, 5])
    prev = target_prefix(dictionary, rng, 3, 5)
    new_order = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        encoder_out = model.encoder(src_tokens, src_lengths)
        incremental_state = {}
        for t in range(2):
            model.decoder(prev[:, : t + 1], encoder_out, incremental_state)
        model.decoder.reorder_incremental_state_scripting(incremental_state, new_order)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
        prev = prev[new_order]
        logits, _ = model.decoder(prev[:, :3], encoder_out, incremental_state)
        expected, _ = model(src_tokens[new_order], src_lengths[new_order], prev[:, :3])
    torch.testing.assert_close(logits[:, 0], expected[:, 2], **TIGHT)


def test_state_is_batch_first(dictionary, rng):
    """Permuting state, inputs and encoder output along dim 0 permutes the step's outputs."""
    model = build_model(dictionary, decoder_layers=2)
    src_tokens, src_lengths = source_batch(dictionary, rng, [4, 6, 5])
    decoder = model.decoder
    with torch.no_grad():
        encoder_out = model.encoder(src_tokens, src_lengths)
        state = decoder.initial_state(encoder_out)
        state = decoder.step(decoder.embed(random_tokens(dictionary, rng, 3, 1)[:, 0]), state, encoder_out)[1]
        assert state.hidden.shape == state.cell.shape == (3, 2, 12) and state.input_feed.shape == (3, 12)
        emb = decoder.embed(random_tokens(dictionary, rng, 3, 1)[:, 0])
        log_probs, new_state = decoder.step(emb, state, encoder_out)
        perm = torch.tensor([2, 0, 1])
        permuted_state = SoftTopKLSTMDecoderState(*(x[perm] for x in state))
        log_probs_p, new_state_p = decoder.step(emb[perm], permuted_state,
                                                model.encoder.reorder_encoder_out(encoder_out, perm))
    torch.testing.assert_close(log_probs_p, log_probs[perm], **TIGHT)
    for got, want in zip(new_state_p, new_state):
        torch.testing.assert_close(got, want[perm], **TIGHT)


def test_embed_is_a_row_of_embedding_matrix(dictionary, rng):
    decoder = build_model(dictionary).decoder
    tokens = random_tokens(dictionary, rng, 1, 6)[0]
    assert decoder.embedding_matrix().shape == (len(dictionary), 8)
    torch.testing.assert_close(decoder.embed(tokens), decoder.embedding_matrix()[tokens], rtol=0, atol=0)
    assert decoder.embedding_matrix() is decoder.embed_tokens.weight


def test_step_applies_dropout_like_forward(dictionary, rng):
    """Training mode: one step draws the same dropout masks, in the same order, as ``forward``.

    On a one-token prefix every dropout site of ``forward`` sees a tensor with the same number
    of elements as the step's, so the same seed gives the same masks: the two agree exactly
    only if ``step`` drops out the same sites (embedding, input feed, between layers, ``o``,
    readout). In eval mode (no dropout) the step chain equals ``forward`` at every position.
    """
    src_tokens, src_lengths = source_batch(dictionary, rng, [5, 3])
    prev = target_prefix(dictionary, rng, 2, 3)
    model = build_model(dictionary, dropout=0.5, encoder_layers=2, decoder_layers=2).train()
    encoder_out = model.encoder(src_tokens, src_lengths)

    def forward_one(seed):
        torch.manual_seed(seed)
        return model.get_normalized_probs(model.decoder(prev[:, :1], encoder_out), log_probs=True)[:, 0]

    def step_one(seed):
        torch.manual_seed(seed)
        state = model.decoder.initial_state(encoder_out)
        return model.decoder.step(model.decoder.embed(prev[:, 0]), state, encoder_out)[0]

    torch.testing.assert_close(step_one(7), forward_one(7), rtol=0, atol=1e-6)
    assert not torch.allclose(step_one(7), step_one(8))  # dropout is active in step
    model.eval()
    with torch.no_grad():
        forward = model.get_normalized_probs(model(src_tokens, src_lengths, prev), log_probs=True)
        torch.testing.assert_close(step_chain(model.decoder, prev, model.encoder(src_tokens, src_lengths)), forward)


@pytest.mark.parametrize("left_pad", [True, False])
def test_source_padding_does_not_change_outputs(dictionary, rng, left_pad):
    model = build_model(dictionary, encoder_layers=2)
    alone_src, alone_len = source_batch(dictionary, rng, [4], left_pad=left_pad)
    long_src, _ = source_batch(dictionary, rng, [7], left_pad=left_pad)
    batch_src = torch.full((2, 7), dictionary.pad())
    batch_src[0] = long_src[0]
    if left_pad:
        batch_src[1, 3:] = alone_src[0]
    else:
        batch_src[1, :4] = alone_src[0]
    prev = target_prefix(dictionary, rng, 1, 4)
    with torch.no_grad():
        alone, alone_extra = model(alone_src, alone_len, prev)
        batched, batched_extra = model(batch_src, torch.tensor([7, 4]), prev.expand(2, -1))
    torch.testing.assert_close(batched[1], alone[0], **TIGHT)
    attn = batched_extra["attn"][0][1]  # tgt_len x src_len, positions as in batch_src
    is_pad = batch_src[1].eq(dictionary.pad())
    assert torch.all(attn[:, is_pad] == 0)
    torch.testing.assert_close(attn[:, ~is_pad], alone_extra["attn"][0][0], **TIGHT)


@pytest.mark.parametrize("share", [False, True])
def test_gradients_reach_every_parameter(dictionary, rng, share):
    """Teacher forcing plus a step on soft-weighted embeddings: every parameter gets a gradient."""
    model = build_model(dictionary, dtype=torch.float32, share_decoder_input_output_embed=share,
                        encoder_layers=2, decoder_layers=2)
    src_tokens, src_lengths = source_batch(dictionary, rng, [5, 4, 6])
    prev = target_prefix(dictionary, rng, 3, 4)
    encoder_out = model.encoder(src_tokens, src_lengths)
    log_probs = model.get_normalized_probs(model.decoder(prev, encoder_out), log_probs=True)
    mixing = torch.randn(3, len(dictionary), generator=rng).softmax(-1).requires_grad_()
    soft_input = mixing @ model.decoder.embedding_matrix()
    step_log_probs, state = model.decoder.step(soft_input, model.decoder.initial_state(encoder_out), encoder_out)
    loss = -log_probs[:, :, 5].sum() - step_log_probs[:, 6].sum() + state.input_feed.square().sum()
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"no gradient reaches {name}"
    assert mixing.grad.abs().sum() > 0


def test_sequence_generator_beam1_equals_greedy_step_chain(dictionary, rng):
    """fairseq's beam search with beam 1 picks, step by step, the argmax of ``decoder.step``."""
    model = sharpened(build_model(dictionary))
    src_tokens, src_lengths = source_batch(dictionary, rng, [6, 4, 5])
    generator = SequenceGenerator([model], dictionary, beam_size=1, max_len_b=6)
    hypos = generator.generate([model], {"net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths}})
    decoder = model.decoder
    for row in range(3):
        with torch.no_grad():
            encoder_out = model.encoder(src_tokens[row:row + 1], src_lengths[row:row + 1])
            state, token, tokens, scores = decoder.initial_state(encoder_out), dictionary.eos(), [], []
            for step in range(7):
                log_probs, state = decoder.step(decoder.embed(torch.tensor([token])), state, encoder_out)
                log_probs[0, dictionary.pad()] = float("-inf")
                if step == 0:
                    log_probs[0, dictionary.eos()] = float("-inf")  # min_len 1
                token = dictionary.eos() if step == 6 else int(log_probs[0].argmax())  # max_len forces eos
                tokens.append(token)
                scores.append(float(log_probs[0, token]))
                if token == dictionary.eos():
                    break
        best = hypos[row][0]
        assert best["tokens"].tolist() == tokens
        torch.testing.assert_close(best["positional_scores"].double(), torch.tensor(scores, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)


def test_sequence_generator_beam_scores_match_teacher_forcing(dictionary, rng):
    """Beam 3 (which reorders the incremental state): each hypothesis's positional scores are
    its teacher-forced log-probabilities, so every beam kept the right state."""
    model = sharpened(build_model(dictionary))
    src_tokens, src_lengths = source_batch(dictionary, rng, [6, 4])
    generator = SequenceGenerator([model], dictionary, beam_size=3, max_len_b=5)
    hypos = generator.generate([model], {"net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths}})
    for row in range(2):
        for hypo in hypos[row]:
            tokens = hypo["tokens"].unsqueeze(0)
            prev = torch.cat([tokens.new_full((1, 1), dictionary.eos()), tokens[:, :-1]], dim=1)
            with torch.no_grad():
                net_output = model(src_tokens[row:row + 1], src_lengths[row:row + 1], prev)
                log_probs = model.get_normalized_probs(net_output, log_probs=True)[0]
            expected = log_probs.gather(1, tokens.t())[:, 0]
            torch.testing.assert_close(hypo["positional_scores"].double(), expected, rtol=1e-5, atol=1e-5)


def test_attention_normalize_is_masked_softmax(rng):
    attention = AdditiveAttention(query_dim=4, attention_dim=3)
    scores = torch.randn(2, 6, generator=rng, dtype=torch.float64)
    mask = torch.tensor([[False] * 6, [True, True, False, False, False, False]])
    weights = attention.normalize(scores, mask)
    torch.testing.assert_close(weights[0], scores[0].softmax(-1), **TIGHT)
    torch.testing.assert_close(weights[1, 2:], scores[1, 2:].softmax(-1), **TIGHT)
    assert torch.all(weights[1, :2] == 0)


@pytest.mark.parametrize("normalizer", ["topk", "Softmax"])
def test_unknown_attention_normalizer_raises(dictionary, normalizer):
    with pytest.raises(ValueError, match=normalizer):
        AdditiveAttention(query_dim=4, attention_dim=3, normalizer=normalizer)
    with pytest.raises(ValueError, match=normalizer):
        build_model(dictionary, attention_normalizer=normalizer)


@pytest.mark.parametrize("normalizer", ["soft_topk", "hard_topk", "sparsemax", "entmax15"])
def test_decoder_attention_uses_the_selected_normalizer(dictionary, rng, normalizer):
    """Top-k attention in the LSTM: with k = 1 the attention of every step concentrates on one
    source position (hard exactly, soft nearly), unlike softmax."""
    model = sharpened(build_model(dictionary, attention_normalizer=normalizer, attention_topk=1,
                                  attention_topk_epsilon=1e-3)).eval()
    src, lengths = source_batch(dictionary, rng, [6, 4])
    prev = target_prefix(dictionary, rng, 2, 5)
    _, extra = model(src, lengths, prev)
    attn = extra["attn"][0]  # (batch, tgt_len, src_len)
    torch.testing.assert_close(attn.sum(-1), torch.ones_like(attn.sum(-1)))
    assert bool((attn[1, :, :2] == 0).all())  # left padding of the shorter source
    if normalizer in ("soft_topk", "hard_topk"):
        assert float(attn.detach().amax(-1).min()) > 0.99
    softmax_model = sharpened(build_model(dictionary)).eval()
    softmax_model.load_state_dict(model.state_dict())
    assert not torch.allclose(softmax_model(src, lengths, prev)[1]["attn"][0], attn)


def test_sharing_needs_matching_readout_size(dictionary):
    with pytest.raises(ValueError, match="decoder_out_embed_dim"):
        build_model(dictionary, share_decoder_input_output_embed=True, decoder_out_embed_dim=5)


@pytest.mark.parametrize("arch, expected", [
    ("softtopk_lstm_tiny", dict(encoder_embed_dim=8, decoder_hidden_size=16, decoder_layers=1)),
    ("softtopk_lstm_multi30k", dict(encoder_embed_dim=256, encoder_hidden_size=256, decoder_hidden_size=512)),
    ("softtopk_lstm_wmt14", dict(encoder_embed_dim=620, encoder_hidden_size=1000, decoder_hidden_size=1000,
                                 decoder_out_embed_dim=500, decoder_maxout_pieces=2, attention_dim=1000)),
])
def test_architectures_set_sizes_and_flags_override(arch, expected):
    argv = ["data", "--arch", arch, "--dropout", "0.25", "--share-decoder-input-output-embed"]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv)).model
    assert {k: cfg[k] for k in expected} == expected
    assert cfg.dropout == 0.25 and cfg.share_decoder_input_output_embed and cfg.attention_normalizer == "softmax"


def _run(args, cwd):
    # one thread: tiny tensors, and other test processes may share the cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_train_and_generate_end_to_end(tmp_path):
    """Preprocess a toy corpus, train the tiny architecture 5 epochs (95 updates), decode with beam search."""
    from fairseq_softtopk.data.toy_language_pair import write_toy_corpus

    write_toy_corpus(tmp_path / "raw", splits={"train": (300, 11), "valid": (30, 12), "test": (30, 13)})
    langs = ["--source-lang", "src", "--target-lang", "tgt"]
    _run(["-m", "fairseq_cli.preprocess", *langs, "--trainpref", "raw/train", "--validpref", "raw/valid",
          "--testpref", "raw/test", "--destdir", "bin", "--workers", "1"], tmp_path)
    log = _run(["-m", "fairseq_cli.train", "bin", *langs, "--user-dir", USER_DIR, "--arch", "softtopk_lstm_tiny",
                "--cpu", "--optimizer", "adam", "--lr", "0.01", "--batch-size", "16", "--max-update", "95",
                "--criterion", "cross_entropy", "--save-dir", "ckpt", "--no-epoch-checkpoints", "--seed", "1",
                "--log-format", "json", "--no-progress-bar", "--num-workers", "0", "--disable-validation",
                "--save-interval", "1000"], tmp_path)
    losses = [float(json.loads(m)["train_loss"]) for m in re.findall(r"\| train \| (\{.*\})", log)]
    assert len(losses) == 5, log[-2000:]  # 19 updates an epoch
    assert losses[-1] < losses[0] - 1.5, losses  # in bits per token; about 7.8 -> 5.6
    # --required-batch-size-multiple 1: fairseq otherwise drops the last partial batch (fairseq #5036)
    out = _run(["-m", "fairseq_cli.generate", "bin", *langs, "--user-dir", USER_DIR, "--path",
                "ckpt/checkpoint_last.pt", "--cpu", "--gen-subset", "test", "--beam", "4", "--batch-size", "8",
                "--required-batch-size-multiple", "1", "--num-workers", "0", "--print-alignment"], tmp_path)
    hypotheses = re.findall(r"^H-(\d+)\t(\S+)\t", out, flags=re.M)
    assert sorted(int(i) for i, _ in hypotheses) == list(range(30))
    assert all(float(score) < 0 for _, score in hypotheses)
    assert "BLEU4" in out


def test_plot_attention_reads_the_lstms_attention_and_draws_panels_side_by_side(dictionary, rng, tmp_path):
    """scripts/diagnostics/plot_attention.py (experiments.attention_maps) on the attentional LSTM: the
    teacher-forced attention of one pair, row t the weights used while predicting target token t, equal to
    what incremental decoding (fairseq-generate's path) uses; several models give panels side by side."""
    from fairseq_softtopk.experiments.attention_maps import attention_matrix, panel_title

    plot_attention = script_module("diagnostics/plot_attention.py")
    model = sharpened(build_model(dictionary, attention_normalizer="soft_topk", attention_topk=2))
    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    source = torch.cat([random_tokens(dictionary, rng, 1, 6)[0], torch.tensor([dictionary.eos()])])
    target = torch.cat([random_tokens(dictionary, rng, 1, 4)[0], torch.tensor([dictionary.eos()])])
    weights, src_tokens, tgt_tokens = attention_matrix(model, task, source, target)
    assert weights.shape == (5, 7) and len(src_tokens) == 7 and tgt_tokens[-1] == dictionary[dictionary.eos()]
    encoder_out = model.encoder(source.unsqueeze(0), torch.tensor([7]))
    prev = torch.cat([torch.tensor([dictionary.eos()]), target[:-1]]).unsqueeze(0)
    incremental_state, rows = {}, []
    with torch.no_grad():
        for t in range(5):
            _, extra = model.decoder(prev[:, : t + 1], encoder_out, incremental_state)
            rows.append(extra["attn"][0][0, -1])
    torch.testing.assert_close(torch.from_numpy(weights), torch.stack(rows).float())
    assert abs(weights.sum(-1) - 1).max() < 1e-5 and (weights > 0.05).sum(-1).min() <= 3  # soft top-2: sparse rows
    with pytest.raises(ValueError, match="transformer"):
        attention_matrix(model, task, source, target, layer=0)
    assert panel_title(model, None, None) == "soft_topk k=2 eps=0.1"
    for name, title in (("sparse_topk", "sparse_topk k=2 eps=0.1"), ("hard_topk", "hard_topk k=2"), ("softmax", "softmax")):
        assert panel_title(build_model(dictionary, attention_normalizer=name, attention_topk=2), None, None) == title
    one, three = tmp_path / "one.png", tmp_path / "three.png"
    plot_attention.plot_heatmaps([(weights, "a")], src_tokens, tgt_tokens, one)
    plot_attention.plot_heatmaps([(weights, "a"), (weights, "b"), (weights, "c")], src_tokens, tgt_tokens, three)
    import matplotlib.image

    width_one, width_three = matplotlib.image.imread(one).shape[1], matplotlib.image.imread(three).shape[1]
    assert width_three > 2 * width_one


def test_attention_sparsity_statistics_match_one_sentence_at_a_time(dictionary, rng):
    """scripts/diagnostics/attention_sparsity.py on a padded batch == the same numbers from each sentence's
    own attention matrix (experiments.attention_maps, unpadded), for softmax and hard top-k attention."""
    import numpy as np

    from fairseq_softtopk.experiments.attention_maps import attention_matrix

    attention_sparsity = script_module("diagnostics/attention_sparsity.py")

    src_tokens, src_lengths = source_batch(dictionary, rng, [7, 4, 6])
    pad, eos = dictionary.pad(), dictionary.eos()
    target = torch.full((3, 5), pad)
    for row, n in enumerate([5, 3, 4]):
        target[row, :n] = torch.cat([random_tokens(dictionary, rng, 1, n - 1)[0], torch.tensor([eos])])
    prev = torch.cat([torch.full((3, 1), eos), target[:, :-1].masked_fill(target[:, :-1].eq(eos), pad)], dim=1)
    sample = {"net_input": {"src_tokens": src_tokens, "src_lengths": src_lengths, "prev_output_tokens": prev},
              "target": target}

    class OneBatchTask:
        source_dictionary = target_dictionary = dictionary

        def load_dataset(self, subset):
            pass

        def dataset(self, subset):
            return None

        def get_batch_iterator(self, dataset, **kwargs):
            return SimpleNamespace(next_epoch_itr=lambda shuffle: iter([sample]))

    for normalizer in ("softmax", "hard_topk"):
        model = sharpened(build_model(dictionary, attention_normalizer=normalizer, attention_topk=2))
        stats = attention_sparsity.attention_statistics(model, OneBatchTask(), "test", k=2)
        outside, above, nonzero = [], [], []
        for row, (n_src, n_tgt) in enumerate(zip([7, 4, 6], [5, 3, 4])):
            source = src_tokens[row, src_tokens.size(1) - n_src:]  # left-padded source
            weights, _, _ = attention_matrix(model, OneBatchTask(), source, target[row, :n_tgt])
            top2 = np.sort(weights, axis=-1)[:, -2:].sum(-1)
            outside += list(1 - top2)
            above += list((weights > 0.01).sum(-1))
            nonzero += list((weights > 0).sum(-1))
        assert stats["tokens"] == 12
        assert stats["outside_topk"] == pytest.approx(np.clip(outside, 0, None).mean(), abs=1e-6)
        assert stats["above_1pct"] == pytest.approx(np.mean(above))
        assert stats["nonzero"] == pytest.approx(np.mean(nonzero))
        if normalizer == "hard_topk":
            assert stats["outside_topk"] == pytest.approx(0.0, abs=1e-6) and stats["nonzero"] <= 2.0
        else:
            assert stats["outside_topk"] > 0.01 and stats["nonzero"] > 3


def test_a_checkpoint_config_without_a_newer_option_still_builds(dictionary, rng):
    """fairseq-generate builds the model from the config stored in the checkpoint, through the architecture
    function: a config saved before an option existed (here without attention_topk_backend and
    attention_topk_epsilon) gets the options' defaults, and the model it builds computes what the same weights
    compute in a model built with every option given."""
    from omegaconf import OmegaConf
    from fairseq.models import build_model

    task = SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    full = {"_name": "softtopk_lstm_tiny", "attention_normalizer": "soft_topk", "attention_topk": 2,
            "attention_topk_epsilon": 0.1, "attention_topk_backend": "auto", "max_source_positions": 64,
            "max_target_positions": 64, "bf16": False, "cpu": True}
    old = {key: value for key, value in full.items() if key not in ("attention_topk_backend", "attention_topk_epsilon")}
    stored = OmegaConf.create(old)
    OmegaConf.set_struct(stored, True)  # as a loaded checkpoint's config: a missing key raises on access
    model = build_model(stored, task)
    reference = build_model(OmegaConf.create(full), task)
    assert model.decoder.attention.normalizer.epsilon == reference.decoder.attention.normalizer.epsilon == 0.1
    reference.load_state_dict(model.state_dict())
    src = torch.randint(4, len(dictionary), (2, 5), generator=rng)
    prev = torch.randint(4, len(dictionary), (2, 4), generator=rng)
    model.eval(), reference.eval()
    torch.testing.assert_close(model(src, torch.tensor([5, 5]), prev)[0], reference(src, torch.tensor([5, 5]), prev)[0])
