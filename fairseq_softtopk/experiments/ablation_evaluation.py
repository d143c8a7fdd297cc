"""Scoring the runs of the beam-search training ablation (:mod:`.ablation_runner`): each finished run's
checkpoint (``eval.checkpoint``: last or best) on every eval subset, with the raw references where they are
line-aligned, at the length penalty that scores best on valid where ``eval.lenpen_grid`` gives a choice (and,
with ``eval.fixed_lenpens``, the subsets other than valid also at each of those, untuned); cached in the run's
``eval.json``."""

import json
import logging
import shutil
from pathlib import Path
from typing import Dict, Mapping, Optional

from .ablation_config import eval_settings, flags_to_args
from .ablation_training import DONE, write_json_atomic
from .checkpoint_integrity import checkpoint_digest, verify_run_checkpoint

logger = logging.getLogger("ablation")

EVAL = "eval.json"


def subset_size(data_bin: Path, subset: str, src: str, tgt: str) -> int:
    """Sentences of the binarised ``subset`` (:func:`.scoring.binarised_subset_size`), which must exist."""
    from .scoring import binarised_subset_size

    size = binarised_subset_size(str(data_bin), subset, src, tgt)
    if size is None:
        raise FileNotFoundError(f"{data_bin} has no binarised '{subset}' subset "
                                f"({Path(data_bin) / f'{subset}.{src}-{tgt}.{tgt}'}.idx)")
    return size


def reference_file(ref_dir: Optional[Path], subset: str, tgt: str, n_sentences: int) -> Optional[str]:
    """The raw reference of ``subset`` if it is line-aligned with the binarised subset, else None
    (the evaluation then scores against the binarised target)."""
    if ref_dir is None:
        return None
    path = ref_dir / f"{subset}.{tgt}"
    if not path.is_file():
        logger.warning("no raw reference %s: scoring %s against the binarised target", path, subset)
        return None
    with open(path, encoding="utf-8") as f:
        n_lines = sum(1 for _ in f)
    if n_lines != n_sentences:
        logger.warning("%s has %d lines but the binarised %s subset %d sentences (cleaned?): scoring against "
                       "the binarised target instead", path, n_lines, subset, n_sentences)
        return None
    return str(path)


