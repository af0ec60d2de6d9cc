"""The bench's plot: held-out metrics against accumulated training time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlpost.bench.aggregate import eval_keys, numeric, runs_by_algorithm
from rlpost.ops.images import agg_pyplot, save_figure

__all__ = ["plot_wallclock"]


def plot_wallclock(result: dict[str, Any], out: Path) -> Path | None:
    """Held-out metrics against accumulated training time: one panel per ``eval/`` metric, one colour per
    algorithm, one line per seed (matplotlib, Agg)."""
    plt = agg_pyplot("rlpost bench: matplotlib is not installed; skipping the plot")
    if plt is None:
        return None
    keys = eval_keys(result) or ["eval/"]
    by_algo = runs_by_algorithm(result)
    fig, axes = plt.subplots(len(keys), 1, figsize=(7.0, 3.6 * len(keys)), dpi=110, squeeze=False)
    try:
        for ax, key in zip(axes[:, 0], keys, strict=True):
            for i, (name, runs) in enumerate(by_algo.items()):
                first = runs[0]
                for j, run in enumerate(runs):
                    pts = [
                        (float(e["train_time_s"]), v) for e in run["evals"] if (v := numeric(e.get(key))) is not None
                    ]
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            marker="o",
                            markersize=2.5,
                            linewidth=1.0,
                            alpha=0.75,
                            color=f"C{i}",
                            label=f"{first['label']} [{first.get('preset', name)}]" if j == 0 else None,
                        )
            ax.set_xlabel("accumulated training time (s, evaluations excluded)")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=7)
        axes[0, 0].set_title("rlpost bench: held-out metrics vs wall clock (one line per seed)")
        save_figure(fig, out)
    finally:
        plt.close(fig)
    return out
