"""The options of the criterion ``soft_beam_search`` and their checks.

:class:`SoftBeamSearchConfig` declares them (fairseq generates the flags from it);
:func:`check_soft_beam_search_options` checks their values, when the criterion is built and, on
the parsed flags of every stage and arm, in the ablation runner before anything trains. Each
error names the flag as typed, the value and the allowed range.
"""

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from omegaconf import II

from ..option_error import OptionError
from ..option_checks import (BACKEND_CHOICES, check_backend_option, check_bf16, check_choice, check_epsilon,
                             check_number, requested_batch_size, requested_bf16, requested_cpu)
from ..renamed_options import alias_metadata, flag, use_renamed

#: the choices of --topk-grad
TOPK_GRAD_CHOICES = ["capped", "full", "none"]

#: the choices of --beam-loss
BEAM_LOSS_CHOICES = ["gold", "risk"]
#: the choices of --beam-risk-cost (sequence_risk.RISK_COSTS)
RISK_COST_CHOICES = ["bleu", "bleu_points", "minmax"]
#: the choices of --topk-regularizer
TOPK_REGULARIZERS = ["entropic", "quadratic"]
#: the choices of --topk-mode, --topk-cost and --topk-compile
TOPK_MODES = ["soft", "hard"]
TOPK_COSTS = ["linear", "sqeuclidean", "paper"]
TOPK_COMPILE_MODES = ["none", "default", "reduce-overhead", "max-autotune"]


def _advanced(help_text: str) -> dict:
    """Metadata of an option for experiments and tuning, listed apart (README, fairseq-softtopk-options)."""
    return {"help": help_text, "advanced": True}


