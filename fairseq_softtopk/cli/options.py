"""Every option the plugin adds to fairseq, with its default and help: ``fairseq-softtopk-options``.

fairseq answers ``--help`` before it imports a ``--user-dir``, so ``fairseq-train ... --help``
does not list the plugin's options; this command does, from the dataclass configs themselves:

    fairseq-softtopk-options                       # every component, as text
    python -m fairseq_softtopk.cli.options --format markdown --component soft_beam_search
    fairseq-train DATA --user-dir "$(fairseq-softtopk-options --user-dir)" ...   # from any directory

Components: the criterion ``soft_beam_search``, the architectures ``softtopk_lstm`` (with its named
sizes) and ``softtopk_transformer`` (fairseq's Transformer options plus these).
"""

import argparse
import dataclasses
import os
import sys
from enum import Enum
from typing import Dict, List, NamedTuple, Optional, Sequence

from fairseq_softtopk.extras import exit_unless_installed


class Option(NamedTuple):
    flag: str
    default: str
    help: str
    #: "main", "advanced" (experiments and tuning) or "deprecated" (an old name of another option)
    kind: str = "main"


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value)
    return "(from the task)" if text.startswith("${") else text


def _choices(field: dataclasses.Field) -> Optional[List[str]]:
    """The choices of a ``ChoiceEnum`` field (fairseq's enum of strings), else None."""
    kind = field.type
    if isinstance(kind, type) and issubclass(kind, Enum):
        return [str(member.value) for member in kind]
    return None


def options_of(config_class) -> List[Option]:
    """The command-line options of one fairseq dataclass config, in field order; fields fed from the
    task (``${task....}``) are left out."""
    out = []
    for field in dataclasses.fields(config_class):
        default = _default_text(field)
        if default == "(from the task)" or field.name.startswith("_"):
            continue
        help_text = field.metadata.get("help", "")
        choices = _choices(field)
        if choices:
            help_text = f"{{{', '.join(choices)}}} {help_text}".strip()
        kind = "deprecated" if field.metadata.get("deprecated") else \
            "advanced" if field.metadata.get("advanced") else "main"
        out.append(Option("--" + field.name.replace("_", "-"), "" if kind == "deprecated" else default,
                          help_text, kind))
    order = {"main": 0, "advanced": 1, "deprecated": 2}
    return sorted(out, key=lambda option: order[option.kind])  # stable: field order within a kind


def components() -> Dict[str, dict]:
    """``{name: {"title", "options", "notes"}}`` of the registered components."""
    import fairseq  # noqa: F401  (the plugin registers its components after fairseq)
    from fairseq.models import ARCH_MODEL_REGISTRY

    import fairseq_softtopk
    fairseq_softtopk.register()
    from fairseq_softtopk.criterions.soft_beam_search import SoftBeamSearchConfig
    from fairseq_softtopk.models.softtopk_lstm import SoftTopKLSTMConfig, SoftTopKLSTMModel
    from fairseq_softtopk.models.softtopk_transformer import SoftTopKAttentionConfig, SoftTopKTransformerModel

    def archs(model_class) -> str:
        return ", ".join(sorted(name for name, cls in ARCH_MODEL_REGISTRY.items() if cls is model_class))

    return {
        "soft_beam_search": {"title": "criterion soft_beam_search (--criterion soft_beam_search)",
                             "options": options_of(SoftBeamSearchConfig), "notes": ""},
        "softtopk_lstm": {"title": "model softtopk_lstm", "options": options_of(SoftTopKLSTMConfig),
                          "notes": f"--arch: {archs(SoftTopKLSTMModel)}"},
        "softtopk_transformer": {"title": "model softtopk_transformer", "options": options_of(SoftTopKAttentionConfig),
                                 "notes": f"--arch: {archs(SoftTopKTransformerModel)}; plus fairseq's Transformer "
                                          "options (fairseq-train --arch transformer --help)"},
    }


def render(found: Dict[str, dict], fmt: str) -> str:
    headings = {"main": "", "advanced": "advanced (experiments and tuning)",
                "deprecated": "deprecated names (still accepted, with a warning)"}
    lines = []
    for comp in found.values():
        if fmt == "markdown":
            lines += [f"### {comp['title']}", ""] + ([comp["notes"], ""] if comp["notes"] else [])
        else:
            lines += [comp["title"]] + ([f"  {comp['notes']}"] if comp["notes"] else [])
        for kind, heading in headings.items():
            options = [o for o in comp["options"] if o.kind == kind]
            if not options:
                continue
            if fmt == "markdown":
                lines += ([f"{heading[0].upper()}{heading[1:]}:", ""] if heading else [])
                lines += ["| option | default | meaning |", "|---|---|---|"]
                lines += [f"| `{o.flag}` | {o.default} | {o.help.replace('|', '/')} |" for o in options] + [""]
            else:
                lines += [f"  {heading}:"] if heading else []
                for o in options:
                    lines.append(f"  {o.flag}" + (f" (default: {o.default})" if kind != "deprecated" else ""))
                    if o.help:
                        lines.append(f"      {o.help}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["text", "markdown"], default="text")
    parser.add_argument("--component", action="append",
                        help="soft_beam_search, softtopk_lstm or softtopk_transformer (repeatable; default: all)")
    parser.add_argument("--user-dir", action="store_true",
                        help="print the absolute directory to pass to fairseq's --user-dir, and nothing else")
    opts = parser.parse_args(argv)
    if opts.user_dir:  # the installed package's directory: works from any working directory
        import fairseq_softtopk

        print(os.path.dirname(os.path.abspath(fairseq_softtopk.__file__)))
        return 0
    exit_unless_installed(parser, "fairseq")  # one line naming the extra, before anything imports it
    found = components()
    if opts.component:
        unknown = [c for c in opts.component if c not in found]
        if unknown:
            parser.error(f"unknown components {unknown}; choose from {list(found)}")
        found = {name: found[name] for name in opts.component}
    sys.stdout.write(render(found, opts.format))
    return 0


if __name__ == "__main__":
    sys.exit(main())
