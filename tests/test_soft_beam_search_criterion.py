"""The soft_beam_search criterion: its loss formula, its options, and the selection-gradient remedy."""

from types import SimpleNamespace

import pytest
import torch
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.tasks import FairseqTask

from builders import build_criterion, build_model, make_sample
from conftest import compiles_fixed_solve, recorded_solves, script_module, word_dictionary

from fairseq_softtopk.modules.beam_search_config import annealed_epsilon
from fairseq_softtopk.modules import beam_selection
from fairseq_softtopk.modules.beam_search import BeamSearchConfig, unroll_beam_search
from fairseq_softtopk.ops import cap_row_grad_norm


@pytest.fixture
def dictionary():
    return word_dictionary(13)


def teacher_forced_lprobs(model, sample, prev_output_tokens):
    out = model(sample["net_input"]["src_tokens"], sample["net_input"]["src_lengths"], prev_output_tokens)
    return model.get_normalized_probs(out, log_probs=True)


def test_loss_is_p_tf_plus_one_minus_p_beam_with_label_smoothing(dictionary, rng):
    """loss = p L_tf + (1 - p) L_beam, both fairseq's label-smoothed NLL summed over target tokens
    (fairseq divides by sample_size = target tokens); L_beam is the teacher-forced loss of the gold
    tokens given the best beam's own prefix (hard mode: the beam's inputs are its tokens)."""
    model = build_model(dictionary, scale=5.0)
    model.eval()  # no dropout: the reference forward must see the same network
    sample = make_sample(dictionary, rng, [5, 3, 4])
    p, smoothing, pad = 0.7, 0.1, dictionary.pad()
    criterion = build_criterion(dictionary, topk_mode="hard", teacher_forcing_ratio=p, label_smoothing=smoothing)
    with torch.no_grad():
        loss, sample_size, log = criterion(model, sample)
        target = sample["target"]
        T = target.shape[1]
        tf, _ = label_smoothed_nll_loss(teacher_forced_lprobs(model, sample, sample["net_input"]["prev_output_tokens"]),
                                        target, smoothing, ignore_index=pad)
        # the best beam's path, from a search on each sentence alone (so that its last step is the
        # sentence's own: final beams of a shorter sentence in a batch run on past its end)
        paths = []
        for b, n in enumerate(target.ne(pad).sum(-1).tolist()):
            one = {key: value[b:b + 1] for key, value in sample["net_input"].items()}

            def search(encoder, decoder, encoder_out):
                return unroll_beam_search(decoder, encoder_out, encoder.reorder_encoder_out, target[b:b + 1, :n],
                                          pad, dictionary.eos(), criterion.search)

            _, beam = model(**one, beam_search=search)
            paths.append(torch.cat([beam.tokens[0, beam.best_beam[0]], target.new_full((T - n,), pad)]))
        path = torch.stack(paths)
        prev = torch.cat([torch.full((target.shape[0], 1), dictionary.eos()), path[:, :-1]], 1)
        beam_ref, _ = label_smoothed_nll_loss(teacher_forced_lprobs(model, sample, prev), target, smoothing,
                                              ignore_index=pad)
    assert sample_size == sample["ntokens"] == 12
    torch.testing.assert_close(log["tf_loss"], tf)
    torch.testing.assert_close(log["beam_loss"], beam_ref)
    torch.testing.assert_close(loss, p * tf + (1 - p) * beam_ref)
    assert float((tf - beam_ref).abs()) > 0.1  # the two terms differ, so p is pinned


def test_sentence_avg_counts_sentences_and_p_one_skips_the_search(dictionary, rng):
    model = build_model(dictionary).eval()
    sample = make_sample(dictionary, rng, [4, 2])
    with torch.no_grad():
        loss, size, log = build_criterion(dictionary, teacher_forcing_ratio=1.0, sentence_avg=True)(model, sample)
        tf, _ = label_smoothed_nll_loss(teacher_forced_lprobs(model, sample, sample["net_input"]["prev_output_tokens"]),
                                        sample["target"], 0.1, ignore_index=dictionary.pad())
    assert size == 2
    torch.testing.assert_close(loss, tf)
    assert "topk_sharpness_sum" not in log and float(log["beam_loss"]) == 0.0


