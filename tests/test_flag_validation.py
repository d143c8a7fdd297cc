"""Option values are checked when fairseq builds the criterion or the model, before the first update.

Through fairseq's own parser (``options.parse_args_and_arch`` with this package as ``--user-dir``)
and build path (``convert_namespace_to_omegaconf``, ``task.build_criterion`` / ``task.build_model``,
as fairseq-train does) on a 14-type dictionary: every bad value is a ``ValueError`` naming the flag,
the allowed range and the value; the legal values at the edges of each range are accepted and used.
Then one real fairseq-train that stops before any update, and the ablation runner's check of every arm.
"""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from conftest import run_fairseq

import fairseq_softtopk
from fairseq_softtopk.criterions._soft_beam_search_config import SoftBeamSearchConfig
from fairseq_softtopk.criterions.beamgrad_risk import BeamgradRiskConfig
from fairseq_softtopk.models._attention_config import AttentionNormalizerConfig

fairseq_softtopk.register()

REPO = Path(__file__).resolve().parents[1]
USER_DIR = str(Path(fairseq_softtopk.__file__).resolve().parent)
#: the dictionary's types: 4 special symbols and 10 words
VOCAB = 14
XLA = importlib.util.find_spec("torch_xla") is not None
EPS_RANGE = "a number in [1e-06, 1e+06]"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A directory with the source and target dictionaries only (what building a criterion or model reads)."""
    path = tmp_path_factory.mktemp("dicts")
    for lang in ("src", "tgt"):
        (path / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(VOCAB - 4)))
    return path


def build(data_dir, component: str, flags):
    """Parses ``flags`` as fairseq-train does and builds ``component``: a criterion (with the LSTM) or a
    model (``softtopk_lstm`` / ``softtopk_transformer``, with ``--criterion cross_entropy``)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    model = component in ("softtopk_lstm", "softtopk_transformer")
    argv = [str(data_dir), "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "src",
            "--target-lang", "tgt", "--cpu", "--arch", f"{component}_tiny" if model else "softtopk_lstm_tiny",
            "--criterion", "cross_entropy" if model else component, *flags]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    assert len(task.target_dictionary) == VOCAB
    return task.build_model(cfg.model) if model else task.build_criterion(cfg.criterion)


