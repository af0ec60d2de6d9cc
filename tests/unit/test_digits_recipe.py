"""The README's main job (recipes/treegrpo_digits.yaml) runs end to end through the CLI, shrunk to 2 iterations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpost.apps.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_treegrpo_digits_recipe_two_iterations(tmp_path: Path) -> None:
    out = tmp_path / "run"
    status = main(
        [
            "train",
            "--recipe",
            str(ROOT / "recipes" / "treegrpo_digits.yaml"),
            "--run.max_steps",
            "2",
            "--run.groups_per_step",
            "1",
            "--run.output_dir",
            str(out),
            "--run.progress",
            "false",
            "--model.pretrained",
            str(ROOT / "assets" / "digits-sd3"),
            "--eval.sets.heldout.init_args.digits",
            "[3]",
            "--eval.sets.rl.init_args.digits",
            "[3]",
            "--eval.sets.pretrain.init_args.digits",
            "[3]",
            "--optimizer.init_args.minibatch_edges",
            "39",
        ]
    )
    assert status == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(e["num_steps"] == 10 for e in evals)
    # Digit 3 in every template of each set: 4 never-trained, 3 RL-training and 6 pretraining templates.
    assert evals[0]["sets"] == ["heldout", "rl", "pretrain"] and evals[0]["judges"] == ["digit-judge"]
    counts = {s: sum(p["set"] == s for p in evals[0]["per_prompt"]) for s in evals[0]["sets"]}
    assert counts == {"heldout": 4, "rl": 3, "pretrain": 6}
    for s in ("heldout", "rl", "pretrain"):
        assert 0.0 <= evals[-1][f"eval/{s}/digit-alignment"] <= 1.0
        assert 0.0 <= evals[-1][f"eval/{s}/judge/digit-judge"] <= 1.0
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert "heldout/judge/digit-judge" in summary["heldout"] and summary["sets"] == ["heldout", "rl", "pretrain"]
    assert (out / "report" / "reward_vs_step.png").is_file()
    assert (out / "report" / "before_after.png").is_file()
    assert (out / "checkpoints" / "step_000002" / "lora" / "pytorch_lora_weights.safetensors").is_file()
