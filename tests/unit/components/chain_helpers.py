"""Helpers shared by the chain-sampler tests (DanceGRPO, MixGRPO, DDPO): hand-built chain rollouts, an end-to-end
CLI run that records the trainable weights before and after, and the rollout/evaluate/count checks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from rlpost.apps.host import build_host
from rlpost.core.api import Sampler
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.core.hookspecs import hookimpl
from rlpost.ops.sampling import RolloutBuilder


def chain_rollout(num_groups: int, per_group: int, num_steps: int, trainable: torch.Tensor) -> Rollout:
    """A hand-built chain rollout (``[S, T]`` trainable flags), states are random, images zero."""
    s = num_groups * per_group
    batch = PromptBatch([f"p{g}" for g in range(num_groups)], [{} for _ in range(num_groups)], per_group)
    builder = RolloutBuilder(batch, torch.linspace(1, 0, num_steps + 1), ["flow-sde", "ode"])
    groups = torch.arange(num_groups).repeat_interleave(per_group)
    node = builder.add_nodes(torch.randn(s, 1, 2, 2), 0, groups)
    for i in range(num_steps):
        child = builder.add_nodes(torch.randn(s, 1, 2, 2), i + 1, groups)
        for flag in (False, True):  # non-trainable edges first, so edge order differs from sample order
            rows = (trainable[:, i] == flag).nonzero().flatten()
            if rows.numel():
                builder.add_edges(node[rows], child[rows], torch.zeros(rows.numel()), flag, 0 if flag else 1)
        node = child
    return builder.build(node, torch.zeros(s, 1, 4, 4, 3, dtype=torch.uint8))


class WeightProbe:
    """Lifecycle plugin that copies the trainable parameters before the first and after the last step."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []

    @hookimpl
    def rlpost_before_run(self, run: Any) -> None:
        self.before = [p.detach().clone() for p in run.recipe.model.trainable_parameters()]

    @hookimpl
    def rlpost_after_run(self, run: Any, status: str) -> None:
        self.after = [p.detach().clone() for p in run.recipe.model.trainable_parameters()]


def train_two_iterations(recipe: str, tiny_sd3_dir: Path, out: Path) -> tuple[list[dict[str, Any]], WeightProbe]:
    """Run ``rlpost train`` for 2 steps on the tiny SD3 through the CLI; returns the metrics lines and the probe."""
    from rlpost.apps.cli import main
    from rlpost.apps.host import get_host, reset_host

    probe = WeightProbe()
    reset_host(build_host())
    get_host().register_plugin(probe, name="test-weight-probe")
    try:
        rc = main(
            [
                "train",
                "--recipe",
                recipe,
                "--model.pretrained",
                str(tiny_sd3_dir),
                "--run.output_dir",
                str(out),
                "--run.max_steps",
                "2",
            ]
        )
    finally:
        reset_host(None)
    assert rc == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return lines, probe


def check_end_to_end(lines: list[dict[str, Any]], probe: WeightProbe) -> None:
    """Two finite metric lines, ratio exactly 1 before the first update (a policy-gradient rule; a likelihood-free one
    trained rows instead), and trainable weights that moved."""
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        for key, value in line.items():
            assert value is not None and math.isfinite(value), f"metric {key} is not finite: {value}"
    if "train/first_ratio_dev" in lines[0] or lines[0]["train/edges"] > 0:  # a policy-gradient rule
        assert lines[0]["train/first_ratio_dev"] <= 1e-6
        assert lines[0]["train/edges"] > 0
    else:  # a likelihood-free rule (tree-nft) trains no edge, only rows of its own; it has no ratio
        assert lines[0]["perf/train_forwards"] > 0
    assert probe.before and len(probe.before) == len(probe.after)
    changed = sum(not torch.equal(a, b) for a, b in zip(probe.before, probe.after, strict=True))
    assert changed > 0, "no trainable parameter changed after two iterations"


def check_recipe_trains_two_steps(
    recipe: str, model_dir: Path, out: Path, model: str, class_path: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train a tiny recipe on ``model`` (its ``model.class_path``) two steps on ``model_dir`` through the CLI, check
    the run end to end and that it used ``class_path`` on that directory; returns the metrics lines and the stored
    recipe's ``model`` section."""
    import yaml

    assert yaml.safe_load(Path(recipe).read_text())["model"]["class_path"] == model
    lines, probe = train_two_iterations(recipe, model_dir, out)
    check_end_to_end(lines, probe)  # finite metrics, ratio 1 before the first update, weights moved
    stored: dict[str, Any] = yaml.safe_load((out / "recipe.yaml").read_text())["model"]
    assert stored["class_path"] == class_path  # the run really used this family
    assert stored["init_args"]["pretrained"] == str(model_dir)
    return lines, stored


def perturb_lora(policy: Any, seed: int = 0) -> None:
    """Give the LoRA B matrices random values so the adapter changes the velocity (B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def check_rollout_contract(sampler: Sampler, policy: Any, groups: int, per_group: int, seed: int = 0) -> Rollout:
    """Roll out, then check counts against SD3Policy.forward_count and that recomputed log-probs give ratio 1."""
    prompts = [f"a photo of object {g}" for g in range(groups)]
    batch = PromptBatch(prompts, [{} for _ in prompts], per_group)
    counts = sampler.counts(groups, per_group)
    policy.encode(prompts)  # encoding is not a denoiser forward, but keep it out of the count anyway
    start = policy.forward_count
    with torch.no_grad():
        rollout = sampler.rollout(policy, batch, torch.Generator().manual_seed(seed))
    assert policy.forward_count - start == counts.rollout_forwards
    assert rollout.stats["perf/rollout_forwards"] == counts.rollout_forwards
    assert rollout.num_samples == counts.images == rollout.media.shape[0]
    assert int(rollout.trainable.sum()) == counts.trainable_edges
    assert not rollout.is_branching()
    s = groups * per_group
    assert rollout.num_edges == rollout.num_nodes - s  # one edge per node except the roots
    trained = rollout.trainable.nonzero().flatten()
    assert torch.isfinite(rollout.old_log_probs[trained]).all()
    before = policy.forward_count
    evaluation = sampler.evaluate(policy, rollout, trained)
    assert policy.forward_count - before == counts.train_forwards == evaluation.forwards
    ratio = torch.exp(evaluation.log_prob.detach() - rollout.old_log_probs[trained])
    assert (ratio - 1).abs().max() <= 1e-6, f"ratio deviates from 1 by {(ratio - 1).abs().max()}"
    return rollout