S, B, L, T = "soft_beam_search", "beamgrad_risk", "softtopk_lstm", "softtopk_transformer"
#: (component, flags, the flag the error names first, the range it states, how it ends)
BAD = [
    (S, "--train-beam 0", "--train-beam", "an integer in [1, 13] (the first decoding step extends one beam: 13 "
                                          "candidates", "got 0"),
    (S, "--train-beam 500", "--train-beam", "an integer in [1, 13]", "got 500"),
    (S, "--beam-loss risk --train-beam 1", "--train-beam", "an integer in [2, 12] (--beam-loss risk needs two "
                                                           "hypotheses", "got 1"),
    (S, "--beam-loss risk --train-beam 13", "--train-beam", "but padding and EOS", "got 13"),
    (S, "--teacher-forcing-ratio 1.5", "--teacher-forcing-ratio", "a number in [0, 1]", "got 1.5"),
    (S, "--topk-epsilon -1", "--topk-epsilon", EPS_RANGE, "got -1.0"),
    (S, "--topk-epsilon nan", "--topk-epsilon", EPS_RANGE, "got nan"),
    (S, "--topk-epsilon 2e6", "--topk-epsilon", EPS_RANGE, "got 2000000.0"),
    (S, "--topk-regularizer quadratic --topk-epsilon 1e-30", "--topk-epsilon", EPS_RANGE, "got 1e-30"),
    (S, "--topk-tol 0", "--topk-tol", "a number in (0, 1)", "got 0.0"),
    (S, "--topk-tol 1", "--topk-tol", "a number in (0, 1)", "got 1.0"),
    (S, "--topk-max-iter 0", "--topk-max-iter", "an integer >= 1", "got 0"),
    (S, "--topk-window-width 3", "--topk-window-width", "-1 (the default width), 0 (the adaptive window) or an "
                                                        "integer >= --train-beam (5)", "got 3"),
    (S, "--topk-window-width -2", "--topk-window-width", "an integer >= --train-beam (5)", "got -2"),
    (S, "--topk-candidate-pool 4", "--topk-candidate-pool", "0 (all candidates) or an integer >= --train-beam (5)",
     "got 4"),
    (S, "--topk-grad-cap 0", "--topk-grad-cap", "a finite number > 0", "got 0.0"),
    (S, "--topk-epsilon-start 1e-9 --topk-epsilon-anneal-updates 5", "--topk-epsilon-start",
     f"0 (no schedule) or {EPS_RANGE}", "got 1e-09"),
    (S, "--topk-epsilon-anneal-updates -1", "--topk-epsilon-anneal-updates", "an integer >= 0", "got -1"),
    (S, "--topk-epsilon-relative inf", "--topk-epsilon-relative", "a finite number >= 0", "got inf"),
    (S, "--label-smoothing -0.5", "--label-smoothing", "a number in [0, 1)", "got -0.5"),
    (S, "--label-smoothing 1", "--label-smoothing", "a number in [0, 1)", "got 1.0"),
    (S, "--label-smoothing 1.5", "--label-smoothing", "a number in [0, 1)", "got 1.5"),
    (S, "--beam-loss-temperature nan", "--beam-loss-temperature", "a finite number > 0", "got nan"),
    (S, "--beam-lenpen nan", "--beam-lenpen", "a finite number", "got nan"),
    (S, "--beam-max-len-a -1", "--beam-max-len-a", "a finite number >= 0", "got -1.0"),
    (S, "--beam-max-len-b -1", "--beam-max-len-b", "an integer >= 0", "got -1"),
    (S, "--log-term-gnorm-interval -1", "--log-term-gnorm-interval", "an integer >= 0 (0 = never)", "got -1"),
    (S, "--beam-max-len-a 0 --beam-max-len-b 0", "--beam-max-len-a", "+ --beam-max-len-b must be >= 1", "got 0.0 + 0"),
    (S, "--candidate-pool 2", "--topk-candidate-pool", "an integer >= --train-beam (5), got 2",
     "(given as --candidate-pool, its deprecated name)"),
    (S, "--selection-grad-cap -1", "--topk-grad-cap", "a finite number > 0", "(given as --selection-grad-cap, its "
                                                                            "deprecated name)"),
    (S, "--selection-grad clipped", "--selection-grad", "must be one of ['capped', 'full', 'none']", "got 'clipped'"),
    (S, "--bf16", "--bf16", "only on TPUs", "on a GPU use --fp16 or --amp"),
    (B, "--train-beam 1", "--train-beam", "an integer in [2, 13] (the risk of one hypothesis has no gradient",
     "got 1"),
    (B, "--train-beam 14", "--train-beam", "an integer in [2, 13]", "got 14"),
    (B, "--teacher-forcing-ratio 1", "--teacher-forcing-ratio", "a number in [0, 1)", "got 1.0"),
    (B, "--label-smoothing 1", "--label-smoothing", "a number in [0, 1)", "got 1.0"),
    (B, "--beam-loss-temperature -1", "--beam-loss-temperature", "a finite number > 0", "got -1.0"),
    (B, "--beamgrad-length-penalty -1", "--beamgrad-length-penalty", "a finite number >= 0", "got -1.0"),
    (B, "--beam-max-len-a nan", "--beam-max-len-a", "a finite number >= 0", "got nan"),
    (B, "--beam-max-len-b -2", "--beam-max-len-b", "an integer >= 0", "got -2"),
    (B, "--bf16", "--bf16", "only on TPUs", "on a GPU use --fp16 or --amp"),
    (L, "--attention-topk 0", "--attention-topk", "an integer >= 1", "got 0"),
    (L, "--attention-normalizer sparse_topk --attention-topk-epsilon 1e-7", "--attention-topk-epsilon", EPS_RANGE,
     "got 1e-07"),
    (L, "--bf16", "--bf16", "only on TPUs", "on a GPU use --fp16 or --amp"),
    (T, "--attention-topk -1", "--attention-topk", "an integer >= 1", "got -1"),
    (T, "--attention-normalizer soft_topk --attention-topk-epsilon nan", "--attention-topk-epsilon", EPS_RANGE,
     "got nan"),
    (T, "--bf16", "--bf16", "only on TPUs", "on a GPU use --fp16 or --amp"),
]


