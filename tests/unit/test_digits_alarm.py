"""The reward-hacking alarm on the digits world, end to end through the CLI (shrunk: one prompt group per step, the
digit-3 prompts of each evaluation set, an evaluation after every step).

* The planted hack (recipes/ablations/digits_hackable_reward.yaml: trained on digits-brightness), sped up with a
  larger learning rate and no KL: the alarm must fire at the first evaluation with a full window and stop the run.
* The README main job with the alarm (recipes/ablations/digits_alarm.yaml): it must stay silent.

The full-length, three-seed measurement of both is in docs/benchmarks.md ("Reward-hacking alarm").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpost.apps.cli import main

ROOT = Path(__file__).resolve().parents[2]
SHRINK = [
    "--run.groups_per_step", "1",
    "--optimizer.init_args.minibatch_edges", "39",
    "--eval.every", "1",
    "--eval.save_images", "false",
    "--run.progress", "false",
    "--model.pretrained", str(ROOT / "assets" / "digits-sd3"),
    *[arg for s in ("heldout", "rl", "pretrain") for arg in (f"--eval.sets.{s}.init_args.digits", "[3]")],
]  # fmt: skip


def _train(out: Path, overlay: str, *more: str) -> list[dict]:
    recipes = ["--recipe", str(ROOT / "recipes" / "treegrpo_digits.yaml"), "--recipe", str(ROOT / overlay)]
    assert main(["train", *recipes, "--run.output_dir", str(out), *SHRINK, *more]) == 0
    return [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_alarm_fires_on_the_planted_brightness_hack(tmp_path: Path) -> None:
    out = tmp_path / "hack"
    fast = ["--run.max_steps", "6", "--torch_optimizer.init_args.lr", "0.03", "--optimizer.init_args.kl_coef", "0.0"]
    evals = _train(out, "recipes/ablations/digits_hackable_reward.yaml", *fast)
    fired = [e["alarm"] for e in evals if e["alarm"]["active"]]
    assert fired, [e["alarm"] for e in evals]
    step = fired[0]["step"]
    assert step <= 4, step  # window 3, an evaluation per step: step 2 at the earliest
    assert evals[-1]["step"] == step  # stopped there
    assert json.loads((out / "summary.json").read_text())["status"] == "stopped"
    # The demo reward rose while the independent judge fell: the hack the alarm is there to catch.
    first, last = evals[0], evals[-1]
    assert last["eval/heldout/digits-brightness"] > first["eval/heldout/digits-brightness"] + 0.05
    assert last["eval/heldout/judge/digit-judge"] < first["eval/heldout/judge/digit-judge"] - 0.1
    assert json.loads((out / "report" / "summary.json").read_text())["alarm"]["fired_step"] == step


@pytest.mark.slow
def test_alarm_stays_silent_on_the_main_job(tmp_path: Path) -> None:
    evals = _train(tmp_path / "main", "recipes/ablations/digits_alarm.yaml", "--run.max_steps", "4")
    assert [e["step"] for e in evals] == [0, 1, 2, 3, 4]
    assert not any(e["alarm"]["fired"] for e in evals), [e["alarm"]["reasons"] for e in evals]
    assert json.loads((tmp_path / "main" / "summary.json").read_text())["status"] == "completed"
