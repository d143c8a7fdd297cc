"""The ablation's ``curves.png``: validation curves per arm and seed, read from the
fairseq-train logs and drawn with matplotlib (used by :mod:`.ablation_runner`)."""

from pathlib import Path
from typing import List, Sequence

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


def plot_curves(work_dir: Path, arms: Sequence[str], seeds: Sequence[int], png: Path) -> str:
    """Validation NLL (teacher forced: comparable across arms) and validation loss (each arm's
    own objective; validation BLEU instead where the runs logged it) per update, every arm and seed, to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shared_start = read_valid_curve(work_dir / "pretrain" / "train.log")[-1:]
    fig, (ax_nll, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    curves = {(arm, seed): read_valid_curve(work_dir / f"seed{seed}" / arm / "train.log")
              for arm in arms for seed in seeds}
    with_bleu = any("bleu" in p for points in curves.values() for p in points)
    for i, arm in enumerate(arms):
        for j, seed in enumerate(seeds):
            points = curves[arm, seed]
            # the seed's own pretrained model (pretrain_per_seed), else the shared one
            start = read_valid_curve(work_dir / f"seed{seed}" / "pretrain" / "train.log")[-1:] or shared_start
            label = f"{arm} (seed {seed})" if len(seeds) > 1 else arm
            style = dict(color=f"C{i}", linestyle=("-", "--", ":", "-.")[j % 4], marker=".")
            nll = [{**start[0], "num_updates": 0}] + points if start else points
            ax_nll.plot([p["num_updates"] for p in nll], [p["nll_loss"] for p in nll], label=label, **style)
            right = [p for p in points if "bleu" in p] if with_bleu else points
            ax_loss.plot([p["num_updates"] for p in right], [p["bleu" if with_bleu else "loss"] for p in right],
                         label=label, **style)
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
