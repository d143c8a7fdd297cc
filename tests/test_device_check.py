"""The device check (tests/device_check.py): every tensor the package creates takes the data's device and dtype.

No GPU is needed: inside :func:`package_device_check`, a torch factory called by the package's own
code without ``device=`` (or a floating one without ``dtype=``) raises, naming the file and line.
Run here over every public operator (each cost, iteration mode, hard, masks, the solver's large-k,
histogram and extreme-magnitude paths; forward and backward), every attention normaliser in both
architectures, the criterion's forward and backward in every mode and selection gradient, and
sequence generation with the plugin's models. The mutation tests show that the check fails on the
line that crashed at the first CUDA step, and on a floating factory without a dtype.
"""

import importlib
import inspect
import math
import textwrap

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator

from builders import (CRITERION_MODES, build_criterion, build_model, build_stock_transformer, build_transformer,
                      make_sample)
from conftest import word_dictionary
from device_check import DeviceCheckError, package_device_check

from fairseq_softtopk.modules import beam_search, beam_selection
from fairseq_softtopk.modules.attention_normalizer import ATTENTION_NORMALIZERS
from fairseq_softtopk.ops import (COSTS, candidate_window, cap_row_grad_norm, sinkhorn_log, soft_topk,
                                  sorted_soft_topk)
from fairseq_softtopk.ops.paper_algorithm import paper_soft_topk


@pytest.fixture
def dictionary():
    return word_dictionary(13)


def _sites_in(check, filename: str) -> int:
    return sum(filename in site for site in check.sites)


@pytest.mark.parametrize("fixed", [False, True], ids=["adaptive", "fixed_iterations"])
@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("operator", [soft_topk, sorted_soft_topk])
def test_operators_forward_and_backward(rng, operator, cost, fixed):
    x = torch.randn(3, 40, generator=rng, dtype=torch.float64).requires_grad_()
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[1, :7] = True
    with_inf = x.detach().clone()
    with_inf[2, 3] = -math.inf
    weights = torch.randn(3, 40, 4, generator=rng, dtype=torch.float64)
    calls = [dict(), dict(mask=mask), dict(largest=False), dict(hard=True), dict(return_info=True)]
    with package_device_check() as check:
        for options in calls:
            out = operator(x, 4, epsilon=0.3, cost=cost, fixed_iterations=fixed, max_iter=20, **options)
            out = out[0] if isinstance(out, tuple) else out
            if out.requires_grad:
                (out * weights[..., : out.shape[-1]].reshape(out.shape) if out.dim() == 3 else
                 out * weights[..., 0]).sum().backward()
        operator(with_inf.requires_grad_(), 4, epsilon=0.3, cost=cost, fixed_iterations=fixed, max_iter=20).sum()
        operator(x.detach().t(), 2, dim=0, epsilon=0.3, cost=cost, fixed_iterations=fixed, max_iter=20)
        operator(x.detach().half(), 2, epsilon=0.3, cost=cost, fixed_iterations=fixed, max_iter=20)
    assert x.grad is not None and _sites_in(check, "ops/") > 0  # the check saw the operators' factories


@pytest.mark.parametrize("operator", [soft_topk, sorted_soft_topk])
def test_operator_paths_for_extreme_and_large_inputs(rng, operator, monkeypatch):
    """Rows rescaled at extreme magnitudes, the histogram warm start of large smooth rows, and the
    blocked Hessian of large k (forced from k = 3 on small blocks)."""
    from fairseq_softtopk.ops import semi_dual_hessian

    huge = (torch.randn(2, 30, generator=rng, dtype=torch.float64) * 1e200).requires_grad_()
    smooth = (torch.randn(2, 9000, generator=rng) * 0.05).requires_grad_()
    with package_device_check():
        operator(huge, 3, epsilon=0.1).sum().backward()
        operator(smooth, 5, epsilon=1.0, tol=1e-4).square().sum().backward()
        monkeypatch.setattr(semi_dual_hessian, "_BANDED_MIN_K", 3)
        monkeypatch.setattr(semi_dual_hessian, "_GRAM_MIN_BLOCK", 4)
        spread = torch.linspace(-3, 3, 60, dtype=torch.float64).expand(2, 60).clone().requires_grad_()
        operator(spread, 12, epsilon=0.02, tol=1e-8).square().sum().backward()
    assert huge.grad is not None and smooth.grad is not None and spread.grad is not None


