"""The end-of-run report (rlpost.apps.reporting): reward plot and before/after grid from a run directory's files."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from PIL import Image

from rlpost.apps import reporting
from rlpost.apps.host import DEFAULT_PLUGINS
from rlpost.ops.images import save_images

PROMPTS = ["a picture of the digit three", "the handwritten number 7", "a two drawn by hand"]


def _fake_run(run_dir: Path, evals: tuple[int, ...] = (0, 2)) -> None:
    """The files a 2-step run with held-out evaluation leaves (shapes as rlpost.engine.runner / .evaluation write)."""
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.jsonl").open("w") as fh:
        for step, r in ((1, 0.6), (2, 0.7)):
            fh.write(json.dumps({"step": step, "reward/digit-alignment": r, "reward/weighted": r}) + "\n")
    with (run_dir / "eval.jsonl").open("w") as fh:
        for k, step in enumerate(evals):
            scores = [0.2 + 0.3 * k + 0.1 * i for i in range(len(PROMPTS))]
            per_prompt = [
                {"prompt": p, "seed": 1000 + i, "digit-alignment": s}
                for i, (p, s) in enumerate(zip(PROMPTS, scores, strict=True))
            ]
            fh.write(
                json.dumps(
                    {"step": step, "num_steps": 10, "eval/digit-alignment": sum(scores) / 3, "per_prompt": per_prompt}
                )
                + "\n"
            )
            images = torch.full((len(PROMPTS), 16, 16, 3), 40 * (k + 1), dtype=torch.uint8)
            save_images(images, run_dir / "eval" / f"step_{step:06d}")


def test_write_report_makes_plot_grid_and_summary(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run)
    summary = reporting.write_report(run)
    assert sorted(summary["files"]) == ["report/before_after.png", "report/reward_vs_step.png"]
    plot = Image.open(run / "report" / "reward_vs_step.png")
    assert plot.size[0] > 300 and plot.size[1] > 200
    grid = Image.open(run / "report" / "before_after.png")
    # 3 pairs -> 6 tiles in one row, each upscaled to 128 px plus its caption band.
    assert grid.size == (6 * 128, 128 + 3 * 12 + 4)
    held = summary["heldout"]["digit-alignment"]
    assert held["before_step"] == 0 and held["after_step"] == 2
    assert abs(held["delta"] - 0.3) < 1e-9
    assert summary["train"]["weighted"] == {"first": 0.6, "last": 0.7}
    assert json.loads((run / "report" / "summary.json").read_text())["steps"] == 2


SETS = {"heldout": PROMPTS, "pretrain": [f"a handwritten digit {d}" for d in range(7)]}


def _fake_sets_run(run_dir: Path, evals: tuple[int, ...] = (0, 4)) -> None:
    """A run with named evaluation sets and a second judge (as rlpost.engine.evaluation writes it)."""
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "reward/weighted": 0.9}) + "\n")
    with (run_dir / "eval.jsonl").open("w") as fh:
        for k, step in enumerate(evals):
            record: dict = {"step": step, "num_steps": 10, "sets": list(SETS), "judges": ["digit-judge"]}
            rows = []
            for s, (name, prompts) in enumerate(SETS.items()):
                reward, judge = 0.5 + 0.2 * k + 0.1 * s, 0.5 + 0.05 * k  # the judge barely moves: reward hacking
                record[f"eval/{name}/digit-alignment"] = reward
                record[f"eval/{name}/judge/digit-judge"] = judge
                rows += [
                    {"set": name, "prompt": p, "seed": 1000 + i, "digit-alignment": reward, "judge/digit-judge": judge}
                    for i, p in enumerate(prompts)
                ]
                images = torch.full((len(prompts), 16, 16, 3), 40 * (k + 1) + s, dtype=torch.uint8)
                save_images(images, run_dir / "eval" / name / f"step_{step:06d}")
            fh.write(json.dumps(record | {"per_prompt": rows}) + "\n")


def test_report_shows_each_set_and_judge(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_sets_run(run)
    summary = reporting.write_report(run)
    assert summary["sets"] == ["heldout", "pretrain"] and summary["judges"] == ["digit-judge"]
    assert list(summary["heldout"]) == [
        "heldout/digit-alignment",
        "heldout/judge/digit-judge",
        "pretrain/digit-alignment",
        "pretrain/judge/digit-judge",
    ]
    assert abs(summary["heldout"]["pretrain/digit-alignment"]["delta"] - 0.2) < 1e-9
    assert abs(summary["heldout"]["heldout/judge/digit-judge"]["delta"] - 0.05) < 1e-9
    assert sorted(summary["files"]) == ["report/before_after.png", "report/reward_vs_step.png"]
    # 15 pairs per set (30 shared by two sets, whole rows): heldout has 3 prompts -> one padded row of 5 pairs;
    # pretrain has 7 -> two rows. Three rows of 10 tiles.
    grid = Image.open(run / "report" / "before_after.png")
    assert grid.size == (10 * 128, 3 * (128 + 3 * 12 + 4))
    cell = 128 + 3 * 12 + 4
    pixels = grid.convert("RGB")
    assert pixels.getpixel((3 * 128 + 5, 5)) == (80, 80, 80)  # heldout, pair 2 "after" (k=1: 40*2 + set 0)
    assert pixels.getpixel((6 * 128 + 5, 5)) == (255, 255, 255)  # padding: pretrain starts on the next row
    assert pixels.getpixel((1 * 128 + 5, cell + 5)) == (81, 81, 81)  # pretrain, pair 1 "after"
    assert reporting._label("eval/heldout/judge/digit-judge") == "heldout: judge digit-judge"
    assert reporting._label("eval/digit-alignment") == "held-out digit-alignment"


def test_grid_needs_two_evaluations_and_images(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run, evals=(0,))
    assert reporting.before_after_grid(run, run / "g.png") is None
    assert reporting.write_report(run)["files"] == ["report/reward_vs_step.png"]


def test_hook_is_registered_and_skips_non_main_ranks(tmp_path: Path) -> None:
    assert reporting in DEFAULT_PLUGINS
    run = tmp_path / "run"
    _fake_run(run)
    reporting.rlpost_after_run(run=SimpleNamespace(is_main_process=False, output_dir=run), status="completed")
    assert not (run / "report").exists()
    reporting.rlpost_after_run(run=SimpleNamespace(is_main_process=True, output_dir=run), status="completed")
    assert (run / "report" / "before_after.png").is_file()


def test_missing_matplotlib_skips_the_plot_with_a_warning(tmp_path: Path, monkeypatch: object) -> None:
    run = tmp_path / "run"
    _fake_run(run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # type: ignore[attr-defined]  # import now fails
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reporting.rlpost_after_run(run=SimpleNamespace(is_main_process=True, output_dir=run), status="completed")
    assert any("matplotlib is not installed" in str(w.message) for w in caught)
    assert not (run / "report" / "reward_vs_step.png").exists()
    assert (run / "report" / "before_after.png").is_file()


def test_hook_never_raises(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval.jsonl").write_text('{"step": 0, "eval/r": 0.5, "per_prompt": [{"prompt": "x"}]}\n{"step": 1}\n')
    (run / "eval").write_text("not a directory")  # image loading will fail
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        reporting.rlpost_after_run(run=SimpleNamespace(is_main_process=True, output_dir=run), status="failed")


def test_reward_plot_has_integer_step_ticks(tmp_path: Path, monkeypatch: object) -> None:
    import matplotlib.pyplot as plt

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/weighted": 0.1 * s}) + "\n" for s in (1, 2, 3))
    )
    figures: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # type: ignore[attr-defined]
    try:
        assert reporting.plot_rewards(run, tmp_path / "plot.png") is not None
        (fig,) = figures
        fig.canvas.draw()
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        shown = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert shown and all(float(t).is_integer() for t in shown), shown
        labels = [t.get_text().replace("\u2212", "-") for t in ax.get_xticklabels() if t.get_text()]
        assert labels and all(label.lstrip("-").isdigit() for label in labels), labels
        assert {1, 2, 3} <= {int(t) for t in shown}
    finally:
        for fig in figures:
            close(fig)
