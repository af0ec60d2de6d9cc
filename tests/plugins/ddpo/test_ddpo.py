"""DDPO: per-prompt stat tracker semantics (buffer, min count, global fallback, resume), the flow-SDE chain
sampler (counts vs forward_count, ratio 1) and a 2-iteration CLI run."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from rlpost.models import LoraSpec
from rlpost_ddpo.advantage import STD_EPS, PerPromptStatTracker
from rlpost_ddpo.sampler import DDPOSampler
from tests.argument_checks import problems_of
from tests.unit.components.chain_helpers import (
    chain_rollout,
    check_end_to_end,
    check_rollout_contract,
    perturb_lora,
    train_two_iterations,
)


def norm(x: float, values: list[float]) -> float:
    return (x - statistics.fmean(values)) / (statistics.pstdev(values) + STD_EPS)


def test_tracker_global_fallback_until_min_count_then_buffer() -> None:
    tracker = PerPromptStatTracker(buffer_size=3, min_count=2)
    # step 1: "a" has 1 value (< min_count) -> batch stats; "b" has 2 values -> its own buffer
    adv, fallback = tracker.update(["a", "b", "b"], torch.tensor([1.0, 2.0, 6.0]))
    batch = [1.0, 2.0, 6.0]
    assert adv.tolist() == pytest.approx([norm(1.0, batch), norm(2.0, [2.0, 6.0]), norm(6.0, [2.0, 6.0])], rel=1e-6)
    assert fallback.tolist() == [True, False, False]
    # step 2: "a" now has [1, 3] -> buffer stats; "b" buffer keeps the last 3: [2, 6, 4] -> [6, 4, 10] after 2 more
    adv, fallback = tracker.update(["b", "a", "b"], torch.tensor([4.0, 3.0, 10.0]))
    assert list(tracker.buffers["b"]) == [6.0, 4.0, 10.0]
    assert list(tracker.buffers["a"]) == [1.0, 3.0]
    expected = [norm(4.0, [6.0, 4.0, 10.0]), norm(3.0, [1.0, 3.0]), norm(10.0, [6.0, 4.0, 10.0])]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert not fallback.any()
    # a new prompt alone in the batch falls back to the batch stats
    adv, fallback = tracker.update(["c", "a"], torch.tensor([5.0, 7.0]))
    assert fallback.tolist() == [True, False]
    assert float(adv[0]) == pytest.approx(norm(5.0, [5.0, 7.0]), rel=1e-6)
    assert float(adv[1]) == pytest.approx(norm(7.0, [1.0, 3.0, 7.0]), rel=1e-6)


def test_tracker_state_dict_round_trip_and_validation() -> None:
    tracker = PerPromptStatTracker(buffer_size=2, min_count=1)
    tracker.update(["x", "x", "x", "y"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    state = json.loads(json.dumps(tracker.state_dict()))
    assert state["buffers"] == {"x": [2.0, 3.0], "y": [4.0]}
    other = PerPromptStatTracker(buffer_size=2, min_count=1)
    other.load_state_dict(state)
    a, _ = tracker.update(["x", "y"], torch.tensor([0.0, 1.0]))
    b, _ = other.update(["x", "y"], torch.tensor([0.0, 1.0]))
    assert torch.equal(a, b)
    assert "advantage.init_args.min_count" in PerPromptStatTracker(4, 8).validate(None)[0]
    assert PerPromptStatTracker(16, 16).validate(None) == []


def test_tracker_estimate_broadcasts_to_trainable_edges() -> None:
    trainable = torch.ones(4, 3, dtype=torch.bool)
    trainable[:, 2] = False
    rollout = chain_rollout(2, 2, 3, trainable)
    from rlpost.core.contract import RewardScores

    scores = RewardScores({"r": torch.tensor([1.0, 2.0, 3.0, 5.0])}, {"r": 1.0})
    adv = PerPromptStatTracker(buffer_size=4, min_count=2).estimate(rollout, scores)
    assert adv.samples.tolist() == pytest.approx(
        [norm(1, [1, 2]), norm(2, [1, 2]), norm(3, [3, 5]), norm(5, [3, 5])], rel=1e-6
    )
    assert torch.equal(adv.edges[~rollout.trainable], torch.zeros(4))
    assert adv.metrics["adv/global_fallback_frac"] == 0.0


def test_sampler_plan_counts_and_ratio(make_sd3_policy) -> None:
    sampler = DDPOSampler(num_steps=4)
    plan = sampler.plan(torch.linspace(1, 0, 5), 3, torch.Generator())
    # Both steps into the grid's clean end are deterministic by default (tests/plugins/test_residual_noise.py).
    assert plan.step_kernel == [0, 0, 1, 1] and plan.trainable[:, :2].all() and not plan.trainable[:, 2:].any()
    late = DDPOSampler(num_steps=4, penultimate_step="sde").plan(torch.linspace(1, 0, 5), 3, torch.Generator())
    assert late.step_kernel == [0, 0, 0, 1] and late.trainable[:, :3].all()
    (refused,) = problems_of(DDPOSampler, "sampler", timestep_fraction=0)
    assert refused == "sampler.init_args.timestep_fraction: must be in (0, 1], got 0"
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=1.0)
    perturb_lora(policy, seed=1)
    rollout = check_rollout_contract(sampler, policy, groups=3, per_group=2)
    roots = rollout.states[rollout.node_step == 0]
    assert not torch.equal(roots[0], roots[1])  # independent noise per image
    half = DDPOSampler(num_steps=4, timestep_fraction=0.5, final_step="sde")  # steps 0, 1, 3 sampled, 1 trained
    check_rollout_contract(half, policy, groups=2, per_group=1, seed=2)


def test_two_iterations_end_to_end(tiny_sd3_dir, tmp_path) -> None:
    lines, probe = train_two_iterations("recipes/tiny/ddpo.yaml", tiny_sd3_dir, tmp_path / "run")
    check_end_to_end(lines, probe)
    assert lines[0]["adv/global_fallback_frac"] == 1.0  # 2 images per prompt < min_count 4
    assert lines[0]["train/edges"] == 8 * 2  # 4 steps, the last two deterministic