@pytest.mark.parametrize("bad, message", [({"topk_grad_cap": 0.0}, "topk-grad-cap"),
                                          ({"teacher_forcing_ratio": 1.5}, "teacher-forcing-ratio"),
                                          ({"topk_epsilon_start": 0.3}, "needs both"),
                                          ({"topk_epsilon_anneal_updates": 100}, "needs both"),
                                          ({"topk_epsilon_start": -1.0, "topk_epsilon_anneal_updates": 5},
                                           r"epsilon-start must be 0 \(no schedule\) or a number in"),
                                          ({"topk_epsilon_start": 0.3, "topk_epsilon_anneal_updates": 5,
                                            "topk_mode": "hard"}, "topk-mode soft"),
                                          ({"topk_epsilon_relative": -0.5}, "epsilon-relative must be a finite number >= 0"),
                                          ({"topk_epsilon_relative": 0.5, "topk_mode": "hard"}, "topk-mode soft"),
                                          ({"topk_epsilon_relative": 0.5, "topk_cost": "paper"}, "topk-cost linear"),
                                          ({"topk_fixed_iterations": True, "topk_mode": "hard"},
                                           "fixed-iterations is an option of --topk-mode soft"),
                                          ({"topk_compile": "default"}, "topk-compile needs --topk-fixed-iterations"),
                                          ({"topk_regularizer": "quadratic", "topk_mode": "hard"},
                                           "regularizer quadratic is an option of --topk-mode soft"),
                                          ({"topk_regularizer": "quadratic", "topk_cost": "paper"}, "topk-cost linear"),
                                          ({"topk_regularizer": "quadratic", "topk_fixed_iterations": True,
                                            "topk_compile": "default"}, "not available with --topk-regularizer"),
                                          ({"topk_regularizer": "l2"}, "topk-regularizer must be one of"),
                                          ({"topk_compile": "default", "topk_fixed_iterations": True,
                                            "topk_epsilon_start": 0.3, "topk_epsilon_anneal_updates": 5},
                                           "does not go with an epsilon schedule")])
def test_bad_options_are_named(dictionary, bad, message):
    with pytest.raises(ValueError, match=message):
        build_criterion(dictionary, **bad)


def test_unknown_selection_grad_is_refused():
    with pytest.raises(ValueError, match="selection_grad"):
        BeamSearchConfig(selection_grad="clipped")


def test_cap_row_grad_norm_scales_rows_above_the_cap_only(rng):
    x = torch.randn(4, 7, generator=rng, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 7, generator=rng, dtype=torch.float64)
    g[1] *= 1e-3  # below the cap: unchanged
    seen = []
    (cap_row_grad_norm(x, 0.5, lambda norms: seen.append(norms.clone())) * g).sum().backward()
    norms = g.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(x.grad, g * torch.clamp(0.5 / norms, max=1.0))
    torch.testing.assert_close(seen[0], norms.squeeze(-1))
    assert float(x.grad.norm(dim=-1).max()) <= 0.5 + 1e-12
    with pytest.raises(ValueError, match="max_norm"):
        cap_row_grad_norm(x, 0.0)


def _grad_norm(model, criterion, sample) -> float:
    """As fairseq: backward of the summed loss, then the gradient divided by the sample size."""
    model.zero_grad(set_to_none=True)
    loss, size, log = criterion(model, sample)
    loss.backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                       if p.grad is not None]))) / size, log


