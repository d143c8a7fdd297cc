"""Running ``fairseq-generate`` on a checkpoint and reading its output: the hypotheses (``D-`` lines) in corpus
order, the references it printed (``T-`` lines) and, for ``--nbest``, every candidate with its score and length.

Every source line must get exactly one hypothesis: fairseq-generate has been seen to drop long inputs without a
word, so a missing or duplicated id is an error, not a silently lower BLEU (:mod:`.scoring` scores what is read
here; :mod:`.source_translation` translates held-out sources with it).
"""

import re
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .child_processes import run_captured
from .eval_inputs import refused_checkpoint
from .fairseq_commands import fairseq_command, subprocess_env

_HYPOTHESIS_LINE = re.compile(r"^D-(\d+)\t([^\t]*)\t(.*)$")
_TARGET_LINE = re.compile(r"^T-(\d+)\t(.*)$")
_POSITIONAL_LINE = re.compile(r"^P-(\d+)\t(.*)$")


#: sentences per generation batch by default: on a GPU a beam-5 batch of 64 leaves it mostly idle
#: (about 22 s per 1,000 sentences on an H100, results/gpu_check); on a CPU larger batches gain little
DEFAULT_BATCH_SIZE = {"cpu": 64, "cuda": 256}


def default_batch_size() -> int:
    """:data:`DEFAULT_BATCH_SIZE` for the device fairseq-generate will run on."""
    return DEFAULT_BATCH_SIZE["cuda" if _has_cuda() else "cpu"]


def run_fairseq_generate(data_bin: str, checkpoint: str, subset: str = "test", beam: int = 5,
                         batch_size: Optional[int] = None, post_process: Optional[str] = None,
                         extra_args: Sequence[str] = ()) -> str:
    """Runs ``fairseq-generate`` with this package as ``--user-dir``; returns its stdout.

    ``batch_size`` None: :func:`default_batch_size`."""
    batch_size = batch_size or default_batch_size()
    # fairseq's main branch drops the last batch when its size is not a multiple of
    # --required-batch-size-multiple (default 8); batches are sorted by length, so the
    # longest sentences vanish silently. A multiple of 1 keeps every sentence.
    args = [data_bin, "--path", checkpoint, "--gen-subset", subset, "--beam", beam,
            "--batch-size", batch_size, "--required-batch-size-multiple", 1, "--no-progress-bar"]
    if not _has_cuda():
        args.append("--cpu")
    if post_process:
        args += ["--post-process", post_process]
    proc = run_captured(fairseq_command("generate", [*args, *extra_args]), env=subprocess_env())  # stops with the runner
    if proc.returncode != 0:
        refused = refused_checkpoint(proc.stderr)
        if refused:  # alone: the rest of the output is fairseq's config, not the cause
            raise RuntimeError(f"fairseq-generate refused the checkpoint: {refused}")
        raise RuntimeError(f"fairseq-generate failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_hypotheses(generate_stdout: str, n_sentences: int) -> List[str]:
    """Hypotheses (``D-`` lines, best beam) in corpus order.

    Raises:
        ValueError: if any id in ``[0, n_sentences)`` is missing, duplicated or out of range.
    """
    by_id: Dict[int, str] = {}
    duplicated = []
    for line in generate_stdout.splitlines():
        match = _HYPOTHESIS_LINE.match(line)
        if not match:
            continue
        idx = int(match.group(1))
        if idx in by_id:
            duplicated.append(idx)
        by_id[idx] = match.group(3)
    missing = [i for i in range(n_sentences) if i not in by_id]
    extra = sorted(i for i in by_id if not 0 <= i < n_sentences)
    if missing or duplicated or extra:
        raise ValueError(
            f"fairseq-generate returned {len(by_id)} hypotheses for {n_sentences} source lines: "
            f"missing ids {missing[:10]}{'...' if len(missing) > 10 else ''} ({len(missing)} in all), "
            f"duplicated ids {duplicated[:10]}, out-of-range ids {extra[:10]}. fairseq drops inputs longer "
            f"than --max-source-positions, and the last batch unless --required-batch-size-multiple is 1.")
    return [by_id[i] for i in range(n_sentences)]


def parse_targets(generate_stdout: str) -> List[str]:
    """The references fairseq-generate printed (``T-`` lines, after ``--post-process``) in corpus order.

    For subsets whose raw reference file is not line-aligned with the binarised data (e.g. a
    valid set that data preparation cleaned). Raises ``ValueError`` if ids are not ``0..n-1``.
    """
    by_id = {}
    for line in generate_stdout.splitlines():
        match = _TARGET_LINE.match(line)
        if match:
            by_id[int(match.group(1))] = match.group(2)
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"fairseq-generate printed target ids that are not 0..{len(by_id) - 1}")
    return [by_id[i] for i in range(len(by_id))]

def translated_ids(generate_stdout: str) -> Set[int]:
    """The ids of the sentences fairseq-generate printed a hypothesis (``D-`` line) for."""
    return {int(m.group(1)) for m in map(_HYPOTHESIS_LINE.match, generate_stdout.splitlines()) if m}


def parse_nbest(generate_stdout: str, n_sentences: int) -> List[List[Tuple[float, int, str]]]:
    """Every hypothesis of ``fairseq-generate --nbest`` per sentence, in corpus order: ``(score, length, text)``
    from its ``D-`` line (score and text) and the ``P-`` line after it (one positional score per token, EOS
    included: the length fairseq normalises by), in the order printed.

    Raises:
        ValueError: a sentence of ``[0, n_sentences)`` without hypotheses, an id out of range, or a ``D-``
            line without its ``P-`` line.
    """
    by_id: Dict[int, List[list]] = {}
    for line in generate_stdout.splitlines():
        match = _HYPOTHESIS_LINE.match(line)
        if match:
            by_id.setdefault(int(match.group(1)), []).append([float(match.group(2)), None, match.group(3)])
            continue
        match = _POSITIONAL_LINE.match(line)
        if match:
            hypotheses = by_id.get(int(match.group(1)))
            if not hypotheses or hypotheses[-1][1] is not None:
                raise ValueError(f"fairseq-generate printed a P- line of sentence {match.group(1)} without its D- line")
            hypotheses[-1][1] = len(match.group(2).split())
    missing = [i for i in range(n_sentences) if i not in by_id]
    extra = sorted(i for i in by_id if not 0 <= i < n_sentences)
    unmatched = sorted(i for i, hyps in by_id.items() if any(h[1] is None for h in hyps))
    if missing or extra or unmatched:
        raise ValueError(f"fairseq-generate --nbest: no hypotheses for ids {missing[:10]} ({len(missing)} of "
                         f"{n_sentences}), out-of-range ids {extra[:10]}, D- lines without P- lines for ids "
                         f"{unmatched[:10]}")
    return [[tuple(h) for h in by_id[i]] for i in range(n_sentences)]


def best_at_lenpen(candidates: Sequence[Tuple[float, int, str]], lenpen: float) -> str:
    """The text of the candidate ``(score, length, text)`` with the highest ``score / length ** lenpen`` (fairseq's
    normalised score); the first of a tie."""
    best = max(range(len(candidates)), key=lambda i: (candidates[i][0] / candidates[i][1] ** lenpen, -i))
    return candidates[best][2]
