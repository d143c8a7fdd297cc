"""The ablation runner's stage configs (``configs/*.yaml``): loading, ``--set`` overrides,
validation, and the fairseq-train flags of a stage and arm (used by :mod:`.ablation_runner`),
checked against fairseq-train's own parser, and their values against the checks of this package's
criteria and models, before anything runs (:func:`check_train_flags`)."""

import contextlib
import io
import re
import warnings
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

STAGES = ("pretrain", "finetune", "scratch")
HEADER_KEYS = ("description", "stage", "data", "pretrain", "pretrain_per_seed", "baseline", "compare_to", "default_arms", "notes")
SECTIONS = ("model", "train", "arms", "eval")
#: Flags an arm may not change: every arm gets the same update budget, batches and seed.
BUDGET_FLAGS = ("max-update", "max-epoch", "seed", "max-tokens", "batch-size", "update-freq")
#: Flags the runner sets itself.
MANAGED_FLAGS = ("save-dir", "finetune-from-model", "restore-file", "user-dir")
EVAL_KEYS = ("beam", "batch_size", "subsets", "post_process", "detok_lang", "generate")
#: Eval keys that enter a run's cached settings only where set (caches written before them stay valid):
#: ``checkpoint`` (``last``, the default, or ``best``: fairseq's checkpoint_best.pt, by its
#: ``--best-checkpoint-metric``), ``lenpen_grid`` (the length penalties to choose from on valid, per run) and
#: ``fixed_lenpens`` (length penalties at which the subsets other than valid are also decoded, untuned).
OPTIONAL_EVAL_KEYS = ("checkpoint", "lenpen_grid", "fixed_lenpens")


def _read_yaml(path: Path) -> dict:
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"config not found: {path}")
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a config must be a YAML mapping, got {type(config).__name__}")
    for name, flags in (config.get("arms") or {}).items():
        config["arms"][name] = flags or {}  # an arm without flags is written "name:"
    config["path"] = str(path)
    return config


def apply_override(config: dict, item: str) -> None:
    """Applies ``section.key=value`` (value parsed as YAML; empty: null, which drops a flag).

    Examples: ``train.max-update=300``, ``arms.soft.topk-epsilon=0.05``,
    ``pretrain.train.max-epoch=2``, ``eval.beam=1``.
    """
    import yaml

    key, sep, raw = item.partition("=")
    if not sep or not key or key.startswith(".") or key.endswith("."):
        raise ValueError(f"an override looks like section.flag=value, got {item!r}")
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
        if not isinstance(node.get(part), dict):
            raise ValueError(f"override {item!r}: {'.'.join(parents[:i + 1])!r} is not a section of "
                             f"{config.get('path', 'the config')}")
        node = node[part]
    node[leaf] = yaml.safe_load(raw) if raw.strip() else None