def test_capped_selection_gradient_stays_bounded_where_the_exact_one_explodes(dictionary, rng):
    """A near tie at a rank boundary with a small epsilon and scores that depend strongly on the
    mixed states (large weights): the exact gradient through the chained selections explodes
    (over 1000x the hard path's); the capped default stays within 10x of it."""
    model = build_model(dictionary, scale=10.0)
    sample = make_sample(dictionary, rng, [14, 12, 14])
    common = dict(topk_epsilon=0.003, teacher_forcing_ratio=0.8)
    norms = {}
    for name, flags in {"hard": dict(topk_mode="hard"), "full": dict(topk_grad="full"),
                        "capped": dict(topk_grad="capped", topk_grad_cap=1.0),
                        "none": dict(topk_grad="none")}.items():
        torch.manual_seed(0)
        criterion = build_criterion(dictionary, **common, **flags)
        criterion.record_selection_grads = [] if name != "hard" else None
        norms[name], log = _grad_norm(model, criterion, sample)
        if name == "capped":
            assert float(log["selgrad_count"]) == len(criterion.record_selection_grads) == (13 + 11 + 13)
            # the observed norms are before the cap; the logged share counts those above it
            over = sum(n > 1.0 for n in criterion.record_selection_grads)
            assert float(log["selgrad_capped"]) == over > 0
    assert float(log["topk_near_tie_sum"]) > 0
    assert norms["full"] > 1e3 * norms["hard"]
    assert norms["capped"] < 10 * norms["hard"]
    assert norms["none"] < 10 * norms["hard"]


def test_diagnose_script_reports_each_sentences_gradient_norm(dictionary, rng):
    """scripts/diagnostics/diagnose_beam_gradients.py: per-sentence norms as a direct backward computes them,
    nearest-rank quantiles, and the selection-gradient norms of every live step."""
    diagnose = script_module("diagnostics/diagnose_beam_gradients.py")
    diagnose_variant, quantiles = diagnose.diagnose_variant, diagnose.quantiles

    model = build_model(dictionary, scale=3.0)
    batches = [make_sample(dictionary, rng, [n]) for n in (5, 7, 4)]
    criterion = build_criterion(dictionary, topk_epsilon=0.05, topk_grad_cap=0.01)
    report = diagnose_variant(model, criterion, batches, seed=3)
    expected = []
    for i, sample in enumerate(batches):
        torch.manual_seed(3 + i)
        expected.append(_grad_norm(model, criterion, sample)[0])
    assert report["grad_norms"] == pytest.approx(expected, rel=1e-12)
    assert report["selection_grad"] is not None and 0 < report["sharpness"] <= 1
    assert quantiles([5.0, 1.0, 3.0, 2.0, 4.0]) == {"median": 3.0, "p90": 5.0, "p99": 5.0, "max": 5.0}
    assert quantiles(list(range(1, 101)))["p90"] == 90


def test_unconverged_counter_sees_exactly_the_unconverged_solves_without_warnings(dictionary, rng):
    """topk_unconverged is the number of the search's top-k solves that missed their tolerance (here
    --topk-max-iter 1 with a tight tol), and training logs get no SoftTopKConvergenceWarning per step."""
    import warnings

    from fairseq_softtopk.ops import SoftTopKConvergenceWarning

    model = build_model(dictionary)
    sample = make_sample(dictionary, rng, [5, 3, 4])
    for max_iter, tol in ((1, 1e-12), (50, 1e-8)):
        criterion = build_criterion(dictionary, topk_max_iter=max_iter, topk_tol=tol)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with recorded_solves() as infos:
                loss, _, log = criterion(model, sample)
                loss.backward()
        assert len(infos) == sample["target"].shape[1]
        assert log["topk_unconverged"] == [i.converged for i in infos].count(False)
        assert not [w for w in caught if issubclass(w.category, SoftTopKConvergenceWarning)]
        if max_iter == 1:
            assert log["topk_unconverged"] > 0
        else:
            assert log["topk_unconverged"] == 0


