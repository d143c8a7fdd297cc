"""Tests of :mod:`fairseq_softtopk.modules.attention_normalizer`."""

import math

import pytest
import torch
import torch.nn.functional as F

from fairseq_softtopk.modules import attention_normalizer as an
from fairseq_softtopk.modules.attention_normalizer import (ATTENTION_NORMALIZERS, AttentionNormalizer,
                                                           normalize_attention)

K = 2


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def _scores(rng, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=rng, dtype=torch.float64).mul(2.0).to(dtype)


def _padding(rng, batch, src_len, min_valid=1):
    """``(batch, 1, src_len)`` bool, True = pad, right-padded to random lengths >= ``min_valid``."""
    lengths = torch.randint(min_valid, src_len + 1, (batch,), generator=rng)
    lengths[0] = src_len  # one unpadded row
    lengths[-1] = min_valid  # one row with only min_valid positions (<= K: top-k falls back)
    return (torch.arange(src_len) >= lengths[:, None]).unsqueeze(1)


def test_all_exports_exist():
    assert sorted(an.__all__) == sorted(set(an.__all__))
    for name in an.__all__:
        assert hasattr(an, name), name


@pytest.mark.parametrize("normalizer", ATTENTION_NORMALIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weights_sum_to_one_and_are_zero_on_padding(rng, normalizer, dtype):
    scores = _scores(rng, 5, 4, 9, dtype=dtype)  # batch x tgt_len x src_len
    pad = _padding(rng, 5, 9)
    weights = normalize_attention(scores, pad, normalizer=normalizer, k=K, epsilon=0.1)
    assert weights.dtype == dtype and weights.shape == scores.shape
    assert torch.all(weights >= 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, 4, dtype=dtype))
    assert torch.all(weights.masked_select(pad.expand_as(weights)) == 0)


@pytest.mark.parametrize("normalizer", ATTENTION_NORMALIZERS)
def test_padding_gives_the_same_weights_as_truncation(rng, normalizer):
    scores = _scores(rng, 3, 7)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[:, 5:] = True
    padded = normalize_attention(scores, pad, normalizer=normalizer, k=K, epsilon=0.3)
    truncated = normalize_attention(scores[:, :5], normalizer=normalizer, k=K, epsilon=0.3)
    torch.testing.assert_close(padded[:, :5], truncated)


@pytest.mark.parametrize("normalizer", ATTENTION_NORMALIZERS)
def test_minus_inf_scores_count_as_padding(rng, normalizer):
    scores = _scores(rng, 4, 6)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[:, ::3] = True
    with_mask = normalize_attention(scores, pad, normalizer=normalizer, k=K)
    with_inf = normalize_attention(scores.masked_fill(pad, -math.inf), normalizer=normalizer, k=K)
    torch.testing.assert_close(with_inf, with_mask)


@pytest.mark.parametrize("normalizer", ["soft_topk", "hard_topk", "sparse_topk"])
@pytest.mark.parametrize("k", [6, 7, 50])
def test_topk_with_k_at_least_length_is_softmax(rng, normalizer, k):
    scores = _scores(rng, 3, 4, 6)
    torch.testing.assert_close(normalize_attention(scores, normalizer=normalizer, k=k), F.softmax(scores, -1))


@pytest.mark.parametrize("normalizer", ["soft_topk", "hard_topk", "sparse_topk"])
def test_topk_falls_back_to_softmax_per_row(rng, normalizer):
    # scores 0, 0.25, ..., 1.75 in random order: no near-ties, flat enough for softmax to spread
    scores = torch.stack([torch.randperm(8, generator=rng) for _ in range(6)]).double() * 0.25
    lengths = torch.tensor([8, 2, 5, 1, 3, 2])  # rows 1, 3, 5 have <= K positions
    pad = torch.arange(8) >= lengths[:, None]
    batched = normalize_attention(scores, pad, normalizer=normalizer, k=K, epsilon=0.02)
    softmax = F.softmax(scores.masked_fill(pad, -math.inf), -1)
    for row in range(6):
        alone = normalize_attention(scores[row, :lengths[row]], normalizer=normalizer, k=K, epsilon=0.02)
        torch.testing.assert_close(batched[row, :lengths[row]], alone)
        outside = torch.ones(8, dtype=torch.bool)
        outside[scores[row].masked_fill(pad[row], -math.inf).topk(min(K, 8)).indices] = False
        outside &= ~pad[row]
        if lengths[row] <= K:
            torch.testing.assert_close(batched[row], softmax[row])
        else:  # a real selection: the mass outside the top-k nearly vanishes, unlike softmax's
            assert batched[row][outside].sum() < 0.01 and softmax[row][outside].sum() > 0.1


