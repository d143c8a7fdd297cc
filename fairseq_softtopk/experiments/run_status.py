"""What a stopped schedule leaves behind, run by run: the lines of the runner's stop message.

A run directory is finished when it has ``done.json`` (written once training ended) and
``eval.json`` (its scores); a ``checkpoint_last.pt`` without ``done.json`` resumes from that
checkpoint on a rerun (the update is read from fairseq's ``Saved checkpoint`` lines in
``train.log``); a directory without either starts again; no directory: not started.
"""

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

_SAVED = re.compile(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates")


def last_saved_update(log_path: Path) -> Optional[int]:
    """The update of the last checkpoint fairseq logged as saved in ``log_path``, or None."""
    if not Path(log_path).is_file():
        return None
    found = _SAVED.findall(Path(log_path).read_text(encoding="utf-8", errors="replace"))
    return int(found[-1]) if found else None


def describe_runs(plan: Sequence[Tuple[str, Path]]) -> List[str]:
    """One line per state (finished, to be scored, will resume, will start again, not started)
    listing the runs of ``plan`` (``(label, run directory)`` in schedule order) in it."""
    groups: Dict[str, List[str]] = {"finished": [], "trained, scored on the rerun": [], "will resume": [],
                                    "will start again (stopped before its first checkpoint)": [], "not started": []}
    for label, run_dir in plan:
        if (run_dir / "done.json").exists():
            groups["finished" if (run_dir / "eval.json").exists() else "trained, scored on the rerun"].append(label)
        elif (run_dir / "checkpoint_last.pt").exists():
            update = last_saved_update(run_dir / "train.log")
            groups["will resume"].append(f"{label} (from update {update})" if update is not None else label)
        elif run_dir.exists():
            groups["will start again (stopped before its first checkpoint)"].append(label)
        else:
            groups["not started"].append(label)
    return [f"  {state}: {', '.join(labels)}" for state, labels in groups.items() if labels]