def test_fixed_iterations_flag_gives_the_default_loss_and_gradient_and_counts_unconverged(dictionary, rng):
    """--topk-fixed-iterations reaches the search (solves of exactly --topk-max-iter iterations, counted as
    such), gives the default's loss and gradient where the solves converge, and logs topk_unconverged as a
    tensor (counted on the device, read when fairseq reduces the logs): every step with --topk-max-iter 1."""
    model = build_model(dictionary, scale=3.0)
    model.eval()  # no dropout: both criteria must see the same network
    sample = make_sample(dictionary, rng, [5, 3, 4])
    results = []
    for fixed in (False, True):
        model.zero_grad()
        loss, _, log = build_criterion(dictionary, topk_fixed_iterations=fixed, topk_max_iter=40,
                                       topk_tol=1e-10)(model, sample)
        loss.backward()
        results.append((loss.detach(), model.decoder.embed_tokens.weight.grad.clone(), log))
    (loss_default, grad_default, log_default), (loss_fixed, grad_fixed, log_fixed) = results
    torch.testing.assert_close(loss_fixed, loss_default, atol=1e-9, rtol=0)
    torch.testing.assert_close(grad_fixed, grad_default, atol=1e-8, rtol=1e-7)
    T = sample["target"].shape[1]
    assert log_fixed["topk_newton_iters"] == 40 * T
    assert log_default["topk_newton_iters"] < 40 * T
    assert torch.is_tensor(log_fixed["topk_unconverged"]) and int(log_fixed["topk_unconverged"]) == 0
    _, _, starved = build_criterion(dictionary, topk_fixed_iterations=True, topk_max_iter=1, topk_tol=1e-12)(model, sample)
    assert int(starved["topk_unconverged"]) == T


@compiles_fixed_solve
def test_topk_compile_gives_the_eager_loss_and_gradient_and_compiles_once_for_all_batch_sizes(dictionary, rng,
                                                                                                monkeypatch):
    """--topk-compile runs each step's fixed-iteration solve under torch.compile (fullgraph, dynamic shapes;
    here the aot_eager backend, which traces forward and backward as inductor does: inductor's C++ build takes
    minutes on this CPU): the eager search's loss and gradients, and batches of other sizes and lengths reuse
    the one compiled solve (a recompilation per batch shape would cost minutes per update)."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return aot_eager(graph, example_inputs)

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, **{**options, "backend": counting_backend}))
    beam_selection.compiled_fixed_solve.cache_clear()
    torch._dynamo.reset()
    try:
        model = build_model(dictionary, scale=3.0)
        model.eval()  # no dropout: both criteria must see the same network
        options = dict(topk_fixed_iterations=True, topk_max_iter=12, teacher_forcing_ratio=0.5)
        compiled_after = []
        for lengths in ([5, 3, 4], [6, 2, 4, 3, 5]):
            sample = make_sample(dictionary, rng, lengths)
            results = []
            for compile_mode in ("none", "default"):
                model.zero_grad()
                loss, _, log = build_criterion(dictionary, topk_compile=compile_mode, **options)(model, sample)
                loss.backward()
                results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], log))
            (loss_eager, grads_eager, log_eager), (loss_compiled, grads_compiled, log_compiled) = results
            torch.testing.assert_close(loss_compiled, loss_eager, atol=1e-10, rtol=1e-10)
            for eager, compiled in zip(grads_eager, grads_compiled):
                torch.testing.assert_close(compiled, eager, atol=1e-10, rtol=1e-8)
            assert int(log_compiled["topk_unconverged"]) == int(log_eager["topk_unconverged"]) == 0
            compiled_after.append(len(graphs))
        # compiled at the first batch (dynamo may trace a frame twice, restarting once for its float arguments),
        # then nothing more for a batch of other sentence count and length
        assert compiled_after[0] >= 1 and compiled_after[1] == compiled_after[0]
    finally:
        beam_selection.compiled_fixed_solve.cache_clear()
        torch._dynamo.reset()


def test_annealed_epsilon_is_geometric_from_start_to_end():
    start, end, n = 0.3, 0.03, 100
    assert annealed_epsilon(start, end, 0, n) == pytest.approx(start)
    assert annealed_epsilon(start, end, 50, n) == pytest.approx((start * end) ** 0.5)  # geometric midpoint
    assert annealed_epsilon(start, end, 25, n) / annealed_epsilon(start, end, 24, n) == pytest.approx(
        annealed_epsilon(start, end, 90, n) / annealed_epsilon(start, end, 89, n))  # the same factor each update
    assert annealed_epsilon(start, end, n, n) == end == annealed_epsilon(start, end, 10 * n, n)
    assert annealed_epsilon(start, end, 7, 0) == end  # no schedule


def _train_step(model, criterion, sample, update_num):
    """fairseq's own training step (it tells the model the update number), backward included."""
    optimizer = SimpleNamespace(backward=lambda loss: loss.backward())
    model.zero_grad()
    return FairseqTask.train_step(SimpleNamespace(), sample, model, criterion, optimizer, update_num)