def test_references_and_helpers(rng):
    x = torch.randn(2, 12, generator=rng, dtype=torch.float64).requires_grad_()
    with package_device_check():
        cost = (x.unsqueeze(-1) - torch.arange(3, dtype=x.dtype)) ** 2
        plan, _ = sinkhorn_log(cost, torch.full((2, 12), -math.log(12), dtype=x.dtype),
                               torch.log(torch.tensor([[1 / 12, 1 / 12, 10 / 12]] * 2, dtype=x.dtype)), 0.5)
        plan.sum().backward()
        for sorted_ in (False, True):
            out, _ = paper_soft_topk(x, 3, epsilon=0.1, n_iter=20, sorted=sorted_)
            out.square().sum().backward()
        cap_row_grad_norm(x, 0.1).square().sum().backward()
        candidate_window(x[:, :1].detach(), 3, 0.1, 1e-4, n_out=torch.full((2, 1), 9.0, dtype=x.dtype))


@pytest.mark.parametrize("normalizer", ATTENTION_NORMALIZERS)
def test_lstm_attention_normalizers(dictionary, rng, normalizer):
    model = build_model(dictionary, attention_normalizer=normalizer, attention_topk=2)
    sample = make_sample(dictionary, rng, [5, 3, 4])
    with package_device_check():
        out = model(**sample["net_input"])
        model.get_normalized_probs(out, log_probs=True).sum().backward()
    assert all(p.grad is not None for p in model.decoder.attention.parameters())


@pytest.mark.parametrize("normalizer", ATTENTION_NORMALIZERS)
def test_transformer_attention_normalizers_also_in_self_attention(dictionary, rng, normalizer):
    """fairseq's own transformer code creates tensors without a device: the check covers ours only."""
    model = build_transformer(dictionary, attention_normalizer=normalizer, attention_topk=2, attention_normalize_self_attention=True)
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=7)
    with package_device_check():
        out = model(**sample["net_input"])
        model.get_normalized_probs(out, log_probs=True).sum().backward()
    assert all(p.grad is not None for p in model.decoder.layers[0].encoder_attn.parameters())


@pytest.mark.parametrize("selection_grad", ["capped", "full", "none"])
@pytest.mark.parametrize("mode", sorted(CRITERION_MODES))
def test_criterion_forward_and_backward_in_every_mode(dictionary, rng, mode, selection_grad):
    if mode == "hard" and selection_grad != "capped":
        pytest.skip("hard mode has no selection gradient")
    model = build_model(dictionary, scale=3.0)
    check = _checked_training_step(model, dictionary, rng, mode, selection_grad)
    assert _sites_in(check, "modules/beam_s") > 0
    assert model.decoder.embed_tokens.weight.grad is not None


def _checked_training_step(model, dictionary, rng, mode: str, selection_grad: str):
    """The criterion's forward and backward (update 4) under the device check; returns the check."""
    model.set_num_updates(4)
    criterion = build_criterion(dictionary, topk_grad=selection_grad, **CRITERION_MODES[mode])
    sample = make_sample(dictionary, rng, [5, 3, 4])
    with package_device_check() as check:
        loss, _, _ = criterion(model, sample)
        loss.backward()
    return check


@pytest.mark.parametrize("selection_grad", ["capped", "full", "none"])
@pytest.mark.parametrize("mode", sorted(CRITERION_MODES))
@pytest.mark.parametrize("architecture", ["softtopk_transformer", "transformer"])
def test_criterion_drives_transformers_in_every_mode(dictionary, rng, architecture, mode, selection_grad):
    """The Transformer path (the decoder driven through its incremental state, caches mixed) in every mode and
    selection gradient."""
    if mode == "hard" and selection_grad != "capped":
        pytest.skip("hard mode has no selection gradient")
    if mode == "epsilon_schedule" and architecture == "transformer":
        pytest.skip("fairseq's transformer does not record its update number (the schedule names this)")
    model = (build_transformer(dictionary) if architecture == "softtopk_transformer" else
             build_stock_transformer(dictionary))
    check = _checked_training_step(model, dictionary, rng, mode, selection_grad)
    assert _sites_in(check, "modules/incremental_decoder_unroll") > 0 and _sites_in(check, "modules/beam_s") > 0
    assert model.decoder.layers[0].self_attn.k_proj.weight.grad is not None