def _score_subsets(checkpoint: Path, out_dir: Path, data_bin: Path, ref_dir: Optional[Path], eval_cfg: Mapping,
                   pair: tuple, name: Path) -> dict:
    """``{subset: scores}`` of ``checkpoint`` on every eval subset (hypotheses in ``out_dir/{subset}.hyp``);
    ``name``: what the log lines and errors call it (a run directory, or the checkpoint). A subset wanted at
    several length penalties (the grid on valid; the chosen one and ``fixed_lenpens`` on the others) is decoded
    once (:func:`.scoring.evaluate_checkpoint_at_lenpens`).

    Raises:
        RuntimeError: fewer sentences were translated than the subset holds.
    """
    from .scoring import evaluate_checkpoint, evaluate_checkpoint_at_lenpens, output_length

    generate = flags_to_args(eval_cfg.get("generate") or {})

    def score(subset: str, hyp_names: Mapping[Optional[float], str]) -> Dict[Optional[float], dict]:
        """``{lenpen: scores}`` of ``subset`` at each length penalty of ``hyp_names`` (``{lenpen: hypothesis
        file}``; lenpen None: fairseq-generate's default)."""
        n = subset_size(data_bin, subset, *pair)
        lenpens = list(hyp_names)
        at = "" if lenpens == [None] else f" at lenpen {', '.join(map(str, lenpens))}"
        logger.info("evaluating %s on %s (%d sentences)%s", name, subset, n, at)
        common = dict(subset=subset, beam=eval_cfg.get("beam", 5), batch_size=eval_cfg.get("batch_size"),
                      post_process=eval_cfg.get("post_process"), detok_lang=eval_cfg.get("detok_lang"),
                      keep_hypotheses=True)
        ref = reference_file(ref_dir, subset, pair[1], n)
        if len(lenpens) == 1:
            lenpen = lenpens[0]
            results = {lenpen: evaluate_checkpoint(
                str(data_bin), str(checkpoint), ref, hyp_out=str(out_dir / hyp_names[lenpen]),
                extra_args=generate + ([] if lenpen is None else ["--lenpen", str(lenpen)]), **common)}
        else:
            results = evaluate_checkpoint_at_lenpens(
                str(data_bin), str(checkpoint), ref, lenpens,
                hyp_outs={value: str(out_dir / hyp_name) for value, hyp_name in hyp_names.items()},
                extra_args=generate, **common)
        for result in results.values():
            if result["n_sentences"] != n:  # the T- lines can miss dropped inputs too
                raise RuntimeError(f"{name}: {result['n_sentences']} of the {n} {subset} sentences were translated")
        return results

    grid = eval_cfg.get("lenpen_grid")
    fixed = eval_cfg.get("fixed_lenpens")
    tuned, lenpen = {}, None
    if grid:  # each length penalty on valid; the best BLEU wins, a tie going to the one nearest fairseq's 1.0
        tuned = score("valid", {value: f"valid.lenpen{value}.hyp" for value in grid})
        lenpen = max(grid, key=lambda value: (tuned[value]["bleu"], -abs(value - 1.0)))
        logger.info("%s: lenpen %s scores best on valid (%s)", name, lenpen,
                    ", ".join(f"{value}: {tuned[value]['bleu']:.2f}" for value in grid))
        shutil.copyfile(out_dir / f"valid.lenpen{lenpen}.hyp", out_dir / "valid.hyp")
    subsets = {}
    for subset in eval_cfg.get("subsets") or ["valid", "test"]:
        if subset == "valid" and grid:
            subsets[subset] = dict(tuned[lenpen])
        elif subset != "valid" and fixed:  # untuned too: does the comparison hang on the choice?
            chosen = 1.0 if lenpen is None else lenpen  # fairseq-generate's default when none is chosen
            results = score(subset, {chosen: f"{subset}.hyp",
                                     **{value: f"{subset}.lenpen{value}.hyp" for value in fixed if value != chosen}})
            subsets[subset] = dict(results[chosen])
            subsets[subset]["at_lenpen"] = {
                str(value): {**{metric: results[value][metric] for metric in ("bleu", "chrf")},
                             **output_length(results[value]["hypotheses"], results[value]["references"])}
                for value in fixed}
        else:
            subsets[subset] = score(subset, {lenpen: f"{subset}.hyp"})[lenpen]
        if grid:
            subsets[subset]["lenpen"] = lenpen
            subsets[subset]["lenpen_valid_bleu"] = {str(value): tuned[value]["bleu"] for value in grid}
    return subsets


def _fill_fixed_lenpen_lengths(run_dir: Path, subsets: dict) -> bool:
    """Adds the output's length (:func:`.scoring.output_length`) to the ``at_lenpen`` scores of an ``eval.json``
    written before they carried it, from the run's hypothesis files where they are still there and score as
    recorded; returns whether any was added."""
    from .scoring import output_length, score

    filled = False
    for subset, entry in subsets.items():
        for value, result in (entry.get("at_lenpen") or {}).items():
            chosen = entry.get("lenpen", 1.0)
            path = run_dir / (f"{subset}.hyp" if float(value) == float(chosen) else f"{subset}.lenpen{value}.hyp")
            if "length_ratio" in result or not path.is_file() or "references" not in entry:
                continue
            hypotheses = path.read_text(encoding="utf-8").split("\n")[:-1]
            if len(hypotheses) != len(entry["references"]) or \
                    score(hypotheses, entry["references"])["bleu"] != result["bleu"]:
                logger.warning("%s does not score as %s's recorded lenpen %s: its length is left out", path,
                               subset, value)
                continue
            result.update(output_length(hypotheses, entry["references"]))
            filled = True
    return filled