@dataclass
class SoftBeamSearchConfig(FairseqDataclass):
    """The criterion's options. Every option of the selection starts with ``--topk-``; what the
    numbers mean in practice (and their measurements) is in docs/beam_search_training.md."""

    train_beam: int = field(default=5, metadata={"help": "beam size k of the search unrolled in training"})
    teacher_forcing_ratio: float = field(default=0.8, metadata={
        "help": "the weight p of the teacher-forcing loss, loss = p * L_tf + (1 - p) * L_beam (the paper's name; "
                "not scheduled sampling); 1.0 = teacher forcing only"})
    topk_mode: ChoiceEnum(TOPK_MODES) = field(default="soft", metadata={
        "help": "soft: the sorted SOFT top-k (differentiable); hard: the exact top-k (the ablation)"})
    topk_epsilon: float = field(default=0.03, metadata={
        "help": "regularisation of the soft top-k (in nats of log-likelihood with --topk-cost linear): the "
                "entropic epsilon, or the quadratic lambda with --topk-regularizer quadratic"})
    topk_regularizer: ChoiceEnum(TOPK_REGULARIZERS) = field(default="entropic", metadata={
        "help": "entropic: the sorted SOFT top-k of the paper (every candidate keeps a weight); quadratic: the "
                "sorted sparse soft top-k (exact zeros: the beams mix only the candidates of its support)"})
    topk_grad: ChoiceEnum(TOPK_GRAD_CHOICES) = field(default="capped", metadata={
        "help": "gradient through the selection: capped (the exact one, capped per sentence and step), "
                "full (the paper's) or none"})
    label_smoothing: float = field(default=0.0, metadata={"help": "label smoothing of both loss terms"})
    beam_loss: ChoiceEnum(BEAM_LOSS_CHOICES) = field(default="gold", metadata={
        "help": "the beam term: gold (the paper's: gold-token NLL along the best beam) or risk (expected "
                "1 - sentence BLEU+1 of the final beams under a softmax of their scores)"})
    beam_loss_temperature: float = field(default=1.0, metadata=_advanced(
        "with --beam-loss risk: the temperature of the softmax over the final beams' scores"))
    beam_risk_cost: ChoiceEnum(RISK_COST_CHOICES) = field(default="bleu", metadata={
        "help": "with --beam-loss risk: the unit of the cost: bleu (1 - BLEU+1, in [0, 1]), bleu_points (100 x that, "
                "Edunov et al. 2018's unit) or minmax (scaled per sentence over its hypotheses: best 0, worst 1)"})
    beam_lenpen: float = field(default=1.0, metadata={
        "help": "with --beam-loss risk: the training search's length penalty, as fairseq-generate's --lenpen"})
    beam_max_len_a: float = field(default=1.2, metadata=_advanced(
        "with --beam-loss risk: the training search ends at a * source length + b tokens (fairseq-generate's "
        "--max-len-a)"))
    beam_max_len_b: int = field(default=10, metadata=_advanced(
        "with --beam-loss risk: b of --beam-max-len-a (fairseq-generate's --max-len-b)"))
    log_term_gnorm_interval: int = field(default=0, metadata=_advanced(
        "every N-th training batch, log the gradient norms of the two weighted loss terms apart (tf_gnorm, "
        "beam_gnorm; divided by the sample size, as fairseq's gnorm): two more backward passes on that batch; "
        "0 = never"))
    topk_cost: ChoiceEnum(TOPK_COSTS) = field(default="linear", metadata=_advanced(
        "cost of the transport problem: linear (epsilon in score units), sqeuclidean or paper (the paper's "
        "normalised cost)"))
    topk_tol: float = field(default=1e-4, metadata=_advanced("marginal tolerance of the solver"))
    topk_max_iter: int = field(default=50, metadata=_advanced(
        "Newton iterations at most per solve (exactly this many with --topk-fixed-iterations)"))
    topk_candidate_pool: int = field(default=0, metadata=_advanced(
        "solve on the m best of the k*V candidates only; 0 = all"))
    topk_window_width: int = field(default=-1, metadata=_advanced(
        "the soft selection's static window of each row's best candidates (no host synchronisation a step; a row "
        "its certificate does not cover makes the batch search again adaptively): -1 = its default for the "
        "candidates and epsilon, W >= --train-beam = W, 0 = the adaptive window (host reads every step)"))
    topk_fixed_iterations: bool = field(default=False, metadata=_advanced(
        "every solve on all candidates for exactly --topk-max-iter iterations, no host synchronisation"))
    topk_compile: ChoiceEnum(TOPK_COMPILE_MODES) = field(
        default="none", metadata=_advanced("with --topk-fixed-iterations: each solve under torch.compile in this "
                                           "mode; none = eager"))
    topk_grad_cap: float = field(default=0.3, metadata=_advanced(
        "with --topk-grad capped: the cap per sentence and step, in gold-token gradients of the beam term "
        "(follows fp16/amp loss scaling)"))
    topk_epsilon_start: float = field(default=0.0, metadata=_advanced(
        "an epsilon schedule: start here, anneal geometrically to --topk-epsilon; 0 = no schedule"))
    topk_epsilon_anneal_updates: int = field(default=0, metadata=_advanced(
        "the schedule's length in updates (constant --topk-epsilon after)"))
    topk_epsilon_relative: float = field(default=0.0, metadata=_advanced(
        "per step, epsilon at least this times the mean gap of the k+1 best scores (--topk-cost linear); 0 = off"))
    topk_backend: ChoiceEnum(BACKEND_CHOICES) = field(default="auto", metadata=_advanced(
        "the soft top-k's implementation: auto (the fused Triton kernels on a GPU where triton is installed and an "
        "operator has them, the torch code otherwise), torch, or triton (the kernels; needs a GPU)"))
    # deprecated aliases (renamed_options): None = not given
    candidate_pool: Optional[int] = field(default=None, metadata=alias_metadata("candidate_pool"))
    selection_grad: Optional[str] = field(default=None, metadata=alias_metadata("selection_grad"))
    selection_grad_cap: Optional[float] = field(default=None, metadata=alias_metadata("selection_grad_cap"))
    sentence_avg: bool = II("optimization.sentence_avg")
    bf16: bool = II("common.bf16")  # refused without torch_xla (option_checks.check_bf16)
    cpu: bool = II("common.cpu")  # --topk-backend triton is refused with --cpu (option_checks.check_backend_option)
    batch_size: Optional[int] = II("dataset.batch_size")  # the beams' memory is bounded per batch (_check_memory)


#: the criterion's option names (the fields of SoftBeamSearchConfig)
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(SoftBeamSearchConfig))