@pytest.mark.parametrize("component, flags, flag, allowed, ending", BAD, ids=[f"{c}:{f}" for c, f, *_ in BAD])
def test_a_bad_value_is_refused_when_built_naming_the_flag_and_the_range(data_dir, component, flags, flag, allowed,
                                                                       ending):
    if flag == "--bf16" and XLA:
        pytest.skip("torch_xla is installed here: fairseq can train in bfloat16")
    with pytest.raises(ValueError) as error:
        build(data_dir, component, flags.split())
    message = str(error.value)
    assert message.startswith(f"{flag} "), message
    assert allowed in message and message.endswith(ending), message


#: the choices: fairseq's parser refuses a value outside them (exit status 2, naming the flag)
CHOICES = [(S, "--topk-mode"), (S, "--topk-cost"), (S, "--topk-grad"), (S, "--topk-compile"),
           (S, "--topk-regularizer"), (S, "--beam-loss"), (S, "--beam-risk-cost"), (S, "--topk-backend"),
           (L, "--attention-normalizer"),
           (L, "--attention-topk-backend"), (T, "--attention-topk-backend")]


@pytest.mark.parametrize("component, flag", CHOICES)
def test_a_value_outside_the_choices_is_refused_by_the_parser(data_dir, capsys, component, flag):
    with pytest.raises(SystemExit) as exit_info:
        build(data_dir, component, [flag, "medium"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: invalid choice: 'medium'" in capsys.readouterr().err


def test_every_option_of_the_criteria_and_the_attention_is_covered():
    """Every option of the three configs (not fed from fairseq's own, ``${...}``) has a bad value or a choice
    in the tables above, under its name or its deprecated alias."""
    named = {f for _, flags, *_ in BAD for f in flags.split() if f.startswith("--")} | {f for _, f in CHOICES}
    boolean = {"topk_fixed_iterations"}  # a switch: its combinations are test_soft_beam_search_criterion's
    for config in (SoftBeamSearchConfig, BeamgradRiskConfig, AttentionNormalizerConfig):
        for field in dataclasses.fields(config):
            if str(field.default).startswith("${") or field.name.startswith("_") or field.name in boolean:
                continue
            assert "--" + field.name.replace("_", "-") in named, field.name


def _normalizers(model):
    from fairseq_softtopk.modules.attention_normalizer import AttentionNormalizer

    return [m for m in model.modules() if isinstance(m, AttentionNormalizer)]


def test_the_edges_of_the_soft_beam_search_ranges_are_accepted_and_used(data_dir):
    low = build(data_dir, S, ("--train-beam 13 --teacher-forcing-ratio 0 --topk-epsilon 1e-6 --topk-tol 0.999 "
                              "--topk-max-iter 1 --topk-candidate-pool 13 --topk-grad-cap 1e-9 --label-smoothing 0.999 "
                              "--beam-loss-temperature 1e-9 --beam-lenpen -2 --beam-max-len-a 0 --beam-max-len-b 1 "
                              "--topk-epsilon-relative 0").split())
    assert (low.search.beam, low.search.epsilon, low.search.tol, low.search.max_iter, low.search.candidate_pool) == \
        (13, 1e-6, 0.999, 1, 13)
    assert (low.p, low.label_smoothing, low.beam_loss_temperature, low.lenpen, low.max_len_a, low.max_len_b) == \
        (0.0, 0.999, 1e-9, -2.0, 0.0, 1)
    assert low.search.selection_grad_cap == pytest.approx(1e-9)  # in units of (1 - p) = 1
    high = build(data_dir, S, ("--train-beam 1 --teacher-forcing-ratio 1 --topk-epsilon 1e6 --topk-tol 1e-12 "
                               "--label-smoothing 0 --beam-max-len-a 1 --beam-max-len-b 0 --topk-epsilon-start 1e-6 "
                               "--topk-epsilon-anneal-updates 1 --topk-epsilon-relative 1e6").split())
    assert (high.search.beam, high.search.epsilon, high.search.tol, high.epsilon_schedule, high.p) == \
        (1, 1e6, 1e-12, (1e-6, 1), 1.0)
    for beam in (2, 12):  # the risk's range
        assert build(data_dir, S, ["--beam-loss", "risk", "--train-beam", str(beam)]).search.beam == beam
    for width in (-1, 0, 5, 10 ** 6):  # the default, the adaptive window, the beam, wider than the candidates
        assert build(data_dir, S, ["--topk-window-width", str(width)]).search.window_width == width
    quadratic = build(data_dir, S, "--topk-regularizer quadratic --topk-epsilon 1e-6 --topk-epsilon-start 1e6 "
                                   "--topk-epsilon-anneal-updates 5 --selection-grad-cap 2".split())
    assert (quadratic.search.epsilon, quadratic.epsilon_schedule) == (1e-6, (1e6, 5))
    assert quadratic.search.selection_grad_cap == pytest.approx(2 * 0.2)  # the alias's value, in units of 1 - p


def test_the_edges_of_the_beamgrad_risk_ranges_pass_the_checks(data_dir):
    """Without beamgrad installed the criterion stops at its import, after the checks: no ValueError."""
    for flags in ("--train-beam 2 --teacher-forcing-ratio 0 --label-smoothing 0 --beamgrad-length-penalty 0 "
                  "--beam-max-len-a 0 --beam-max-len-b 1",
                  "--train-beam 13 --teacher-forcing-ratio 0.999 --label-smoothing 0.999 --beam-loss-temperature 1e-9"):
        if importlib.util.find_spec("beamgrad") is None:
            with pytest.raises(ImportError, match="needs the optional package beamgrad"):
                build(data_dir, B, flags.split())
        else:
            assert build(data_dir, B, flags.split()).beam == int(flags.split()[1])


@pytest.mark.parametrize("component", [L, T])
def test_the_edges_of_the_attention_ranges_are_accepted_and_used(data_dir, component):
    for normalizer, epsilon in (("soft_topk", "1e-6"), ("sparse_topk", "1e6")):
        model = build(data_dir, component, ["--attention-normalizer", normalizer, "--attention-topk", "1",
                                            "--attention-topk-epsilon", epsilon])
        found = _normalizers(model)
        assert found and all((m.name, m.k, m.epsilon) == (normalizer, 1, float(epsilon)) for m in found)


@pytest.mark.parametrize("component, flag", [(S, "--topk-backend"), (L, "--attention-topk-backend"),
                                             (T, "--attention-topk-backend")])
def test_the_triton_backend_is_refused_on_a_cpu_run_naming_the_flag(data_dir, monkeypatch, component, flag):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as error:
        build(data_dir, component, [flag, "triton"])  # build() gives --cpu
    assert str(error.value) == (f"{flag} triton runs the Triton kernels on a GPU (or under TRITON_INTERPRET=1, for "
                                f"tests), but --cpu was given; use {flag} auto or torch, got 'triton'")


def test_the_backends_reach_the_search_and_the_attention(data_dir, monkeypatch):
    from fairseq_softtopk.ops.kernels import backend

    assert build(data_dir, S, []).search.backend == "auto"
    assert build(data_dir, S, ["--topk-backend", "torch"]).search.backend == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels then run on CPU tensors: triton is accepted with --cpu
    monkeypatch.setattr(backend, "triton_import_error", lambda: "")  # (without importing triton in this process)
    assert build(data_dir, S, ["--topk-backend", "triton"]).search.backend == "triton"
    for component in (L, T):
        found = _normalizers(build(data_dir, component, "--attention-normalizer sparse_topk --attention-topk-backend "
                                                        "triton".split()))
        assert found and all(m.backend == "triton" for m in found)


def test_fairseq_train_stops_before_any_update_naming_the_flag(toy_data_bin, tmp_path):
    save = tmp_path / "save"
    proc = run_fairseq("train", [str(toy_data_bin[1]), "--user-dir", USER_DIR, "--arch", "softtopk_lstm_tiny",
                                 "--criterion", "soft_beam_search", "--topk-epsilon", "-1", "--optimizer", "adam",
                                 "--lr", "0.01", "--max-tokens", "200", "--max-update", "2", "--cpu",
                                 "--save-dir", str(save), "--log-format", "simple", "--num-workers", "0"],
                       cwd=tmp_path, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    # one line, as argparse's errors: no traceback through fairseq's start-up
    assert last.startswith(f"fairseq-train: error: --topk-epsilon must be {EPS_RANGE}") and last.endswith("got -1.0"), \
        last
    assert "Traceback" not in proc.stderr
    output = proc.stdout + proc.stderr
    assert "criterion: SoftBeamSearchCriterion" not in output and "num_updates" not in output  # never trained
    assert not list(tmp_path.rglob("crash.pt")) and not list(tmp_path.rglob("*.pt"))
    assert not save.exists() or not any(save.iterdir())


def test_the_ablation_check_refuses_a_bad_value_of_the_third_arm_before_anything_trains(tmp_path):
    from fairseq_softtopk.experiments.ablation_config import load_config
    from fairseq_softtopk.experiments.ablation_runner import run_ablation

    data_bin, work = tmp_path / "bin", tmp_path / "work"
    data_bin.mkdir()
    for name in ("dict.src.txt", "dict.tgt.txt", "train.src-tgt.src.idx", "train.src-tgt.tgt.idx"):
        (data_bin / name).write_text("")  # passes the runner's data check; nothing could train on it
    config_path = REPO / "configs" / "toy_finetune.yaml"
    cases = [("arms.soft.topk-epsilon=-1", "--topk-epsilon must be", "got -1.0 (set in", "arms.soft"),
             ("arms.attn_soft_topk.attention-topk-epsilon=0", "--attention-topk-epsilon must be", "got 0.0 (set in",
              "arms.attn_soft_topk")]
    for override, named, value, section in cases:
        config = load_config(config_path, [override])
        assert list(config["arms"])[2] == "soft"  # the third arm, after tf and hard
        with pytest.raises(ValueError) as error:
            run_ablation(config, data_bin, work, verbose=False)
        message = str(error.value)
        assert named in message and EPS_RANGE in message and f"{value} {config_path}: {section})" in message, message
        assert not work.exists()  # nothing ran, nothing was written


def _memory(monkeypatch, gib: float):
    """The device memory the selection's check sees, set to ``gib`` GiB."""
    from fairseq_softtopk.modules import selection_memory

    monkeypatch.setattr(selection_memory, "available_memory", lambda device=None: int(gib * 2 ** 30))


def test_a_beam_whose_selection_cannot_fit_in_memory_is_refused_when_built(tmp_path, monkeypatch):
    """The option check bounds one decoding step's soft selection for a batch of --batch-size sentences (of one
    without it): 8 sentences of 500 beams over 624 types need at least 1.7 x the float64 plan (8 x 501 x 312,000)
    and the float32 weights (8 x 312,000 x 500): 20.5 GiB, refused on a machine with 16; the hard ablation, the
    sparse selection and teacher forcing alone are not refused."""
    from fairseq_softtopk.modules.selection_memory import soft_selection_bytes

    dictionary = tmp_path / "dicts"
    dictionary.mkdir()
    for lang in ("src", "tgt"):  # the toy corpus's size: 620 words and 4 special symbols
        (dictionary / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(620)))
    expected = 1.7 * 8 * 8 * 501 * 500 * 624 + 4 * 8 * 500 * 624 * 500
    assert soft_selection_bytes(8, 500, 624) == int(expected)
    _memory(monkeypatch, 16)
    with pytest.raises(ValueError, match=r"^--train-beam 500 needs at least 20.5 GiB for one decoding step's soft "
                                         r"selection of 8 sentences .* more than the 16.0 GiB the CPU has available: "
                                         r"lower --train-beam or --batch-size$"):
        build_with(dictionary, S, "--train-beam 500 --batch-size 8".split())
    with pytest.raises(ValueError, match=r"^--train-beam 500 needs at least 2.6 GiB .* of 1 sentence .* lower "
                                         r"--train-beam$"):
        _memory(monkeypatch, 2)
        build_with(dictionary, S, "--train-beam 500 --max-tokens 1000".split())
    _memory(monkeypatch, 16)
    for fine in ("--train-beam 500 --batch-size 6", "--train-beam 500 --batch-size 8 --topk-mode hard",
                 "--train-beam 500 --batch-size 8 --topk-regularizer quadratic",
                 "--train-beam 500 --batch-size 8 --teacher-forcing-ratio 1.0", "--train-beam 500 --max-tokens 1000"):
        build_with(dictionary, S, fine.split())


def build_with(data_dir, component: str, flags):
    """:func:`build` with another dictionary size."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [str(data_dir), "--user-dir", USER_DIR, "--task", "translation", "--source-lang", "src",
            "--target-lang", "tgt", "--cpu", "--arch", "softtopk_lstm_tiny", "--criterion", component, *flags]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    return task.build_criterion(cfg.criterion)


def test_a_batch_whose_selection_cannot_fit_in_memory_stops_before_its_search(monkeypatch):
    """--max-tokens batches: the criterion checks each batch's own sentence count before the search, naming
    --train-beam and the batch options; a batch that fits trains."""
    import torch
    from fairseq.data import Dictionary

    from builders import build_criterion, build_model, make_sample

    dictionary = Dictionary()
    for i in range(620):
        dictionary.add_symbol(f"w{i}")
    criterion = build_criterion(dictionary, train_beam=200, teacher_forcing_ratio=0.5)
    model = build_model(dictionary, dtype=torch.float32)
    rng = torch.Generator().manual_seed(0)
    _memory(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"^--train-beam 200 needs at least 1.6 GiB .* of 4 sentences .*, in a "
                                         r"batch of this size: lower --train-beam, or the batch \(--max-tokens, "
                                         r"--batch-size\)$"):
        criterion(model, make_sample(dictionary, rng, [3, 2, 3, 2]))
    loss, _, _ = criterion(model, make_sample(dictionary, rng, [3, 2]))  # 0.8 GiB
    assert torch.isfinite(loss)


def test_fairseq_train_refuses_a_beam_that_cannot_fit_in_one_line(toy_data_bin, tmp_path):
    """The toy corpus (624 types) at --train-beam 600 and 64 sentences a batch: at least 236 GiB a step, refused
    before the first update in one line (it was the kernel's out-of-memory kill, without a word)."""
    from fairseq_softtopk.modules.selection_memory import available_memory, soft_selection_bytes

    if available_memory() > soft_selection_bytes(64, 600, 624):
        pytest.skip("this machine has the memory such a beam needs")
    proc = run_fairseq("train", [str(toy_data_bin[1]), "--user-dir", USER_DIR, "--arch", "softtopk_lstm_tiny",
                                 "--criterion", "soft_beam_search", "--train-beam", "600", "--optimizer", "adam",
                                 "--lr", "0.01", "--batch-size", "64", "--max-update", "2", "--cpu",
                                 "--save-dir", str(tmp_path / "save"), "--num-workers", "0"], cwd=tmp_path, check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fairseq-train: error: --train-beam 600 needs at least 236.0 GiB") and "Traceback" not in proc.stderr
