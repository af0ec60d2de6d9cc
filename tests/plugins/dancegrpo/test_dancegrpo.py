"""DanceGRPO sampler: plan, shared noise, counts vs forward_count, ratio 1, and a 2-iteration CLI run."""

from __future__ import annotations

import torch

from rlpost.models import LoraSpec
from rlpost_dancegrpo.sampler import DanceGRPOSampler
from tests.argument_checks import problems_of
from tests.unit.components.chain_helpers import (
    check_end_to_end,
    check_rollout_contract,
    perturb_lora,
    train_two_iterations,
)


def test_plan_trains_a_random_subset_per_sample() -> None:
    sampler = DanceGRPOSampler(num_steps=10, timestep_fraction=0.6)
    # The step into the last nonzero level and the last step are ODE steps by default.
    assert sampler.eligible_steps == 8 and sampler.train_steps == 4
    plan = sampler.plan(torch.linspace(1, 0, 11), 64, torch.Generator().manual_seed(0))
    assert plan.step_kernel == [0] * 8 + [1, 1] and not plan.decode_x0
    assert torch.equal(plan.trainable.sum(1), torch.full((64,), 4))
    assert not plan.trainable[:, -2:].any()
    assert len({tuple(row.tolist()) for row in plan.trainable}) > 1  # subsets differ between samples
    upstream = DanceGRPOSampler(num_steps=10, timestep_fraction=0.6, penultimate_step="sde")
    upstream_plan = upstream.plan(torch.linspace(1, 0, 11), 4, torch.Generator())
    assert upstream.train_steps == 5 and upstream_plan.step_kernel == [0] * 9 + [1]
    sde = DanceGRPOSampler(num_steps=10, timestep_fraction=0.6, final_step="sde")
    sde_plan = sde.plan(torch.linspace(1, 0, 11), 64, torch.Generator())
    assert sde.train_steps == 5 and sde_plan.step_kernel == [0] * 8 + [1, 0] and sde_plan.decode_x0
    assert not sde_plan.trainable[:, -2].any() and sde_plan.trainable[:, -1].any()  # the hole at T-2 is skipped
    assert DanceGRPOSampler(num_steps=10, timestep_fraction=0.6, final_step="sde", ignore_last=True).train_steps == 4


def test_validate_names_fields() -> None:
    problems = problems_of(DanceGRPOSampler, "sampler", timestep_fraction=1.5, eta=0.0, chunk_size=0)
    assert problems == [
        "sampler.init_args.eta: must be > 0, got 0.0",
        "sampler.init_args.timestep_fraction: must be in (0, 1], got 1.5",
        "sampler.init_args.chunk_size: must be >= 1, got 0",
    ]
    assert "timestep_fraction" in "".join(DanceGRPOSampler(num_steps=2, timestep_fraction=0.5).validate(None))
    assert DanceGRPOSampler().validate(None) == []


def test_rollout_counts_ratio_and_shared_noise(make_sd3_policy) -> None:
    policy = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=2.0)
    perturb_lora(policy)
    sampler = DanceGRPOSampler(num_steps=4, timestep_fraction=0.67, chunk_size=5)
    rollout = check_rollout_contract(sampler, policy, groups=2, per_group=3)
    roots = rollout.states[rollout.node_step == 0]
    assert torch.equal(roots[0], roots[2]) and not torch.equal(roots[0], roots[3])  # init_same_noise per group
    assert rollout.kernels == ["dance-sde", "ode"]
    assert torch.isnan(rollout.old_log_probs[rollout.edge_kernel == 1]).all()
    final = rollout.states[rollout.sample_node]
    assert not torch.equal(final[0], final[1])  # SDE noise makes the chains of a group differ
    sde = DanceGRPOSampler(num_steps=3, timestep_fraction=1.0, final_step="sde", init_same_noise=False)
    sde_rollout = check_rollout_contract(sde, policy, groups=1, per_group=2, seed=3)
    # The sampled last step is not decoded: the image is upstream's x̂0, not the sampled final state.
    assert not torch.equal(sde_rollout.media, policy.decode(sde_rollout.states[sde_rollout.sample_node]))


def test_two_iterations_end_to_end(tiny_sd3_dir, tmp_path) -> None:
    lines, probe = train_two_iterations("recipes/tiny/dancegrpo.yaml", tiny_sd3_dir, tmp_path / "run")
    check_end_to_end(lines, probe)
    assert lines[0]["perf/rollout_forwards"] == 2 * 4 * 4
    assert lines[0]["train/edges"] == 2 * 4 * 2
