"""Replay the reward-hacking alarm (:mod:`rlpost.engine.evaluation.alarm`) over finished runs, from their
``eval.jsonl`` and saved evaluation images: ``python -m rlpost.apps.alarm_replay RUN_DIR [RUN_DIR ...] [--window 3]
[--judge-drop 0.1] [--stat-drift 0.08]`` prints one JSON line per evaluation, the same records a live run writes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from rlpost.engine.evaluation import JUDGE, AlarmConfig, RewardHackingAlarm, eval_sets, image_dir, read_evals

__all__ = ["main", "replay"]


def replay(
    run_dir: Path, config: AlarmConfig, watched: Sequence[str] | None = None, judges: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Run the detector over a finished run's evaluations, in order; returns one :meth:`~RewardHackingAlarm.observe`
    record per evaluation.

    Args:
        run_dir: A run directory with ``eval.jsonl`` and per-image PNGs (``eval.save_images: true``).
        config: The alarm settings to apply.
        watched: Rewards to watch (default: the evaluation rewards the run logged as ``reward/<name>`` in training).
        judges: Judges (default: those ``eval.jsonl`` lists).

    Raises:
        FileNotFoundError: When the run has no ``eval.jsonl`` or an evaluation's images are missing.
    """
    run_dir = Path(run_dir)
    evals = read_evals(run_dir)
    if not evals:
        raise FileNotFoundError(f"{run_dir}: no eval.jsonl records to replay")
    columns = {k for r in evals for p in r.get("per_prompt", []) for k in p if k not in ("set", "prompt", "seed")}
    if watched is None:
        trained: set[str] = set()
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file():
            for line in metrics.read_text().splitlines()[:1]:
                trained = {k.removeprefix("reward/") for k in json.loads(line) if k.startswith("reward/")}
        watched = sorted(c for c in columns if c in trained)
    if judges is None:
        judges = list(evals[-1].get("judges", []))
    alarm = RewardHackingAlarm(config, watched=list(watched), judges=list(judges))
    out = []
    for record in evals:
        rows = record.get("per_prompt", [])
        scores: dict[str, list[float]] = {}
        for column in columns:
            scores[column.removeprefix(f"{JUDGE}/")] = [float(r[column]) for r in rows if column in r]
        images: list[np.ndarray] = []
        for name in eval_sets([record]):
            count = sum(1 for r in rows if r.get("set", "") == name)
            directory = image_dir(run_dir, name, int(record["step"]))
            images += [np.asarray(Image.open(directory / f"{i:04d}.png").convert("RGB")) for i in range(count)]
        groups = [(r.get("set", ""), r["prompt"]) for r in rows]
        out.append(alarm.observe(int(record["step"]), scores, torch.from_numpy(np.stack(images)), groups))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlpost.apps.alarm_replay RUN_DIR ...``: replay the alarm over finished runs; prints JSON lines."""
    parser = argparse.ArgumentParser(prog="python -m rlpost.apps.alarm_replay", description=main.__doc__)
    parser.add_argument("runs", nargs="+", type=Path)
    defaults = AlarmConfig()
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--reward-rise", type=float, default=defaults.reward_rise)
    parser.add_argument("--judge-drop", type=float, default=defaults.judge_drop)
    parser.add_argument("--stat-drift", type=float, default=defaults.stat_drift)
    args = parser.parse_args(argv)
    config = AlarmConfig(True, args.window, args.reward_rise, args.judge_drop, args.stat_drift)
    if config.problems():
        parser.error("; ".join(config.problems()))
    for run in args.runs:
        records = replay(run, config)
        for r in records:
            print(json.dumps({"run": str(run), **r}))
        fired = next((r for r in records if r["active"]), None)
        print(
            json.dumps(
                {
                    "run": str(run),
                    "summary": True,
                    "fired_step": None if fired is None else fired["step"],
                    "max_abs_stat_drift": {
                        k: max(abs(r["stat_drift"][k]) for r in records) for k in records[0]["stat_drift"]
                    },
                    "max_judge_drop": {k: max(r["judge_drop"][k] for r in records) for k in records[0]["judge_drop"]},
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