def test_soft_topk_tends_to_hard_topk_as_epsilon_vanishes(rng):
    n = 10
    # scores 0, 0.5, ..., 4.5 in random order: a gap of 0.5 between the k-th and (k+1)-th
    scores = torch.stack([torch.randperm(n, generator=rng) for _ in range(6)]).double() * 0.5
    hard = normalize_attention(scores, normalizer="hard_topk", k=3)
    outside = hard == 0
    masses = []
    for epsilon in (1.0, 0.1, 0.03, 0.01, 0.001):
        soft = normalize_attention(scores, normalizer="soft_topk", k=3, epsilon=epsilon, tol=1e-10)
        masses.append(soft.masked_select(outside).view(6, -1).sum(-1).max().item())
    assert masses[0] > 0.05  # at epsilon = 1 the rest still gets visible mass
    assert all(later < earlier for earlier, later in zip(masses, masses[1:]))
    assert masses[-1] < 1e-12
    torch.testing.assert_close(soft, hard, atol=1e-9, rtol=0)


def test_sparse_topk_is_softmax_plus_log_of_the_sparse_indicator_with_exact_zeros(rng):
    """sparse_topk = softmax(s + log A), A = sparse_soft_topk(s, k, regularization=epsilon) computed
    directly; positions with A = 0 get weight exactly 0 (and no gradient), the others keep a weight."""
    from fairseq_softtopk.ops import sparse_soft_topk

    scores = _scores(rng, 5, 3, 12).requires_grad_()
    pad = _padding(rng, 5, 12, min_valid=K + 1)  # (5, 1, 12): every row has more than K positions
    weights = normalize_attention(scores, pad, normalizer="sparse_topk", k=K, epsilon=0.5)
    pad = pad.expand(5, 3, 12)
    a = sparse_soft_topk(scores.detach(), K, regularization=0.5, mask=pad)
    expected = F.softmax(scores.detach() + torch.log(a), -1)
    torch.testing.assert_close(weights.detach(), expected)
    assert bool((weights[a == 0] == 0).all()) and bool((weights[a > 0] > 0).all())
    assert int((a == 0).sum()) > int(pad.sum())  # exact zeros beyond the padding
    weights.square().sum().backward()
    assert bool((scores.grad[a == 0] == 0).all())


def test_sparse_topk_equals_hard_topk_below_the_smallest_gap(rng):
    scores = torch.stack([torch.randperm(10, generator=rng) for _ in range(6)]).double() * 0.5
    hard = normalize_attention(scores, normalizer="hard_topk", k=3)
    torch.testing.assert_close(normalize_attention(scores, normalizer="sparse_topk", k=3, epsilon=0.1), hard,
                               atol=0, rtol=0)


def test_hard_topk_with_k1_is_one_hot_argmax(rng):
    scores = _scores(rng, 4, 3, 7)
    pad = _padding(rng, 4, 7, min_valid=2)
    weights = normalize_attention(scores, pad, normalizer="hard_topk", k=1)
    expected = F.one_hot(scores.masked_fill(pad, -math.inf).argmax(-1), 7).double()
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize("normalizer", ATTENTION_NORMALIZERS)
def test_gradients_reach_scores_and_not_padding(rng, normalizer):
    scores = _scores(rng, 4, 8).requires_grad_()
    pad = torch.zeros(4, 8, dtype=torch.bool)
    pad[:, 6:] = True
    weights = normalize_attention(scores, pad, normalizer=normalizer, k=3, epsilon=0.5)
    (weights * _scores(rng, 4, 8)).sum().backward()
    grad = scores.grad
    assert torch.isfinite(grad).all()
    assert torch.all(grad[:, 6:] == 0)
    # a row whose weights are one-hot may have zero gradient (sparsemax is locally constant)
    spread = (weights > 0).sum(-1) > 1
    assert spread.sum() >= 2
    assert grad[spread, :6].abs().sum(-1).min() > 1e-6