@pytest.mark.parametrize("update_num, expected", [(0, 0.4), (10, (0.4 * 0.05) ** 0.5), (20, 0.05), (35, 0.05)])
def test_epsilon_schedule_follows_fairseqs_update_number(dictionary, rng, update_num, expected):
    """With a schedule, fairseq's train step at update u gives the loss and gradient of the fixed
    epsilon the schedule names for u (model without dropout: the runs see one network)."""
    sample = make_sample(dictionary, rng, [5, 3, 4])
    scheduled = build_criterion(dictionary, topk_epsilon=0.05, topk_epsilon_start=0.4, topk_epsilon_anneal_updates=20)
    fixed = build_criterion(dictionary, topk_epsilon=expected)
    model = build_model(dictionary, scale=3.0)
    loss, _, log = _train_step(model, scheduled, sample, update_num)
    grads = [param.grad.clone() for param in model.parameters()]
    reference, _, _ = _train_step(model, fixed, sample, update_num)
    torch.testing.assert_close(loss, reference)
    for grad, param in zip(grads, model.parameters()):
        torch.testing.assert_close(grad, param.grad)
    assert log["topk_epsilon_sum"] / sample["target"].shape[1] == pytest.approx(expected)
    # and the schedule matters: the start's epsilon gives another loss than the end's
    other, _, _ = _train_step(model, build_criterion(dictionary, topk_epsilon=0.4 if update_num >= 20 else 0.05),
                              sample, update_num)
    assert float((other - loss).detach().abs()) > 1e-4


def test_epsilon_schedule_needs_a_model_that_counts_updates(dictionary, rng):
    criterion = build_criterion(dictionary, topk_epsilon_start=0.3, topk_epsilon_anneal_updates=5)
    model = build_model(dictionary)
    with pytest.raises(ValueError, match="records its update number"):
        criterion(model, make_sample(dictionary, rng, [3]))


def test_a_model_that_cannot_unroll_the_search_is_named_and_teacher_forcing_still_works(dictionary, rng):
    """fairseq's own LSTM keeps its recurrent state itself (neither the plugin's step interface nor attention
    caches): the beam term names what is missing and the models that have it (instead of a TypeError from deep
    inside forward); p = 1 is plain teacher forcing for any model."""
    from builders import build_fairseq_lstm, build_transformer
    from fairseq_softtopk.criterions.model_unroll import unroll_interface_missing, unroll_kind

    fairseq_lstm = build_fairseq_lstm(dictionary)
    sample = make_sample(dictionary, rng, [4, 2])
    with pytest.raises(ValueError, match=r"LSTMModel cannot do: it lacks forward\(\.\.\., beam_search=\), "
                                         r"decoder\.initial_state.*LSTMDecoder keeps a state of its own.*"
                                         r"softtopk_lstm.*softtopk_transformer.*transformer family"):
        build_criterion(dictionary, teacher_forcing_ratio=0.8)(fairseq_lstm, sample)
    loss, _, log = build_criterion(dictionary, teacher_forcing_ratio=1.0)(fairseq_lstm, sample)
    assert torch.isfinite(loss) and float(log["beam_loss"]) == 0.0
    lstm = build_model(dictionary)
    assert unroll_interface_missing(lstm) == [] and unroll_kind(lstm) == "model"
    # through wrappers: fairseq's ModuleProxyWrapper around DistributedDataParallel around the model
    wrapped = torch.nn.Module()
    wrapped.module = torch.nn.Module()
    wrapped.module.module = lstm
    assert unroll_interface_missing(wrapped) == [] and unroll_kind(wrapped) == "model"
    transformer = torch.nn.ModuleDict({"module": build_transformer(dictionary)})
    assert unroll_interface_missing(transformer)[:1] == ["forward(..., beam_search=)"]
    assert unroll_kind(transformer) == "incremental"


