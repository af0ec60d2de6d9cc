"""End-of-run report: a reward-vs-step plot and a before/after grid of the held-out samples (a core lifecycle plugin).

Registered through :data:`rlpost.apps.host.DEFAULT_PLUGINS`. At ``rlpost_after_run`` the main process reads what the run
already wrote and adds ``report/`` to the run directory::

    report/reward_vs_step.png   training reward (metrics.jsonl) and every held-out reward and judge (eval.jsonl)
                                against the step, one colour per evaluation set, judges dashed
    report/before_after.png     held-out prompts' first-evaluation samples next to their last-evaluation ones, set
                                by set, captioned with the prompt, the reward and the first judge's score (a video
                                sample as its frame strip)
    report/before_after/*.gif   video runs: per shown prompt, the first-evaluation clip left of the last one
    report/summary.json         before/after per evaluation set and reward or judge, training reward first/last,
                                and the reward-hacking alarm (``eval.alarm``, :mod:`rlpost.engine.evaluation.alarm`)
                                when enabled

It works from files only (``metrics.jsonl``, ``eval.jsonl``, ``eval/[<set>/]step_N/*.png`` written by
:mod:`rlpost.engine.evaluation` with ``save_images: true``), so the same functions rebuild a report for any finished run
(``python -m rlpost.apps.reporting RUN_DIR``). A report must never break a run: every failure becomes a warning, and the
plot is skipped (with a warning) when matplotlib is not installed.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from rlpost.core.context import RunContext
from rlpost.core.hookspecs import hookimpl
from rlpost.engine.evaluation import JUDGE, eval_columns, eval_sets, image_dir, metric_key
from rlpost.ops.images import agg_pyplot, save_figure, save_gif, save_grid

__all__ = [
    "REPORT_DIR",
    "alarm_summary",
    "before_after_grid",
    "plot_rewards",
    "read_jsonl",
    "report_summary",
    "rlpost_after_run",
    "write_report",
]

REPORT_DIR = "report"
# Before/after pairs shown in the grid (shared by the evaluation sets): enough to cover all ten digits of one
# template, small enough to read.
MAX_PAIRS = 30
PAIRS_PER_ROW = 5


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSONL file (empty when the file is absent); a torn last line (killed run) is ignored."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _eval_keys(evals: Sequence[dict[str, Any]]) -> list[str]:
    """Every ``eval/*`` metric, set by set (recipe order), rewards before judges."""
    return [k for name in eval_sets(evals) for k in eval_columns(evals, name)]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(float(value))


def report_summary(run_dir: Path) -> dict[str, Any]:
    """Held-out scores at the first and last evaluation and training reward at the first and last logged step.

    Returns:
        ``{"heldout": {key: {"before_step", "before", "after_step", "after", "delta"}}, "sets": [...],
        "judges": [...], "train": {...}, "steps": N}``. ``key`` is the metric name without ``eval/``:
        ``<reward>``/``judge/<judge>`` for a single prompt source, ``<set>/<reward>``/``<set>/judge/<judge>`` with
        named sets (``sets`` lists them, empty otherwise); sections are empty when the run logged nothing of that kind.
    """
    evals = read_jsonl(run_dir / "eval.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    heldout: dict[str, dict[str, float]] = {}
    if evals:
        first, last = evals[0], evals[-1]
        for key in _eval_keys(evals):
            if _finite(first.get(key)) and _finite(last.get(key)):
                heldout[key.removeprefix("eval/")] = {
                    "before_step": float(first["step"]),
                    "before": float(first[key]),
                    "after_step": float(last["step"]),
                    "after": float(last[key]),
                    "delta": float(last[key]) - float(first[key]),
                }
    train: dict[str, dict[str, float]] = {}
    reward_keys = sorted({k for m in metrics for k in m if k.startswith("reward/")})
    for key in reward_keys:
        values = [(m["step"], m[key]) for m in metrics if _finite(m.get(key))]
        if values:
            train[key.removeprefix("reward/")] = {"first": float(values[0][1]), "last": float(values[-1][1])}
    summary: dict[str, Any] = {
        "steps": int(metrics[-1]["step"]) if metrics else 0,
        "heldout": heldout,
        "sets": [n for n in eval_sets(evals) if n] if evals else [],
        "judges": evals[-1].get("judges", []) if evals else [],
        "train": train,
    }
    alarm = alarm_summary(evals)
    if alarm is not None:
        summary["alarm"] = alarm
    return summary


def alarm_summary(evals: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The reward-hacking alarm's outcome (``None`` when the run had no ``eval.alarm``): the step it first fired at
    (``None`` if it never did) and its reasons at that evaluation (:mod:`rlpost.engine.evaluation.alarm`)."""
    records = [r["alarm"] for r in evals if isinstance(r.get("alarm"), dict)]
    if not records:
        return None
    first = next((r for r in records if r.get("active")), None)
    return {
        "enabled": True,
        "fired_step": None if first is None else first.get("step"),
        "reasons": [] if first is None else list(first.get("reasons", [])),
    }


def _label(key: str) -> str:
    """Legend label of an eval metric: ``held-out <reward>`` or ``<set>: <reward>``, judges marked as such."""
    rest = key.removeprefix("eval/")
    name, _, scorer = rest.partition("/") if "/" in rest and not rest.startswith(f"{JUDGE}/") else ("", "", rest)
    scorer = scorer.replace(f"{JUDGE}/", "judge ", 1)
    return f"{name}: {scorer}" if name else f"held-out {scorer}"


def plot_rewards(run_dir: Path, out: Path, title: str | None = None) -> Path | None:
    """Plot training reward (every logged step, plus a running mean) and held-out reward (each evaluation).

    Args:
        run_dir: A run directory with ``metrics.jsonl`` and/or ``eval.jsonl``.
        out: The PNG to write.
        title: Plot title (default: the run directory's name).

    Returns:
        ``out``, or ``None`` when there is nothing to plot or matplotlib is not installed (a warning says which).
    """
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    if not metrics and not evals:
        return None
    plt = agg_pyplot("rlpost report: matplotlib is not installed; skipping the reward plot")
    if plt is None:
        return None
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=110)
    try:
        train_key = "reward/weighted"
        steps = [int(m["step"]) for m in metrics if _finite(m.get(train_key))]
        values = [float(m[train_key]) for m in metrics if _finite(m.get(train_key))]
        if steps:
            # A short running mean: per-step training rewards are noisy (TreeGRPO's window start changes the leaves).
            window = max(1, min(5, len(values) // 4))
            if window == 1:
                ax.plot(steps, values, color="tab:blue", linewidth=1.5, label="training reward")
            else:
                ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1.0, label="training reward (per step)")
                smooth = [
                    sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1))
                    for i in range(len(values))
                ]
                ax.plot(steps, smooth, color="tab:blue", linewidth=2.0, label=f"training reward (mean of {window})")
        # One colour per evaluation set; the training reward solid with circles, second judges dashed with squares.
        for i, name in enumerate(eval_sets(evals)):
            judge_prefix = metric_key(name, "", judge=True)
            for key in eval_columns(evals, name):
                pts = [(int(r["step"]), float(r[key])) for r in evals if _finite(r.get(key))]
                if not pts:
                    continue
                is_judge = key.startswith(judge_prefix)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="s" if is_judge else "o",
                    linestyle="--" if is_judge else "-",
                    color=f"C{(i + 1) % 10}",
                    linewidth=1.5 if is_judge else 2.0,
                    label=_label(key),
                )
        # Steps are whole numbers: without this a short run (3 steps) gets ticks at 1.25, 1.5, ...
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        alarm = alarm_summary(evals)
        if alarm is not None and alarm["fired_step"] is not None:  # where the reward-hacking alarm fired
            ax.axvline(alarm["fired_step"], color="red", linestyle=":", linewidth=1.5, label="reward-hacking alarm")
        ax.set_xlabel("training step")
        ax.set_ylabel("reward")
        ax.set_title(title or run_dir.name)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        save_figure(fig, out)
    finally:
        plt.close(fig)
    return out


def _load_media(directory: Path, count: int, frames: int = 1) -> torch.Tensor | None:
    """The saved samples ``0000.png`` ... as ``[count, frames, H, W, 3]`` media (a PNG holds its frames stacked top to
    bottom, :func:`rlpost.ops.images.save_images`); ``None`` when one is missing."""
    paths = [directory / f"{i:04d}.png" for i in range(count)]
    if not all(p.is_file() for p in paths):
        return None
    arrays = [torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()) for p in paths]
    stacked = torch.stack(arrays)
    n, fh, w, c = stacked.shape
    return stacked.reshape(n, frames, fh // frames, w, c)


def _fmt(value: Any) -> str:
    return f"{float(value):.2f}" if value is not None and _finite(value) else "-"


def before_after_grid(run_dir: Path, out: Path, max_pairs: int = MAX_PAIRS) -> Path | None:
    """Grid of held-out images at the first evaluation next to the same prompt and seed at the last one.

    Each pair is two adjacent tiles. The first caption line is ``before step 0 r=...`` / ``after step N r=...`` (the
    first evaluation reward) or, when the run has second judges, ``before r=... j=...`` (reward and first judge);
    the prompt follows, prefixed with its set's name when there are named sets. Pairs are laid out
    :data:`PAIRS_PER_ROW` to a row; with several sets each starts a new row and they share ``max_pairs``.

    Returns:
        ``out``, or ``None`` when the run has fewer than two evaluations or their per-image PNGs are missing
        (``eval.save_images: false``).
    """
    evals = read_jsonl(run_dir / "eval.jsonl")
    if len(evals) < 2:
        return None
    first, last = evals[0], evals[-1]
    sets = eval_sets(evals)
    per_set = max(1, max_pairs // len(sets))
    if len(sets) > 1 and per_set > PAIRS_PER_ROW:
        per_set -= per_set % PAIRS_PER_ROW  # whole rows per set
    panels: list[list[tuple[torch.Tensor, str]]] = []
    for name in sets:
        panel = _pairs(run_dir, evals, name, first, last, per_set)
        if panel is None:
            return None
        panels.append(panel)
    pairs_per_row = min(PAIRS_PER_ROW, max(len(p) // 2 for p in panels))
    if pairs_per_row == 0:
        return None
    tiles: list[torch.Tensor] = []
    captions: list[str] = []
    for panel in panels:
        for tile, caption in panel:
            tiles.append(tile)
            captions.append(caption)
        if len(panels) > 1:  # pad with blank tiles so the next set starts on a new row
            while len(tiles) % (2 * pairs_per_row):
                tiles.append(torch.full_like(panel[0][0], 255))
                captions.append("")
    return save_grid(torch.stack(tiles), captions, out, ncols=2 * pairs_per_row)


def _pairs(
    run_dir: Path,
    evals: list[dict[str, Any]],
    name: str,
    first: dict[str, Any],
    last: dict[str, Any],
    max_pairs: int,
) -> list[tuple[torch.Tensor, str]] | None:
    """One set's (tile, caption) list: before/after per shown prompt; ``None`` when its images are missing."""
    columns = eval_columns(evals, name)
    judge_prefix = metric_key(name, "", judge=True)
    prefix = metric_key(name, "")
    rewards = [k.removeprefix(prefix) for k in columns if not k.startswith(judge_prefix)]
    judges = [k.removeprefix(prefix) for k in columns if k.startswith(judge_prefix)]

    def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
        return [p for p in record.get("per_prompt", []) if p.get("set", "") == name]

    per_first, per_last = rows(first), rows(last)
    n = min(len(per_first), len(per_last))
    if n == 0:
        return None
    frames = int(first.get("frames", 1))  # eval.jsonl records a video's frame count (absent: images)
    before = _load_media(image_dir(run_dir, name, int(first["step"])), n, frames)
    after = _load_media(image_dir(run_dir, name, int(last["step"])), n, frames)
    if before is None or after is None:
        return None
    reward = rewards[0] if rewards else None
    judge = judges[0] if judges else None
    # Spread the shown pairs over the whole prompt list (e.g. every template and digit) rather than its head.
    shown = sorted({round(i * (n - 1) / max(1, min(n, max_pairs) - 1)) for i in range(min(n, max_pairs))})
    out: list[tuple[torch.Tensor, str]] = []
    for i in shown:
        prompt = str(per_first[i].get("prompt", ""))
        if name:
            prompt = f"{name}: {prompt}"
        for label, rec, imgs in (("before", per_first, before), ("after", per_last, after)):
            r = rec[i].get(reward) if reward is not None else None
            if judge is not None:
                head = f"{label} r={_fmt(r)} j={_fmt(rec[i].get(judge))}"
            else:
                step = first["step"] if label == "before" else last["step"]
                head = f"{label} step {int(step)}" + (f" r={float(r):.2f}" if r is not None and _finite(r) else "")
            out.append((imgs[i], f"{head}\n{prompt}"))  # save_grid starts the prompt on its own caption line
    return out


def before_after_gifs(run_dir: Path, out_dir: Path, max_pairs: int = MAX_PAIRS) -> list[Path]:
    """For a video run: one animated GIF per shown held-out prompt, its first-evaluation clip left of its
    last-evaluation clip (``<out_dir>/<set>_<i>.gif``; the prompts of :func:`before_after_grid`). Empty for an image
    run (its grid shows everything) or when the per-sample PNGs are missing."""
    evals = read_jsonl(run_dir / "eval.jsonl")
    if len(evals) < 2 or int(evals[0].get("frames", 1)) == 1:
        return []
    first, last = evals[0], evals[-1]
    sets = eval_sets(evals)
    written: list[Path] = []
    for name in sets:
        panel = _pairs(run_dir, evals, name, first, last, max(1, max_pairs // len(sets)))
        for j in range(0, len(panel or []) - 1, 2):
            assert panel is not None
            (before, _), (after, _) = panel[j], panel[j + 1]
            side_by_side = torch.cat([before, after], dim=2)  # [F, H, 2W, 3]
            written.append(save_gif(side_by_side, out_dir / f"{name or 'eval'}_{j // 2:03d}.gif"))
    return written


def write_report(run_dir: Path) -> dict[str, Any]:
    """Write ``report/`` (plot, before/after grid, summary) for a finished run directory.

    Returns:
        The summary (see :func:`report_summary`) with ``"files"``: the paths written, relative to ``run_dir``.
    """
    report = run_dir / REPORT_DIR
    summary = report_summary(run_dir)
    files = [
        p
        for p in (
            plot_rewards(run_dir, report / "reward_vs_step.png"),
            before_after_grid(run_dir, report / "before_after.png"),
        )
        if p is not None
    ]
    files += before_after_gifs(run_dir, report / "before_after")
    summary["files"] = [str(p.relative_to(run_dir)) for p in files]
    report.mkdir(parents=True, exist_ok=True)
    (report / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@hookimpl
def rlpost_after_run(run: RunContext, status: str) -> None:
    """Write the report on the main process; never raises (a report must not mask the run's own outcome)."""
    if not run.is_main_process:
        return
    run_dir = Path(run.output_dir)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "eval.jsonl").is_file():
        return  # nothing was logged (e.g. failed during set-up): no empty report directory
    try:
        write_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - reporting is best effort by design
        warnings.warn(
            f"rlpost report: could not write {run_dir / REPORT_DIR}: {type(exc).__name__}: {exc}",
            UserWarning,
            stacklevel=2,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlpost.apps.reporting RUN_DIR [...]``: (re)write the report of finished runs."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print("usage: python -m rlpost.apps.reporting RUN_DIR [RUN_DIR ...]", file=sys.stderr)
        return 2
    for arg in args:
        summary = write_report(Path(arg))
        print(json.dumps({"run": arg, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
