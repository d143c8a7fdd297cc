"""What a schedule's runs have done: the lines of the runner's stop message (:func:`describe_runs`) and of
``fairseq-softtopk-ablation --status`` (:func:`status_lines`, also while the runs train).

A run directory is finished when it has ``done.json`` (written once training ended) and
``eval.json`` (its scores); a ``checkpoint_last.pt`` without ``done.json`` resumes from that
checkpoint on a rerun (the update is read from fairseq's ``Saved checkpoint`` lines in
``train.log``); a directory without either starts again; no directory: not started.
"""

import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .run_lock import RunDirectoryInUse, lock_owner

_SAVED = re.compile(r"Saved checkpoint \S+ \(epoch (\d+) @ (\d+) updates")
_LOADED = re.compile(r"Loaded checkpoint \S+ \(epoch (\d+) @ (\d+) updates")
_LOGGED = re.compile(r"\| train_inner \| epoch (\d+):.*\bnum_updates=(\d+)")

Position = Tuple[int, int]  # (epoch, update)


def _reached_and_saved(log_path: Path) -> Tuple[Optional[Position], Optional[Position]]:
    """(epoch, update) the training has reached and of the last checkpoint fairseq logged as saved in
    ``log_path`` (one read), each None where there is none.

    Reached: the latest of the last ``train_inner`` line since fairseq last loaded a checkpoint (a process stopped
    past its last save logged lines that its resumed run redoes), that checkpoint, and the last save (made between
    two logged lines, it is past the last of them)."""
    if not Path(log_path).is_file():
        return None, None
    text = Path(log_path).read_text(encoding="utf-8", errors="replace")
    loads = list(_LOADED.finditer(text))
    # a fine-tuning run's first load (the pretrained model, "epoch 23 @ 0 updates") is no position of this run
    resumed_at = loads[-1].groups() if loads and loads[-1].group(2) != "0" else None
    logged = _LOGGED.findall(text[loads[-1].end():] if loads else text)[-1:]
    saved = _SAVED.findall(text)[-1:]
    candidates = [tuple(map(int, found)) for found in logged + saved + ([resumed_at] if resumed_at else [])]
    reached = max(candidates, key=lambda position: position[1], default=None)
    return reached, (tuple(map(int, saved[0])) if saved else None)


def last_saved_update(log_path: Path) -> Optional[int]:
    """The update of the last checkpoint fairseq logged as saved in ``log_path``, or None."""
    saved = _reached_and_saved(log_path)[1]
    return saved[1] if saved else None


FINISHED, TRAINED, RESUMES, RESTARTS, NOT_STARTED = "finished", "trained", "resumes", "restarts", "not started"


def stored_state(run_dir: Path) -> str:
    """What ``run_dir``'s files say, whether or not a process works in it: :data:`FINISHED` (``done.json``
    and ``eval.json``), :data:`TRAINED` (``done.json`` only: scored on the rerun), :data:`RESUMES` (a
    ``checkpoint_last.pt``), :data:`RESTARTS` (a directory without one) or :data:`NOT_STARTED`."""
    if (run_dir / "done.json").exists():
        return FINISHED if (run_dir / "eval.json").exists() else TRAINED
    if (run_dir / "checkpoint_last.pt").exists():
        return RESUMES
    return RESTARTS if run_dir.exists() else NOT_STARTED


def describe_runs(plan: Sequence[Tuple[str, Path]]) -> List[str]:
    """One line per state (finished, to be scored, will resume, will start again, not started)
    listing the runs of ``plan`` (``(label, run directory)`` in schedule order) in it."""
    names = {FINISHED: "finished", TRAINED: "trained, scored on the rerun", RESUMES: "will resume",
             RESTARTS: "will start again (stopped before its first checkpoint)", NOT_STARTED: "not started"}
    groups: Dict[str, List[str]] = {state: [] for state in names}
    for label, run_dir in plan:
        state = stored_state(run_dir)
        update = last_saved_update(run_dir / "train.log") if state == RESUMES else None
        groups[state].append(f"{label} (from update {update})" if update is not None else label)
    return [f"  {names[state]}: {', '.join(labels)}" for state, labels in groups.items() if labels]


def _scores(run_dir: Path) -> str:
    """``valid 41.12, test 38.29 BLEU (lenpen 1.6)`` from the run's ``eval.json`` (the length penalty where one
    was chosen on valid)."""
    try:
        subsets = json.loads((run_dir / "eval.json").read_text(encoding="utf-8"))["subsets"]
    except (OSError, ValueError, KeyError):
        return "scores unreadable"
    lenpens = {entry["lenpen"] for entry in subsets.values() if "lenpen" in entry}
    return (", ".join(f"{name} {entry['bleu']:.2f}" for name, entry in subsets.items() if "bleu" in entry) + " BLEU"
            + (f" (lenpen {lenpens.pop()})" if len(lenpens) == 1 else ""))


def run_state(run_dir: Path) -> str:
    """What one run has done, in words: finished (with its BLEU), trained and not yet scored, training now
    (the live process of its ``run.lock``, the last logged update and save), stopped (resumes from its last
    save), stopped before its first checkpoint, or not started."""
    run_dir = Path(run_dir)
    try:
        owner = lock_owner(run_dir)
    except RunDirectoryInUse:
        owner = {"pid": "?", "host": "another host"}
    state = stored_state(run_dir)
    if state == FINISHED:
        return f"finished: {_scores(run_dir)}"
    if state == TRAINED:
        return "trained, being scored" if owner else "trained, not scored (scored on the rerun)"
    reached, last_save = _reached_and_saved(run_dir / "train.log")
    saved = last_save[1] if last_save else None
    if owner:
        at = f"epoch {reached[0]}, update {reached[1]}" if reached else "starting"
        since = f", last save at update {saved}" if saved is not None else ", no save yet"
        return f"training (process {owner.get('pid')} on {owner.get('host')}): {at}{since}"
    if state == RESUMES:
        return f"stopped: resumes from update {saved} on the rerun" if saved is not None else \
            "stopped: resumes from its checkpoint_last.pt on the rerun"
    if state == RESTARTS:
        return "stopped before its first checkpoint: starts again on the rerun"
    return "not started"


def status_lines(plan: Sequence[Tuple[str, Path]]) -> List[str]:
    """One line per run of ``plan`` (``(label, run directory)`` in schedule order, :func:`run_state`), then
    how many have finished."""
    states = [(label, run_state(run_dir)) for label, run_dir in plan]
    width = max((len(label) for label, _ in states), default=0)
    done = sum(stored_state(run_dir) == FINISHED for _, run_dir in plan)
    return [f"  {label.ljust(width)}  {state}" for label, state in states] + [f"{done} of {len(states)} runs finished"]