@pytest.mark.parametrize("architecture", ["softtopk_lstm", "softtopk_transformer"])
def test_topk_mixed_is_logged_for_the_gold_and_the_risk_search(dictionary, rng, architecture):
    """topk_mixed: candidates mixed into a step's new beams per sentence, over the steps that reach the loss: exactly
    the beam in hard mode, more with the quadratic regulariser (its support), for both searches and models."""
    from fairseq.logging import metrics

    from builders import build_transformer

    model = build_model(dictionary) if architecture == "softtopk_lstm" else build_transformer(dictionary)
    sample = make_sample(dictionary, rng, [5, 3, 4])
    lengths = sample["target"].ne(dictionary.pad()).sum(-1)
    for beam_loss in ("gold", "risk"):
        hard = build_criterion(dictionary, topk_mode="hard", beam_loss=beam_loss, train_beam=3)
        _, _, log = hard(model, sample)
        assert float(log["topk_mixed_sum"]) == 3 * float(log["topk_mixed_count"]) > 0
        if beam_loss == "gold":  # every step but a sentence's last reaches the loss
            assert int(log["topk_mixed_count"]) == int((lengths - 1).sum())
        sparse = build_criterion(dictionary, topk_regularizer="quadratic", topk_epsilon=2.0, beam_loss=beam_loss,
                                 train_beam=3)
        _, _, log = sparse(model, sample)
        assert float(log["topk_mixed_sum"]) > 3 * float(log["topk_mixed_count"])
        with metrics.aggregate() as aggregated:
            type(sparse).reduce_metrics([log])
        assert aggregated.get_smoothed_values()["topk_mixed"] == pytest.approx(
            float(log["topk_mixed_sum"]) / float(log["topk_mixed_count"]), abs=0.01)


def test_risk_cost_units_scale_the_beam_term(dictionary, rng, monkeypatch):
    """--beam-risk-cost: bleu_points makes the beam term exactly 100 x the bleu one; minmax is the risk of the
    per-sentence min-max scaled costs of the same hypotheses (recomputed from the search's output)."""
    from fairseq_softtopk.modules.search_losses import risk_loss
    from fairseq_softtopk.modules.sequence_risk import expected_risk, scale_costs, sentence_bleu_costs

    model = build_model(dictionary, scale=3.0).eval()
    sample = make_sample(dictionary, rng, [5, 3, 4])
    logs = {}
    with torch.no_grad():
        for unit in ("bleu", "bleu_points", "minmax"):
            criterion = build_criterion(dictionary, beam_loss="risk", beam_risk_cost=unit, train_beam=3,
                                        teacher_forcing_ratio=0.5)
            _, _, logs[unit] = criterion(model, sample)
    assert float(logs["bleu"]["beam_loss"]) > 0
    assert float(logs["bleu_points"]["beam_loss"]) == pytest.approx(100 * float(logs["bleu"]["beam_loss"]), rel=1e-9)
    assert float(logs["bleu_points"]["tf_loss"]) == float(logs["bleu"]["tf_loss"])
    # minmax, recomputed from the search's hypotheses
    import fairseq_softtopk.criterions.soft_beam_search as module
    captured = {}

    def capture(finished, target, eos, pad, temperature=1.0, cost="bleu"):
        captured["finished"], captured["target"] = finished, target
        return risk_loss(finished, target, eos, pad, temperature, cost)

    monkeypatch.setattr(module, "risk_loss", capture)
    criterion = build_criterion(dictionary, beam_loss="risk", beam_risk_cost="minmax", train_beam=3,
                                teacher_forcing_ratio=0.5)
    with torch.no_grad():
        _, _, log = criterion(model, sample)
    finished, target = captured["finished"], captured["target"]
    costs = sentence_bleu_costs(finished.tokens, target, dictionary.eos(), dictionary.pad())
    risk = expected_risk(finished.scores, scale_costs(costs, finished.scores, "minmax"))
    mask = target.ne(dictionary.pad())
    assert float(log["beam_loss"]) == pytest.approx(float((risk * mask.sum(-1)).sum()), rel=1e-9)
    assert float(log["beam_loss"]) != pytest.approx(float(logs["bleu"]["beam_loss"]), rel=1e-3)