def test_soft_topk_gradcheck(rng):
    scores = _scores(rng, 3, 6).requires_grad_()
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, 4:] = True  # 4 positions, still > k
    pad[2, 2:] = True  # 2 positions: softmax fallback

    def fn(x):
        return normalize_attention(x, pad, normalizer="soft_topk", k=3, epsilon=0.5, tol=1e-12, max_iter=200)

    assert torch.autograd.gradcheck(fn, (scores,), eps=1e-6, atol=1e-6)


def test_soft_topk_gradient_goes_through_the_indicator(rng):
    """The gradient is not that of softmax(s + log A) with A held fixed."""
    scores = _scores(rng, 3, 6).requires_grad_()
    probe = _scores(rng, 3, 6)
    full = torch.autograd.grad((normalize_attention(scores, normalizer="soft_topk", k=2, epsilon=0.5) * probe).sum(),
                               scores)[0]
    log_a = an._safe_log(an.soft_topk(scores.detach(), 2, epsilon=0.5))
    fixed = torch.autograd.grad((F.softmax(scores + log_a, -1) * probe).sum(), scores)[0]
    assert (full - fixed).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_safe_log_of_zero_and_subnormal_is_minus_inf_with_zero_gradient(dtype):
    tiny = torch.finfo(dtype).tiny
    a = torch.tensor([0.0, tiny / 4, tiny, 0.5], dtype=dtype, requires_grad=True)
    log_a = an._safe_log(a)
    assert log_a[:2].eq(-math.inf).all() and torch.isfinite(log_a[2:]).all()
    # the softmax backward sends 0 to -inf logits; 0 / a would be NaN at a = 0
    F.softmax(log_a, -1).mul(torch.arange(4.0, dtype=dtype)).sum().backward()
    assert torch.isfinite(a.grad).all() and a.grad[:2].eq(0).all()