def evaluate_run(run_dir: Path, data_bin: Path, ref_dir: Optional[Path], eval_cfg: Mapping, pair: tuple) -> dict:
    """Scores ``run_dir/checkpoint_last.pt`` (``checkpoint_best.pt`` with ``eval.checkpoint: best``) on every
    eval subset; cached in ``eval.json`` (a cached score needs no checkpoint). Before scoring, the checkpoint
    is checked against the digest in ``done.json`` (``CheckpointChanged`` where it differs;
    :mod:`.checkpoint_integrity`)."""
    settings = eval_settings(eval_cfg)
    cache = run_dir / EVAL
    # the training run it scores, by done.json's finishing time: a copy of the run directory
    # without checkpoints (results/ in git) keeps its scores
    trained = json.loads((run_dir / DONE).read_text()).get("finished")
    if cache.exists():
        cached = json.loads(cache.read_text())
        same_run = cached.get("trained") == trained if "trained" in cached else \
            cached.get("done_mtime") == (run_dir / DONE).stat().st_mtime  # caches written before "trained"
        if cached.get("settings") == settings and same_run:
            filled = _fill_fixed_lenpen_lengths(run_dir, cached["subsets"])
            if "trained" not in cached or filled:
                write_json_atomic(cache, {"settings": settings, "trained": trained, "subsets": cached["subsets"]})
            return cached["subsets"]
    checkpoint = verify_run_checkpoint(run_dir, f"checkpoint_{eval_cfg.get('checkpoint') or 'last'}.pt")
    subsets = _score_subsets(checkpoint, run_dir, data_bin, ref_dir, eval_cfg, pair, run_dir)
    write_json_atomic(cache, {"settings": settings, "trained": trained, "subsets": subsets})
    return subsets


def evaluate_pretrained(checkpoint: Path, out_dir: Path, data_bin: Path, ref_dir: Optional[Path], eval_cfg: Mapping,
                        pair: tuple) -> dict:
    """Scores a given teacher-forcing checkpoint (``pretrained=``) as :func:`evaluate_run` scores a
    run: the scores are cached in ``out_dir/eval.json`` under the checkpoint's SHA-256 (a changed
    file is scored again). Returns ``{subset: scores}``."""
    settings = eval_settings(eval_cfg)
    digest = checkpoint_digest(checkpoint)
    cache = out_dir / EVAL
    if cache.exists():
        cached = json.loads(cache.read_text())
        if cached.get("settings") == settings and cached.get("sha256") == digest:
            if _fill_fixed_lenpen_lengths(out_dir, cached["subsets"]):
                write_json_atomic(cache, {**cached, "subsets": cached["subsets"]})
            return cached["subsets"]
    out_dir.mkdir(parents=True, exist_ok=True)
    subsets = _score_subsets(checkpoint, out_dir, data_bin, ref_dir, eval_cfg, pair, checkpoint)
    write_json_atomic(cache, {"settings": settings, "sha256": digest, "subsets": subsets})
    return subsets


def chosen_lenpen(subsets: Mapping[str, dict]) -> Optional[float]:
    """The length penalty a run's scores were decoded at where the config chose it on valid (``lenpen_grid``);
    None where the config's generation flags set it (or leave fairseq's default)."""
    return next((entry["lenpen"] for entry in subsets.values() if "lenpen" in entry), None)


def translate_scored_run(run_dir: Path, subsets: Mapping[str, dict], eval_cfg: Mapping, sources: Mapping[str, Path],
                         bpe_dir: Path, data_bin: Path, pair: tuple) -> Optional[dict]:
    """Translates ``sources`` (:func:`.source_translation.source_files`) with the checkpoint a finished run was
    scored with, at the length penalty it chose (:func:`.source_translation.translate_run`; checked against
    ``done.json``'s digest first). A run without that checkpoint (restored from records, which keep none) and
    without its translations is skipped with a warning; returns ``translations.json``'s contents, or None then."""
    from .source_segmentation import corpus_segmenter
    from .source_translation import TRANSLATIONS_JSON, translate_run

    name = f"checkpoint_{eval_cfg.get('checkpoint') or 'last'}.pt"
    if not (run_dir / name).is_file():
        recorded = run_dir / TRANSLATIONS_JSON
        if recorded.is_file() and set(json.loads(recorded.read_text())) >= set(sources):
            return json.loads(recorded.read_text())
        logger.warning("%s has no %s to translate %s with (a run restored from records?): not translated", run_dir,
                       name, ", ".join(sources))
        return None
    checkpoint = verify_run_checkpoint(run_dir, name)
    return translate_run(run_dir, checkpoint, checkpoint_digest(checkpoint), chosen_lenpen(subsets), sources,
                         corpus_segmenter(bpe_dir, pair[0]), data_bin, eval_cfg, pair)