@pytest.mark.parametrize("beam_loss", ["gold", "risk"])
def test_term_gradient_norms_are_each_terms_gradient_and_change_nothing_else(dictionary, rng, beam_loss):
    """--log-term-gnorm-interval: tf_gnorm is the norm of p x the gradient of the teacher-forcing loss alone (a
    criterion with p = 1), beam_gnorm that of the rest of the full gradient, both divided by the sample size; the
    parameters' gradient and the selection-gradient statistics are those of a run without it; measured on calls
    1, 3, 5 of interval 2; reduce_metrics logs the means."""
    from fairseq.logging import metrics

    p = 0.4
    sample = make_sample(dictionary, rng, [5, 3, 4])
    common = dict(beam_loss=beam_loss, train_beam=3, teacher_forcing_ratio=p)

    def gradient(criterion):
        model = build_model(dictionary, scale=3.0)
        loss, sample_size, log = criterion(model, sample)
        loss.backward()
        return [q.grad.clone() for q in model.parameters()], sample_size, log

    plain, sample_size, plain_log = gradient(build_criterion(dictionary, **common))
    measured = build_criterion(dictionary, **common, log_term_gnorm_interval=2)
    full, _, log = gradient(measured)
    for a, b in zip(plain, full):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for key in ("selgrad_count", "selgrad_log10_sum"):
        assert float(log[key]) == float(plain_log[key]) and float(log[key]) != 0
    tf_only, _, _ = gradient(build_criterion(dictionary, **{**common, "teacher_forcing_ratio": 1.0}))
    tf_norm = p * torch.cat([g.flatten() for g in tf_only]).norm()
    beam_norm = torch.cat([(g - p * t).flatten() for g, t in zip(full, tf_only)]).norm()
    assert float(log["tf_gnorm_sum"]) == pytest.approx(float(tf_norm) / sample_size, rel=1e-9)
    assert float(log["beam_gnorm_sum"]) == pytest.approx(float(beam_norm) / sample_size, rel=1e-9)
    assert log["term_gnorm_count"] == 1 and float(log["beam_gnorm_sum"]) > 0
    # calls 2 and 4 are not measured, 3 and 5 are
    counts = [gradient(measured)[2].get("term_gnorm_count", 0) for _ in range(4)]
    assert counts == [0, 1, 0, 1]
    with metrics.aggregate() as aggregated:
        type(measured).reduce_metrics([log, plain_log, log])
    values = aggregated.get_smoothed_values()
    assert values["tf_gnorm"] == pytest.approx(float(tf_norm) / sample_size, abs=1e-4)
    assert values["beam_gnorm"] == pytest.approx(float(beam_norm) / sample_size, abs=1e-4)
    # not measured in evaluation mode, nor without a gradient
    model = build_model(dictionary).eval()
    with torch.no_grad():
        assert "term_gnorm_count" not in build_criterion(dictionary, **common, log_term_gnorm_interval=1)(
            model, sample)[2]