def test_soft_topk_far_entries_stay_finite():
    # A of the far entries is ~1e-38 in float32 (at or near underflow): no NaN, exactly-0 weights
    scores = torch.tensor([[30.0, 29.0, -30.0, -31.0, 0.0]], requires_grad=True)
    weights = normalize_attention(scores, normalizer="soft_topk", k=2, epsilon=0.05)
    assert weights[0, 2:].eq(0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
    (weights * torch.arange(5.0)).sum().backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("normalizer", ATTENTION_NORMALIZERS)
def test_row_without_positions_gets_zeros_not_nan(normalizer):
    scores = torch.randn(2, 5, requires_grad=True)
    pad = torch.tensor([[False] * 5, [True] * 5])
    weights = normalize_attention(scores, pad, normalizer=normalizer, k=K)
    assert torch.all(weights[1] == 0) and torch.isfinite(weights).all()
    weights.sum().backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32_and_cast_back(rng, dtype):
    scores = _scores(rng, 3, 7)
    weights = normalize_attention(scores.to(dtype), normalizer="soft_topk", k=K, epsilon=0.2)
    assert weights.dtype == dtype
    reference = normalize_attention(scores.to(dtype).float(), normalizer="soft_topk", k=K, epsilon=0.2)
    torch.testing.assert_close(weights.float(), reference, atol=1e-2, rtol=1e-2)


def test_module_matches_function_and_shows_its_options(rng):
    scores = _scores(rng, 2, 3, 6)
    pad = _padding(rng, 2, 6)
    module = AttentionNormalizer("soft_topk", k=K, epsilon=0.3)
    expected = normalize_attention(scores, pad, normalizer="soft_topk", k=K, epsilon=0.3)
    torch.testing.assert_close(module(scores, pad), expected)
    assert "k=2" in repr(module) and "epsilon=0.3" in repr(module)
    assert list(module.parameters()) == [] and module.state_dict() == {}


@pytest.mark.parametrize("kwargs, message", [
    (dict(normalizer="topk"), "unknown attention normalizer"),
    (dict(normalizer="soft_topk"), "needs an integer k"),
    (dict(normalizer="hard_topk", k=0), "needs an integer k"),
    (dict(normalizer="soft_topk", k=2, epsilon=0.0), "epsilon"),
    (dict(normalizer="sparse_topk", k=2, epsilon=0.0), "the sparse_topk attention normalizer needs a finite epsilon"),
    (dict(normalizer="soft_topk", k=2, epsilon=True), "needs a finite epsilon > 0, got True"),
    (dict(normalizer="hard_topk", k=True), "needs an integer k >= 1, got k=True"),
])
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        normalize_attention(torch.zeros(2, 4), **kwargs)
    name = kwargs.pop("normalizer")
    with pytest.raises(ValueError, match=message):
        AttentionNormalizer(name, **kwargs)


@pytest.mark.parametrize("kwargs, message", [(dict(tol=0.0), "finite tol > 0"), (dict(tol="1e-5"), "finite tol > 0"),
                                             (dict(max_iter=0), "integer max_iter >= 1")])
@pytest.mark.parametrize("name", ["soft_topk", "sparse_topk"])
def test_bad_solver_options_are_refused_when_the_module_is_built(name, kwargs, message):
    """Not at the first row longer than k (a short input would never report them)."""
    with pytest.raises(ValueError, match=f"the {name} attention normalizer needs an? {message}"):
        AttentionNormalizer(name, k=2, **kwargs)
    AttentionNormalizer("hard_topk", k=2, **kwargs)  # no solver: the options are not used


def test_numpy_options_give_the_python_numbers_weights():
    """k, epsilon and tol from a numpy sweep are the Python numbers they equal (the operators convert them)."""
    import numpy as np

    scores = torch.tensor([[1.5, 1.3, -0.75, 1.2, 1.0, -1.125, 0.825, 0.5]])
    for name in ("soft_topk", "sparse_topk"):
        module = AttentionNormalizer(name, k=np.int64(3), epsilon=np.float32(0.25), tol=np.float64(1e-6))
        expected = AttentionNormalizer(name, k=3, epsilon=0.25, tol=1e-6)(scores)
        torch.testing.assert_close(module(scores), expected, rtol=0, atol=0)
        assert [type(v) for v in (module.k, module.epsilon, module.tol)] == [int, float, float]
        assert "k=3" in repr(module) and "epsilon=0.25" in repr(module)


def test_bad_masks_raise_value_error():
    with pytest.raises(ValueError, match="bool"):
        normalize_attention(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not broadcast"):
        normalize_attention(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.bool))


def test_softmax_ignores_k_and_epsilon(rng):
    scores = _scores(rng, 3, 5)
    torch.testing.assert_close(normalize_attention(scores, normalizer="softmax", k=None, epsilon=-1.0),
                               F.softmax(scores, -1))


@pytest.mark.parametrize("name", ["softmax", "soft_topk", "hard_topk", "sparse_topk", "sparsemax", "entmax15"])
def test_repr_with_a_fairseq_choice_member_as_name(name):
    """fairseq passes ChoiceEnum members; the module's repr (fairseq logs the model) must be text."""
    from fairseq.dataclass import ChoiceEnum

    from fairseq_softtopk.modules.attention_normalizer import ATTENTION_NORMALIZERS, AttentionNormalizer

    member = ChoiceEnum(list(ATTENTION_NORMALIZERS))(name)
    k = 3 if "topk" in name else None
    module = AttentionNormalizer(member, k=k)
    assert type(module.name) is str and module.name == name
    assert repr(module).startswith(f"AttentionNormalizer({name}")
