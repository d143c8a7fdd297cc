"""The operators' ``backend`` as an option: ``--topk-backend`` (the criterion's search) and
``--attention-topk-backend`` (the models' top-k attention) reach every operator call.

Each operator is replaced, in the module that calls it, by a wrapper that records the ``backend`` it was
given and runs the real operator on the torch path (``"triton"`` cannot run on CPU tensors here).
"""

import pytest
import torch

from builders import build_criterion, build_model, make_sample
from conftest import word_dictionary

from fairseq_softtopk.modules import attention_normalizer, beam_selection
from fairseq_softtopk.modules.attention_normalizer import AttentionNormalizer, normalize_attention
from fairseq_softtopk.modules.beam_search_config import BeamSearchConfig
from fairseq_softtopk.option_checks import check_backend_option

#: the operators the beam search calls, and those of the top-k attention
SEARCH_OPERATORS = ("sorted_soft_topk", "sorted_soft_topk_window", "sorted_sparse_soft_topk",
                    "sorted_sparse_soft_topk_window")
ATTENTION_OPERATORS = ("soft_topk", "sparse_soft_topk")


def record_backends(monkeypatch, module, names):
    """Replaces the operators ``names`` of ``module`` by recording wrappers: returns the list of
    ``(operator, backend)`` of every call (``None``: no backend argument)."""
    calls = []
    for name in names:
        real = getattr(module, name)

        def wrapper(*args, _name=name, _real=real, **kwargs):
            calls.append((_name, kwargs.get("backend")))
            return _real(*args, **{**kwargs, "backend": "torch"})

        monkeypatch.setattr(module, name, wrapper)
    return calls


#: the criterion's search modes, as its options: (options, the operator the search calls)
SEARCH_MODES = {
    "entropic": ({}, "sorted_soft_topk_window"),
    "entropic_adaptive": ({"topk_window_width": 0}, "sorted_soft_topk"),
    "entropic_pool": ({"topk_candidate_pool": 12}, "sorted_soft_topk"),
    "fixed_iterations": ({"topk_fixed_iterations": True, "topk_max_iter": 8}, "sorted_soft_topk"),
    "sparse": ({"topk_regularizer": "quadratic"}, "sorted_sparse_soft_topk_window"),
    "sparse_fixed_iterations": ({"topk_regularizer": "quadratic", "topk_fixed_iterations": True, "topk_max_iter": 8},
                                "sorted_sparse_soft_topk"),
}


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_the_criterion_passes_its_backend_to_every_solve_of_the_search(monkeypatch, rng, mode):
    options, operator = SEARCH_MODES[mode]
    dictionary = word_dictionary(10)
    calls = record_backends(monkeypatch, beam_selection, SEARCH_OPERATORS)
    criterion = build_criterion(dictionary, topk_backend="torch", **options)
    assert criterion.search.backend == "torch"
    loss, _, _ = criterion(build_model(dictionary), make_sample(dictionary, rng, [4, 3]))
    loss.backward()
    assert calls and set(calls) == {(operator, "torch")}  # one solve per decoding step, each told the backend


@pytest.mark.parametrize("fixed_iterations, window_width", [(False, -1), (False, 0), (True, -1)])
@pytest.mark.parametrize("regularizer", ["entropic", "quadratic"])
def test_select_beams_passes_the_configured_backend(monkeypatch, regularizer, fixed_iterations, window_width):
    """``triton`` too (the config does not look at devices: the operator decides, here on the torch path); ``auto``
    reaches the operator as it is in every search (the adaptive one included: on an H100 the kernels made its
    update faster than the torch path once their compiles were out of the timed updates)."""
    calls = record_backends(monkeypatch, beam_selection, SEARCH_OPERATORS)
    scores = torch.randn(2, 30, dtype=torch.float64)
    for backend in ("triton", "auto", "torch"):
        config = BeamSearchConfig(beam=3, regularizer=regularizer, fixed_iterations=fixed_iterations, max_iter=10,
                                  backend=backend, window_width=window_width)
        beam_selection.select_beams(scores, 3, config, scores.topk(4).values[:, -1:])
    assert [backend for _, backend in calls] == ["triton", "auto", "torch"]


