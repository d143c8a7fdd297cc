"""The ablation's ``curves.png``: validation curves per arm and seed, read from the
fairseq-train logs and drawn with matplotlib (used by :mod:`.ablation_runner`)."""

from pathlib import Path
from typing import List, Sequence, Tuple

from .fairseq_commands import parse_valid_line


def read_valid_curve(log_path: Path, subset: str = "valid") -> List[dict]:
    """``[{"num_updates", "loss", "nll_loss"}]`` (and ``"bleu"`` where fairseq-train logged it: ``--eval-bleu``)
    from a fairseq-train log (``--log-format simple``), sorted by updates; a resumed run's repeated points keep
    the last value."""
    points = {}
    if not Path(log_path).exists():
        return []
    for line in Path(log_path).read_text(encoding="utf-8", errors="replace").splitlines():
        parsed = parse_valid_line(line)
        if not parsed or parsed[0] != subset:
            continue
        fields = parsed[1]
        n = int(float(fields["num_updates"]))
        points[n] = {"num_updates": n, "loss": float(fields["loss"]), "nll_loss": float(fields.get("nll_loss", "nan"))}
        if "bleu" in fields:
            points[n]["bleu"] = float(fields["bleu"])
    return [points[n] for n in sorted(points)]


def mean_over_seeds(curves: Sequence[List[dict]], key: str) -> List[Tuple[int, float]]:
    """``[(num_updates, mean of key)]`` at the updates where every seed's curve has ``key`` (a run stopped
    early, or one that did not log it there, leaves the update out rather than averaging fewer seeds)."""
    shared = None
    for points in curves:
        updates = {p["num_updates"] for p in points if key in p}
        shared = updates if shared is None else shared & updates
    if not curves or not shared:
        return []
    values = [{p["num_updates"]: p[key] for p in points if key in p} for points in curves]
    return [(n, sum(v[n] for v in values) / len(values)) for n in sorted(shared)]


#: from this many seeds on, each arm is drawn as its mean (bold) over faint per-seed curves: four line styles and
#: a legend entry per seed and arm no longer tell them apart
MEAN_FROM_SEEDS = 3


def plot_curves(work_dir: Path, arms: Sequence[str], seeds: Sequence[int], png: Path) -> str:
    """Validation NLL (teacher forced: comparable across arms) and validation loss (each arm's
    own objective; validation BLEU instead where the runs logged it) per update, every arm and seed, to ``png``
    (from :data:`MEAN_FROM_SEEDS` seeds on, each arm's mean over the seeds over its faint seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shared_start = read_valid_curve(work_dir / "pretrain" / "train.log")[-1:]
    fig, (ax_nll, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    curves = {(arm, seed): read_valid_curve(work_dir / f"seed{seed}" / arm / "train.log")
              for arm in arms for seed in seeds}
    with_bleu = any("bleu" in p for points in curves.values() for p in points)
    right_key = "bleu" if with_bleu else "loss"
    as_mean = len(seeds) >= MEAN_FROM_SEEDS
    for i, arm in enumerate(arms):
        nll_curves, right_curves = [], []
        for j, seed in enumerate(seeds):
            points = curves[arm, seed]
            # the seed's own pretrained model (pretrain_per_seed), else the shared one
            start = read_valid_curve(work_dir / f"seed{seed}" / "pretrain" / "train.log")[-1:] or shared_start
            nll = [{**start[0], "num_updates": 0}] + points if start else points
            right = [p for p in points if right_key in p]
            if points:  # a run not (yet) validated stays out of the mean
                nll_curves.append(nll)
                right_curves.append(right)
            if as_mean:
                style = dict(color=f"C{i}", linewidth=0.8, alpha=0.3)
            else:
                style = dict(color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4], marker=".",
                             label=f"{arm} (seed {seed})" if len(seeds) > 1 else arm)
            ax_nll.plot([p["num_updates"] for p in nll], [p["nll_loss"] for p in nll], **style)
            ax_loss.plot([p["num_updates"] for p in right], [p[right_key] for p in right], **style)
        if as_mean:
            for ax, key, arm_curves in ((ax_nll, "nll_loss", nll_curves), (ax_loss, right_key, right_curves)):
                mean = mean_over_seeds(arm_curves, key)
                if mean:
                    ax.plot([n for n, _ in mean], [v for _, v in mean], color=f"C{i}", linewidth=2, marker=".",
                            label=f"{arm} (mean of {len(arm_curves)} seeds)")
    pretrained = bool(shared_start) or any((work_dir / f"seed{seed}" / "pretrain").is_dir() for seed in seeds)
    xlabel = "fine-tuning updates" if pretrained else "updates"
    ax_nll.set(xlabel=xlabel + (" (0: pretrained)" if pretrained else ""), ylabel="bits/token",
               title="valid NLL, teacher forced")
    if with_bleu:
        ax_loss.set(xlabel=xlabel, ylabel="BLEU", title="valid BLEU (fairseq-train --eval-bleu)")
    else:
        ax_loss.set(xlabel=xlabel, ylabel="bits/token", title="valid loss (each arm's training objective)")
    for ax in (ax_nll, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)
