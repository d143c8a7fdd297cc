"""The text a user reads (README.md, docs/, results/ reports and READMEs, checkpoints/ READMEs, configs/)
names nothing only the project's own machines have: no machine paths, no ``../shared`` copies, no
references to internal work items (issue numbers or letters) or working sessions."""

import gzip
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: (what it is, pattern): each names one kind of text a user of the repository cannot follow.
FORBIDDEN = (
    # an absolute path into a home, scratch or work directory (not ".../runs/tmp/x", not a URL)
    ("a machine path", re.compile(r"(?<![\w.~:/-])/(?:work|home|root|tmp|Users)/")),
    # the project's shared directory: "../shared", "../shared/models/...", or "shared/..." as the publisher
    # leaves an absolute path into it
    ("a ../shared path", re.compile(r"\.\./shared\b|(?<![\w./-])shared/")),
    # "issue 12", "issue #12", "issues 15 and 16", "Issue 14's"
    ("an issue number", re.compile(r"\bissues? #?\d+", re.IGNORECASE)),
    # "issue C", "issue C's": one capital letter as a label ("an issue I found" is prose, so not I)
    ("an issue letter", re.compile(r"\b[Ii]ssues? #?[A-HJ-Z](?:'s)?(?=[\s.,;:)]|$)")),
    # a working session (not a name like start_new_session)
    ("a session", re.compile(r"\bsessions?\b", re.IGNORECASE)),
)


def user_documents(root):
    """The user-facing text files under ``root``, sorted: README.md, docs/**, results/**/*.md, benchmarks/*.md,
    records/**/*.md, checkpoints/**/README.md and every file of configs/."""
    found = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "results").rglob("*.md"),
             *(root / "benchmarks").glob("*.md"), *(root / "records").rglob("*.md"),
             *(root / "checkpoints").rglob("README.md"), *(p for p in (root / "configs").rglob("*") if p.is_file())]
    return sorted(p for p in found if p.is_file())


def offences(text):
    """``[(line number, kind, matched text, line)]`` for every forbidden match in ``text``."""
    return [(number, kind, match.group(0), line.strip())
            for number, line in enumerate(text.splitlines(), 1)
            for kind, pattern in FORBIDDEN for match in pattern.finditer(line)]


@pytest.mark.parametrize("text, kinds", [
    ("from `../shared/models/tf/checkpoint_best.pt`, --local ../shared", ["a ../shared path"] * 2),
    ("--pretrained shared/models/tf/checkpoint_best.pt", ["a ../shared path"]),
    ("the venv in /work/venv312 and ~/x, see /home/me/clone and (/tmp/run)", ["a machine path"] * 3),
    ("--save-dir /root/ckpt or /Users/me/data", ["a machine path"] * 2),
    ("Issue 14's ablation; issue #12; issues 15 and 16", ["an issue number"] * 3),
    ("selects nothing (issue C). As in issue C's table, issue D:", ["an issue letter"] * 3),
    ("left for a GPU session's job; in two sessions", ["a session"] * 2),
    # legitimate text
    ("report it as a GitHub issue; the issue is the length; an issue I found", []),
    ("runs/tmp/x, data/home/y, https://example.org/work/page, C:/Users/x, runs/shared/x, a shared model", []),
    ("Popen(start_new_session=True); the 2-core CPU", []),
])
def test_the_patterns_catch_machine_paths_and_work_item_references_only(text, kinds):
    assert [kind for _, kind, _, _ in offences(text)] == kinds


def test_the_user_documents_are_found():
    names = {str(p.relative_to(REPO)) for p in user_documents(REPO)}
    assert {"README.md", "docs/experiments.md", "configs/multi30k_en_de_pretrain.yaml",
            "configs/softtopk_transformer_multi30k.sh", "results/multi30k_beam_ablation/results.md",
            "results/multi30k_beam_ablation/README.md", "benchmarks/bench_train_multi30k_lstm_risk_cpu.md",
            "records/README.md", "checkpoints/multi30k_en_de_transformer_tf/README.md"} <= names


@pytest.mark.parametrize("path", user_documents(REPO), ids=lambda p: str(p.relative_to(REPO)))
def test_user_documents_name_no_machine_paths_issues_or_sessions(path):
    found = offences(path.read_text(encoding="utf-8"))
    assert not found, "\n".join(f"{path.relative_to(REPO)}:{number}: {kind} {text!r} in: {line}"
                                for number, kind, text, line in found)


def test_published_arguments_scores_and_logs_name_no_machine_paths_issues_or_sessions():
    """results/' JSON files (the configs' notes are copied there) and training logs: what the reports say, and no
    file from outside the repository (a checkpoint there is named by a placeholder its README explains)."""
    from fairseq_softtopk.experiments.publish import RUNS, read_runs_archive

    found, archived = [], 0
    for path in sorted((REPO / "results").rglob("*")):
        if path.name == RUNS:  # each run's arguments, end and log
            texts = {path / name: text for name, text in read_runs_archive(path).items()}
            archived += len(texts)
        elif path.suffix in (".json", ".gz"):
            texts = {path: (gzip.open(path, "rt", encoding="utf-8").read() if path.suffix == ".gz"
                            else path.read_text(encoding="utf-8"))}
        else:
            continue
        found += [f"{where.relative_to(REPO)}:{number}: {kind} {match!r}"
                  for where, text in texts.items() for number, kind, match, _ in offences(text)]
    assert not found, "\n".join(found[:20])
    assert archived > 300  # the runs' files were read