def test_the_fixed_solve_passes_its_backend(monkeypatch):
    calls = record_backends(monkeypatch, beam_selection, ["sorted_soft_topk"])
    scores = torch.randn(2, 20, dtype=torch.float64)
    A, _ = beam_selection.fixed_solve(scores, 3, 0.1, "linear", 1e-6, 10, "triton")
    beam_selection.fixed_solve(scores, 3, 0.1, "linear", 1e-6, 10)
    assert A.shape == (2, 20, 3) and calls == [("sorted_soft_topk", "triton"), ("sorted_soft_topk", "auto")]


def test_a_bad_backend_of_the_search_is_refused():
    with pytest.raises(ValueError, match=r"^backend must be one of \('torch', 'triton', 'auto'\), got 'cuda'$"):
        BeamSearchConfig(backend="cuda")


@pytest.mark.parametrize("name, operator", [("soft_topk", "soft_topk"), ("sparse_topk", "sparse_soft_topk")])
def test_the_attention_normalizer_passes_its_backend(monkeypatch, name, operator):
    calls = record_backends(monkeypatch, attention_normalizer, ATTENTION_OPERATORS)
    scores = torch.randn(2, 3, 7)
    mask = torch.zeros(2, 1, 7, dtype=torch.bool)
    mask[1, :, 5:] = True
    weights = AttentionNormalizer(name, k=2, epsilon=0.5, backend="triton")(scores, mask)
    normalize_attention(scores, mask, normalizer=name, k=2, epsilon=0.5)  # the default
    assert calls == [(operator, "triton"), (operator, "auto")]
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3)) and (weights[1, :, 5:] == 0).all()
    assert repr(AttentionNormalizer(name, k=2, epsilon=0.5, backend="torch")).endswith("backend=torch)")
    assert repr(AttentionNormalizer(name, k=2, epsilon=0.5)) == f"AttentionNormalizer({name}, k=2, epsilon=0.5)"


def test_the_lstm_attention_passes_the_models_backend(monkeypatch, rng):
    dictionary = word_dictionary(10)
    calls = record_backends(monkeypatch, attention_normalizer, ATTENTION_OPERATORS)
    model = build_model(dictionary, attention_normalizer="sparse_topk", attention_topk=2,
                        attention_topk_backend="torch")
    sample = make_sample(dictionary, rng, [4, 3])
    model(**sample["net_input"])[0].sum().backward()
    assert calls and set(calls) == {("sparse_soft_topk", "torch")}


def test_a_bad_backend_of_the_attention_is_refused():
    with pytest.raises(ValueError, match=r"backend must be one of \('torch', 'triton', 'auto'\), got 'gpu'"):
        AttentionNormalizer("soft_topk", k=2, backend="gpu")


def test_the_triton_backend_is_refused_without_cuda_or_the_interpreter(monkeypatch):
    from fairseq_softtopk.ops.kernels import backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as error:
        check_backend_option("topk_backend", "triton", cpu=False)
    assert str(error.value) == ("--topk-backend triton runs the Triton kernels on a GPU (or under TRITON_INTERPRET=1, "
                                "for tests), but torch finds no CUDA device; use --topk-backend auto or torch, got "
                                "'triton'")
    for value in ("auto", "torch"):
        check_backend_option("topk_backend", value, cpu=True)  # run anywhere
    with pytest.raises(ValueError, match=r"^--attention-topk-backend must be one of \['auto', 'torch', 'triton'\], "
                                         r"got 'cuda'$"):
        check_backend_option("attention_topk_backend", "cuda", cpu=False)
    # under the interpreter the kernels run on CPU tensors: refused only where triton does not import
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "triton_import_error", lambda: "")
    check_backend_option("topk_backend", "triton", cpu=True)
    monkeypatch.setattr(backend, "triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(ValueError, match=r"^--attention-topk-backend triton needs the triton package \(pip install "
                                         r"triton\), which does not import here \(ModuleNotFoundError"):
        check_backend_option("attention_topk_backend", "triton", cpu=True)


def test_the_auto_backend_is_decided_inside_a_compiled_region_before_triton_was_tried(monkeypatch):
    """The first operator call of a process may be compiled (``--topk-compile``): deciding "auto" there tries
    ``import triton``, which torch.compile cannot trace; it is a constant to the compiler instead."""
    from fairseq_softtopk.ops.kernels import backend

    monkeypatch.setattr(backend, "_triton_import_error", None)  # not tried yet in this process

    def step(x):
        return x + 1 if backend.triton_available() else x - 1

    expected = step(torch.zeros(2))
    monkeypatch.setattr(backend, "_triton_import_error", None)
    torch.testing.assert_close(torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(2)), expected)