def validate_config(config: dict, _nested: bool = False) -> None:
    """Raises ``ValueError`` naming the first problem of a (resolved) config."""
    where = config.get("path", "config")
    unknown = sorted(set(config) - set(HEADER_KEYS) - set(SECTIONS) - {"path"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (header: {HEADER_KEYS}, sections: {SECTIONS})")
    stage = config.get("stage")
    if stage not in STAGES:
        raise ValueError(f"{where}: stage must be one of {STAGES}, got {stage!r}")
    for section in ("model", "train", "arms", "eval"):
        if not isinstance(config.get(section) or {}, dict):
            raise ValueError(f"{where}: {section!r} must be a mapping")
    if not config.get("train"):
        raise ValueError(f"{where}: needs a 'train' mapping of fairseq-train flags")
    if stage == "finetune":
        if not isinstance(config.get("pretrain"), dict) or config["pretrain"].get("stage") != "pretrain":
            raise ValueError(f"{where}: a finetune config needs 'pretrain': the file name of a pretrain-stage config")
        validate_config(config["pretrain"], _nested=True)
    elif not (config.get("model") or {}).get("arch"):
        raise ValueError(f"{where}: a {stage} config needs model.arch")
    if config.get("pretrain_per_seed") not in (None, True, False):
        raise ValueError(f"{where}: pretrain_per_seed must be true or false, got {config['pretrain_per_seed']!r}")
    if config.get("pretrain_per_seed") and stage != "finetune":
        raise ValueError(f"{where}: pretrain_per_seed needs a finetune config (a {stage} config pretrains nothing)")
    if stage == "pretrain":
        return
    arms = config.get("arms") or {}
    if config.get("baseline") not in arms:
        raise ValueError(f"{where}: baseline {config.get('baseline')!r} is not one of the arms {sorted(arms)}")
    for key in ("default_arms", "compare_to"):
        missing = [a for a in config.get(key) or [] if a not in arms]
        if missing:
            raise ValueError(f"{where}: {key} {missing} are not defined under 'arms'")
    for name, flags in arms.items():
        if not isinstance(flags, dict):
            raise ValueError(f"{where}: arm {name!r} must be a mapping of flags, got {flags!r}")
        budget = sorted(set(flags) & set(BUDGET_FLAGS))
        if budget:
            raise ValueError(f"{where}: arm {name!r} sets {budget}; arms share the update budget, batches and "
                             f"seed (set them under 'train' or with --seeds)")
    for section in ("model", "train", "arms"):
        flags = config.get(section) or {}
        names = [f for arm in flags.values() for f in arm] if section == "arms" else list(flags)
        managed = sorted(set(names) & set(MANAGED_FLAGS))
        if managed:
            raise ValueError(f"{where}: {section} sets {managed}; the runner sets these itself")
    unknown_eval = sorted(set(config.get("eval") or {}) - set(EVAL_KEYS) - set(OPTIONAL_EVAL_KEYS))
    if unknown_eval:
        raise ValueError(f"{where}: unknown eval keys {unknown_eval} (known: {EVAL_KEYS + OPTIONAL_EVAL_KEYS})")
    _validate_eval(config.get("eval") or {}, where)


def _validate_eval(eval_cfg: Mapping, where: str) -> None:
    """``eval.checkpoint``, ``eval.lenpen_grid`` (which needs ``valid`` among the subsets) and
    ``eval.fixed_lenpens`` (which needs a subset besides ``valid``); neither beside ``generate.lenpen``."""
    if eval_cfg.get("checkpoint") not in (None, "last", "best"):
        raise ValueError(f"{where}: eval.checkpoint must be last or best, got {eval_cfg['checkpoint']!r}")
    subsets = eval_cfg.get("subsets") or ["valid", "test"]
    for key in ("lenpen_grid", "fixed_lenpens"):
        values = eval_cfg.get(key)
        if values is None:
            continue
        if not isinstance(values, list) or not values or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
                for v in values) or len(set(values)) != len(values):
            raise ValueError(f"{where}: eval.{key} must be a non-empty list of distinct finite numbers, got {values!r}")
        if "lenpen" in (eval_cfg.get("generate") or {}):
            raise ValueError(f"{where}: eval.{key} and eval.generate.lenpen both set the length penalty; keep one")
    if eval_cfg.get("lenpen_grid") is not None and "valid" not in subsets:
        raise ValueError(f"{where}: eval.lenpen_grid is chosen on valid, which eval.subsets "
                         f"({eval_cfg.get('subsets')}) leaves out")
    if eval_cfg.get("fixed_lenpens") is not None and not set(subsets) - {"valid"}:
        raise ValueError(f"{where}: eval.fixed_lenpens decodes the subsets other than valid, and eval.subsets "
                         f"({eval_cfg.get('subsets')}) has none")


def eval_settings(eval_cfg: Mapping) -> dict:
    """What a cached score depends on: the :data:`EVAL_KEYS`, and the :data:`OPTIONAL_EVAL_KEYS` that are set."""
    settings = {key: eval_cfg.get(key) for key in EVAL_KEYS}
    settings.update({key: eval_cfg[key] for key in OPTIONAL_EVAL_KEYS if eval_cfg.get(key) is not None})
    return settings


def load_config(path, overrides: Sequence[str] = ()) -> dict:
    """Reads a stage config, resolves its ``pretrain`` config (a path relative to it), applies
    ``overrides`` (see :func:`apply_override`) and validates the result."""
    path = Path(path)
    config = _read_yaml(path)
    if config.get("pretrain"):
        pretrain = Path(config["pretrain"])
        config["pretrain"] = _read_yaml(pretrain if pretrain.is_absolute() else path.parent / pretrain)
    for item in overrides:
        apply_override(config, item)
    validate_config(config)
    return config


def stage_flags(config: dict, arm: Optional[str] = None) -> Dict[str, object]:
    """fairseq-train flags of a stage (and arm): model flags (a finetune stage inherits its
    pretrain config's, so the checkpoint fits), then ``train``, then the arm's."""
    flags = dict(config["pretrain"].get("model") or {}) if config.get("stage") == "finetune" else {}
    flags.update(config.get("model") or {})
    flags.update(config["train"])
    if arm is not None:
        if arm not in config.get("arms", {}):
            raise ValueError(f"unknown arm {arm!r}; {config['path']} defines {sorted(config.get('arms', {}))}")
        flags.update(config["arms"][arm])
    return flags


def flags_to_args(flags: Mapping[str, object]) -> List[str]:
    """``{"lr": 0.1, "no-epoch-checkpoints": True, "x": False, "y": None}`` -> ``["--lr", "0.1",
    "--no-epoch-checkpoints"]``; lists become several values."""
    args: List[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        if isinstance(value, dict):
            raise ValueError(f"flag {name!r}: a value must be a scalar or a list, got the mapping {value!r}")
        if value is True:
            args.append(f"--{name}")
        elif isinstance(value, (list, tuple)):
            args += [f"--{name}", *map(str, value)]
        else:
            args += [f"--{name}", str(value)]
    return args


def config_train_args(path, arm: Optional[str] = None, overrides: Sequence[str] = ()) -> List[str]:
    """fairseq-train arguments (without data, save dir and seed) of a config file and arm."""
    return flags_to_args(stage_flags(load_config(path, overrides), arm))


def _flag_sections(config: dict, arm: Optional[str]) -> List[Tuple[str, Mapping[str, object]]]:
    """``(name, flags)`` of the sections :func:`stage_flags` merges for ``arm``, in its order."""
    where = config.get("path", "config")
    sections = []
    if config.get("stage") == "finetune":
        sections.append((f"{config['pretrain'].get('path', 'pretrain config')}: model",
                         config["pretrain"].get("model") or {}))
    sections += [(f"{where}: model", config.get("model") or {}), (f"{where}: train", config["train"])]
    if arm is not None:
        sections.append((f"{where}: arms.{arm}", config["arms"][arm]))
    return sections


def _stages(config: dict) -> List[Tuple[dict, Optional[str]]]:
    """Every ``(config, arm)`` a run of ``config`` trains: its pretrain stage, then each arm."""
    if config["stage"] == "pretrain":
        return [(config, None)]
    stages = [(config["pretrain"], None)] if config["stage"] == "finetune" else []
    return stages + [(config, arm) for arm in config.get("arms") or {}]


def fairseq_train_rejects(flags: Mapping[str, object]) -> Tuple[List[str], Optional[str]]:
    """Parses ``flags`` with fairseq-train's parser (in this process, with the imported copy of this
    package as ``--user-dir``: :func:`package_dir`), then checks the values of this package's criterion
    and model options as fairseq-train would when it builds them (:func:`check_option_values`).

    Returns:
        ``(unknown, error)``: the flag names the parser does not know (its architecture, task,
        criterion, optimizer and scheduler options included) and, where it refused a value
        (an unknown ``--arch``, say) or a value check did (``--topk-epsilon -1``), its message;
        ``([], None)`` when fairseq-train accepts them.
    """
    from fairseq import options

    import fairseq_softtopk

    fairseq_softtopk.register()  # registers this package's components even where it was imported before fairseq
    argv = ["data", *flags_to_args(flags), "--user-dir", str(package_dir())]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args, extra = options.parse_args_and_arch(options.get_training_parser(), argv, parse_known=True)
    except SystemExit:
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        return [], lines[-1] if lines else "fairseq-train's parser exited"
    unknown = [arg[2:] for arg in extra if arg.startswith("--")]
    try:
        check_option_values(args)
    except ValueError as error:
        return unknown, str(error)
    return unknown, None


def check_option_values(args) -> None:
    """Runs the value checks of this package's criterion (``--criterion soft_beam_search`` or
    ``beamgrad_risk``) and model (an ``--arch`` of ``softtopk_lstm`` or ``softtopk_transformer``) on
    fairseq-train's parsed arguments, without building anything (the target dictionary is not read:
    ``--train-beam``'s bound by the vocabulary is checked when fairseq-train builds the criterion).

    Raises:
        ValueError: the first bad value, naming its flag and the allowed range.
    """
    import dataclasses
    from types import SimpleNamespace

    from fairseq.models import ARCH_MODEL_REGISTRY

    from ..criterions._soft_beam_search_config import check_soft_beam_search_options, resolve_renamed
    from ..criterions.beamgrad_risk import check_beamgrad_risk_options
    from ..models._attention_config import AttentionNormalizerConfig, check_model_options
    from ..models.softtopk_lstm import SoftTopKLSTMModel
    from ..models.softtopk_transformer import SoftTopKTransformerModel

    with warnings.catch_warnings():  # a deprecated name warns when the stage trains, not once per check
        warnings.simplefilter("ignore", FutureWarning)
        if getattr(args, "criterion", None) == "soft_beam_search":
            check_soft_beam_search_options(resolve_renamed(args))
        elif getattr(args, "criterion", None) == "beamgrad_risk":
            check_beamgrad_risk_options(args)
    model = ARCH_MODEL_REGISTRY.get(getattr(args, "arch", None))
    if model is not None and issubclass(model, (SoftTopKLSTMModel, SoftTopKTransformerModel)):
        # the LSTM's options are added to the parser without defaults: those of its config where not given
        defaults = {f.name: f.default for f in dataclasses.fields(AttentionNormalizerConfig)}
        given = {name: value for name, value in vars(args).items() if value is not None}
        check_model_options(SimpleNamespace(**{**defaults, **given}))


def package_dir() -> Path:
    """The directory of the copy of this package that this process imported: fairseq refuses any
    other ``--user-dir`` once one is imported."""
    import fairseq_softtopk

    return Path(fairseq_softtopk.__file__).resolve().parent


def check_train_flags(config: dict) -> None:
    """Raises ``ValueError`` naming each flag of the config's ``model``, ``train`` and arm sections (its
    pretrain config's too) that fairseq-train does not accept, its value where a check refuses that
    (:func:`check_option_values`: ``--topk-epsilon -1``), and the section that sets it.

    fairseq-train would stop on a misspelt flag or a bad value only when the stage that has it
    starts, after the stages before it have trained (a misspelt pretraining flag: at once, but a
    misspelt arm flag: after pretraining); this checks every stage and arm before anything runs.
    """
    problems = []
    for stage_config, arm in _stages(config):
        unknown, error = fairseq_train_rejects(stage_flags(stage_config, arm))

        def set_in(flag: str) -> str:
            return " and ".join(name for name, flags in _flag_sections(stage_config, arm) if flag in flags)

        if error:  # argparse's "...: error: argument --arch/-a: invalid choice: 'x' (choose from <every arch>)"
            error = re.sub(r" \(choose from [^)]*\)", "", error.split("error: ", 1)[-1])
            flag = re.search(r"--([\w-]+)", error)
            where = set_in(flag.group(1)) if flag else ""
            label = f"arm {arm!r}" if arm is not None else f"the {stage_config['stage']} stage"
            problems.append(f"{error} (set in {where})" if where else f"{label}: {error}")
        for flag in unknown:
            problems.append(f"--{flag} (set in {set_in(flag) or 'no section'}) is not a fairseq-train option")
    if problems:
        unique = list(dict.fromkeys(problems))
        raise ValueError(f"{config.get('path', 'config')}: fairseq-train (with --user-dir {package_dir()}) does not "
                         f"accept: " + "; ".join(unique))