@pytest.mark.parametrize("architecture", ["lstm", "transformer"])
def test_sequence_generation(dictionary, rng, architecture):
    model = (build_model(dictionary, scale=3.0, attention_normalizer="soft_topk", attention_topk=2)
             if architecture == "lstm" else
             build_transformer(dictionary, attention_normalizer="soft_topk", attention_topk=2, attention_normalize_self_attention=True))
    model.eval()
    sample = make_sample(dictionary, rng, [5, 3, 4], src_len=7)
    generator = SequenceGenerator([model], dictionary, beam_size=3, max_len_b=6)
    with package_device_check(), torch.no_grad():
        hypos = generator.generate([model], {"net_input": {k: v for k, v in sample["net_input"].items()
                                                           if k != "prev_output_tokens"}})
    assert len(hypos) == 3 and all(len(h) == 3 for h in hypos)


def _mutated(function, old: str, new: str):
    """``function`` recompiled from its file's source with the line ``old`` replaced by ``new``, at the
    same file and line numbers (so that the check names the package's file)."""
    source = inspect.getsource(function)
    assert old in source, f"{old!r} is not in {function.__name__}'s source"
    first_line = inspect.getsourcelines(function)[1]
    code = compile("\n" * (first_line - 1) + textwrap.dedent(source.replace(old, new)),
                   inspect.getsourcefile(function), "exec")
    namespace = dict(function.__globals__)
    exec(code, namespace)
    line = first_line + source[: source.index(old)].count("\n")
    return namespace[function.__name__], line


def test_the_check_fails_on_the_line_that_crashed_on_the_first_cuda_step(dictionary, rng, monkeypatch):
    """The line of ``near_ties`` that made every soft_beam_search run fail at its first CUDA step (a CPU
    tensor of the epsilon, compared with the scores' gaps), put back: the check names its file and line."""
    mutant, line = _mutated(beam_selection.near_ties, "return (gaps < eps).any(-1)",
                            "return (gaps < torch.as_tensor(eps, dtype=gaps.dtype).reshape(-1, 1)).any(-1)")
    monkeypatch.setattr(beam_search, "near_ties", mutant)
    model = build_model(dictionary, scale=3.0)
    sample = make_sample(dictionary, rng, [5, 3])
    with pytest.raises(DeviceCheckError, match=rf"fairseq_softtopk/modules/beam_selection\.py:{line}: "
                                               r"torch\.as_tensor\(\.\.\.\) creates a tensor without device="):
        with package_device_check():
            build_criterion(dictionary)(model, sample)
    build_criterion(dictionary)(model, sample)  # without the check the mutant runs: only the check sees it


def test_the_check_fails_on_a_floating_factory_without_a_dtype(rng, monkeypatch):
    """A tensor of torch's default dtype (here the anchors of the operator's backward pass, made by
    ``torch.arange`` with a device but no dtype) would be float32 under float64 data: the check names
    it, in the backward pass too."""
    sorted_module = importlib.import_module("fairseq_softtopk.ops.sorted_soft_topk")  # the package exports the function

    mutant, line = _mutated(sorted_module.SortedSoftTopKFunction._vjp,
                            "y = anchors(k, P)[:k].expand(P.size(0), 1, k)",
                            "y = torch.arange(k, 0, -1.0, device=P.device).expand(P.size(0), 1, k)")
    monkeypatch.setattr(sorted_module.SortedSoftTopKFunction, "_vjp", staticmethod(mutant))
    x = torch.randn(2, 20, generator=rng, dtype=torch.float64).requires_grad_()
    with package_device_check():
        out = sorted_soft_topk(x, 3, epsilon=0.3)
        with pytest.raises(DeviceCheckError, match=rf"fairseq_softtopk/ops/sorted_soft_topk\.py:{line}: "
                                                   r"torch\.arange\(\.\.\.\) creates a torch\.float32 tensor without "
                                                   r"dtype="):
            out.square().sum().backward()