def resolve_renamed(options) -> SimpleNamespace:
    """The options of ``options`` (the criterion's keyword arguments, a parsed namespace or a config) under
    their current names: a deprecated alias given (not None) replaces its new name, with a FutureWarning
    (:mod:`~fairseq_softtopk.renamed_options`); fields it lacks get their defaults.

    Raises:
        ValueError: an old and a new name that disagree, or an old value outside the choices.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(SoftBeamSearchConfig)}
    values = {name: getattr(options, name, defaults[name]) for name in OPTION_NAMES
              if name not in ("bf16", "cpu", "batch_size")}
    values["bf16"], values["cpu"] = requested_bf16(options), requested_cpu(options)
    values["batch_size"] = requested_batch_size(options)
    given_as = {}  # new name -> the deprecated one it was given as (named in the errors)
    for old, new, choices in (("candidate_pool", "topk_candidate_pool", None),
                              ("selection_grad", "topk_grad", TOPK_GRAD_CHOICES),
                              ("selection_grad_cap", "topk_grad_cap", None)):
        old_value = values.pop(old)
        values[new] = use_renamed(old, old_value, values[new], defaults[new], choices)
        if old_value is not None:
            given_as[new] = old
    return SimpleNamespace(**values, given_as=given_as)


def first_step_candidates(vocab_size: int, beam_loss: str) -> int:
    """How many candidates the first decoding step has: it extends one beam (the others would repeat it),
    with every type of the target dictionary but padding (which the Transformers' decoders and fairseq's
    generator never take), and in the search of ``--beam-loss risk`` but EOS too (no empty hypothesis)."""
    return vocab_size - (2 if str(beam_loss) == "risk" else 1)


def check_soft_beam_search_options(options: SimpleNamespace, vocab_size: Optional[int] = None) -> None:
    """Raises ``ValueError`` naming the first bad option of ``options`` (as :func:`resolve_renamed` returns
    them): a value outside its range or choices, or options that do not go together.

    Args:
        vocab_size: the target dictionary's size, where known: ``--train-beam`` must fit in the first step's
            candidates (:func:`first_step_candidates`).
    """
    try:
        _check_options(options, vocab_size)
    except ValueError as error:  # a value given under a deprecated name: say so
        old = next((old for new, old in getattr(options, "given_as", {}).items()
                    if str(error).startswith(flag(new) + " ")), None)
        if old is None:
            raise
        raise OptionError(f"{error} (given as {flag(old)}, its deprecated name)") from None


def _check_options(o: SimpleNamespace, vocab_size: Optional[int]) -> None:
    check_bf16(o.bf16)
    check_backend_option("topk_backend", o.topk_backend, o.cpu)
    for name, choices in (("topk_mode", TOPK_MODES), ("topk_cost", TOPK_COSTS), ("topk_grad", TOPK_GRAD_CHOICES),
                          ("topk_compile", TOPK_COMPILE_MODES), ("topk_regularizer", TOPK_REGULARIZERS),
                          ("beam_loss", BEAM_LOSS_CHOICES), ("beam_risk_cost", RISK_COST_CHOICES)):
        check_choice(name, getattr(o, name), choices)
    _check_beam(o, vocab_size)
    check_number("teacher_forcing_ratio", o.teacher_forcing_ratio, 0.0, 1.0)
    check_number("label_smoothing", o.label_smoothing, 0.0, 1.0, high_open=True)
    check_number("beam_loss_temperature", o.beam_loss_temperature, 0.0, low_open=True)
    check_number("beam_lenpen", o.beam_lenpen)
    check_number("log_term_gnorm_interval", o.log_term_gnorm_interval, 0, integer=True, why="0 = never")
    check_max_len(o.beam_max_len_a, o.beam_max_len_b)
    check_epsilon("topk_epsilon", o.topk_epsilon)
    check_number("topk_tol", o.topk_tol, 0.0, 1.0, low_open=True, high_open=True,
                 why="the solver's relative marginal error")
    check_number("topk_max_iter", o.topk_max_iter, 1, integer=True)
    check_number("topk_grad_cap", o.topk_grad_cap, 0.0, low_open=True, why="for no cap, use --topk-grad full")
    check_epsilon("topk_epsilon_start", o.topk_epsilon_start, allow_zero="no schedule")
    check_number("topk_epsilon_anneal_updates", o.topk_epsilon_anneal_updates, 0, integer=True)
    check_number("topk_epsilon_relative", o.topk_epsilon_relative, 0.0, why="0 = off")
    _check_combinations(o)
    if vocab_size is not None:
        _check_memory(o, vocab_size)


def _check_memory(o: SimpleNamespace, vocab_size: int) -> None:
    """A soft search whose first batch could not select its beams in the device's memory (a batch of
    ``--batch-size`` sentences, else of one): refused naming ``--train-beam`` and the memory
    (:mod:`~fairseq_softtopk.modules.selection_memory`; the criterion checks every batch's own size too)."""
    if o.teacher_forcing_ratio >= 1.0 or str(o.topk_mode) != "soft" or str(o.topk_regularizer) != "entropic":
        return
    import torch

    from ..modules.selection_memory import selection_memory_problem

    device = torch.device("cuda" if torch.cuda.is_available() and not o.cpu else "cpu")
    problem = selection_memory_problem(o.batch_size or 1, o.train_beam, vocab_size, o.topk_candidate_pool, device)
    if problem:
        raise OptionError(f"--train-beam {o.train_beam} {problem}: lower --train-beam"
                          f"{' or --batch-size' if o.batch_size else ''}")


def _check_beam(o: SimpleNamespace, vocab_size: Optional[int]) -> None:
    """``--train-beam`` (at least 2 hypotheses for the risk, at most the first step's candidates) and
    ``--topk-candidate-pool`` (0, or at least the beam)."""
    risk = str(o.beam_loss) == "risk"
    high = first_step_candidates(vocab_size, o.beam_loss) if vocab_size is not None else None
    why = []
    if risk:
        why.append("--beam-loss risk needs two hypotheses at least: the risk of one has no gradient")
    if high is not None:
        why.append(f"the first decoding step extends one beam: {high} candidates, the {vocab_size} types of the "
                   f"target dictionary but padding{' and EOS' if risk else ''}")
    check_number("train_beam", o.train_beam, 2 if risk else 1, high, integer=True, why="; ".join(why))
    width = o.topk_window_width
    if isinstance(width, bool) or not isinstance(width, int) or width < -1 or 0 < width < o.train_beam:
        raise OptionError(f"--topk-window-width must be -1 (the default width), 0 (the adaptive window) or an "
                          f"integer >= --train-beam ({o.train_beam}), got {width!r}")
    pool = o.topk_candidate_pool
    if isinstance(pool, bool) or not isinstance(pool, int) or (pool != 0 and pool < o.train_beam):
        raise OptionError(f"--topk-candidate-pool must be 0 (all candidates) or an integer >= --train-beam "
                         f"({o.train_beam}), got {pool!r}")


def check_max_len(max_len_a, max_len_b) -> None:
    """``--beam-max-len-a`` and ``--beam-max-len-b``: the training search of ``--beam-loss risk`` ends at
    ``int(a * source length + b)`` tokens, which must allow one token for any source length >= 1."""
    check_number("beam_max_len_a", max_len_a, 0.0)
    check_number("beam_max_len_b", max_len_b, 0, integer=True)
    if max_len_a + max_len_b < 1:
        raise OptionError(f"--beam-max-len-a + --beam-max-len-b must be >= 1 (the search ends at int(a * source "
                         f"length + b) tokens, which must allow one), got {max_len_a} + {max_len_b}")


def _check_combinations(o: SimpleNamespace) -> None:
    """Options that do not go together."""
    mode, cost, regularizer, compiled = str(o.topk_mode), str(o.topk_cost), str(o.topk_regularizer), \
        str(o.topk_compile) != "none"
    if (o.topk_epsilon_start > 0) != (o.topk_epsilon_anneal_updates > 0):
        raise OptionError("an epsilon schedule needs both --topk-epsilon-start and --topk-epsilon-anneal-updates "
                         f"(got {o.topk_epsilon_start} and {o.topk_epsilon_anneal_updates})")
    if o.topk_epsilon_start > 0 and mode != "soft":
        raise OptionError("--topk-epsilon-start is an option of --topk-mode soft")
    if o.topk_fixed_iterations and mode != "soft":
        raise OptionError("--topk-fixed-iterations is an option of --topk-mode soft (hard mode never waits on a "
                         "solver)")
    if compiled and not (o.topk_fixed_iterations and mode == "soft"):
        raise OptionError("--topk-compile needs --topk-fixed-iterations (the default solve reads values on the "
                         "host, which torch.compile cannot trace whole)")
    if compiled and o.topk_epsilon_start > 0:
        raise OptionError("--topk-compile does not go with an epsilon schedule (--topk-epsilon-start): every new "
                         "epsilon would compile the solve again")
    if regularizer == "quadratic" and (mode != "soft" or cost != "linear"):
        raise OptionError("--topk-regularizer quadratic is an option of --topk-mode soft with --topk-cost linear "
                         f"(got --topk-mode {mode} --topk-cost {cost})")
    if regularizer == "quadratic" and compiled:
        raise OptionError("--topk-compile is not available with --topk-regularizer quadratic (its solve is run "
                         "eagerly, also with --topk-fixed-iterations)")
    if o.topk_epsilon_relative > 0 and (mode != "soft" or cost != "linear"):
        raise OptionError("--topk-epsilon-relative is an option of --topk-mode soft with --topk-cost linear "
                         f"(got --topk-mode {mode} --topk-cost {cost})")
