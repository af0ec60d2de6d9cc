"""rlpost.components.solver_sampler: the ``solver`` rollout sampler of likelihood-free rules on the tiny SD3.

Each solver is compared with a loop written here from its definition (Euler ODE, multistep DPM-Solver++ 2M, the
Flow-GRPO SDE only on the band's steps), the counts with what ``Policy.forward_count`` saw, and the sampler with the
conformance kit.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.components.chain import DPM_SOLVER, run_chains
from rlpost.components.solver_sampler import SolverSampler
from rlpost.core.contract import PromptBatch, Rollout
from rlpost.ops.dpm_solver import dpm_solver_pp2_step
from rlpost.testing import ConformanceError, check_sampler
from tests.tolerances import FP32_ATOL, FP32_RTOL, PIXEL_ATOL, assert_fp32_close

GROUPS, PER_GROUP = 2, 2
S = GROUPS * PER_GROUP


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir: Any) -> Any:
    """The tiny SD3 on its ``diffusers`` grid (clean tail of 2 steps), CFG off: one transformer row per forward."""
    from rlpost.models import SD3Policy

    p = SD3Policy(str(tiny_sd3_dir), dtype="float32", resolution=32, guidance_scale=1.0, max_sequence_length=32)
    p.setup(torch.device("cpu"))
    return p


def _batch() -> PromptBatch:
    return PromptBatch([f"a photo of object {g}" for g in range(GROUPS)], [{}] * GROUPS, PER_GROUP)


def _rollout(sampler: SolverSampler, policy: Any, seed: int = 0) -> Rollout:
    with torch.no_grad():
        return sampler.rollout(policy, _batch(), torch.Generator().manual_seed(seed))


def _levels(rollout: Rollout, num_steps: int) -> torch.Tensor:
    """``[T + 1, S, ...]`` the chains' states level by level (the chain core adds ``S`` nodes per level in order)."""
    levels = rollout.node_step.reshape(num_steps + 1, S)
    assert bool((levels == torch.arange(num_steps + 1)[:, None]).all())
    return rollout.states.reshape(num_steps + 1, S, *rollout.states.shape[1:])


def _velocity(policy: Any, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    cond = policy.encode(_batch().prompts).select(torch.arange(GROUPS).repeat_interleave(PER_GROUP))
    v: torch.Tensor = policy.velocity(x, sigma.expand(x.shape[0]), cond)
    return v


def test_registered_as_the_builtin_solver_sampler() -> None:
    entry = build_host(load_entrypoints=False).registry("sampler").get("solver")
    assert entry.cls is SolverSampler
    assert SolverSampler.provides == frozenset({"clean-samples", "chains"})


def test_euler_equals_a_hand_written_euler_loop(policy: Any) -> None:
    steps = 4
    rollout = _rollout(SolverSampler(num_steps=steps, solver="euler"), policy, seed=3)
    sigmas = policy.sigmas(steps)
    with torch.no_grad():
        x = policy.initial_noise(S, torch.Generator().manual_seed(3))
        expected = [x]
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * _velocity(policy, x, sigmas[i])
            expected.append(x)
        image = policy.decode(x)
    assert_fp32_close(_levels(rollout, steps), torch.stack(expected))
    assert int((rollout.media.int() - image.int()).abs().max()) <= PIXEL_ATOL
    assert rollout.kernels == ["ode"] and not bool(rollout.trainable.any())
    assert bool(rollout.old_log_probs.isnan().all())  # deterministic edges have no density


def test_dpm_solver_equals_dpm_solver_pp2_step_by_hand(policy: Any) -> None:
    steps = 5
    rollout = _rollout(SolverSampler(num_steps=steps, solver="dpm-solver++2"), policy, seed=4)
    sigmas = policy.sigmas(steps)
    with torch.no_grad():
        x = policy.initial_noise(S, torch.Generator().manual_seed(4))
        expected, prev_sigma, prev_x0 = [x], None, None
        for i in range(steps):
            sigma, sigma_next = sigmas[i].expand(S), sigmas[i + 1].expand(S)
            x, x0 = dpm_solver_pp2_step(x, _velocity(policy, x, sigmas[i]), sigma, sigma_next, prev_sigma, prev_x0)
            prev_sigma, prev_x0 = sigma, x0
            expected.append(x)
    assert_fp32_close(_levels(rollout, steps), torch.stack(expected))
    # The order-2 correction really ran (the hand loop without history differs) and the last step lands on x̂0.
    assert float(sigmas[-1]) == 0.0
    assert_fp32_close(expected[-1], x0)
    assert rollout.kernels == [DPM_SOLVER] and not bool(rollout.trainable.any())


def test_dpm_solver_differs_from_euler_on_the_same_noise(policy: Any) -> None:
    """A guard on the test above: the two solvers' images differ, so equality to the hand loop says something."""
    euler = _rollout(SolverSampler(num_steps=5, solver="euler"), policy, seed=4)
    dpm = _rollout(SolverSampler(num_steps=5, solver="dpm-solver++2"), policy, seed=4)
    assert float((euler.states[-S:] - dpm.states[-S:]).abs().max()) > 1e-3


def test_sde_band_injects_noise_only_on_steps_landing_in_the_band(policy: Any) -> None:
    steps = 6  # diffusers grid: 1, .923, .819, .668, .432, .0089, 0; band [.3, .9] holds the targets of steps 1-3
    sampler = SolverSampler(num_steps=steps, solver="sde-band", noise_level=0.7, sde_band=(0.3, 0.9))
    sigmas = policy.sigmas(steps).cpu()
    band = [i for i in range(steps) if 0.3 <= float(sigmas[i + 1]) <= 0.9]
    assert band == [1, 2, 3]
    rollout = _rollout(sampler, policy, seed=5)
    levels = _levels(rollout, steps)
    with torch.no_grad():
        for i in range(steps):
            euler = levels[i] + (sigmas[i + 1] - sigmas[i]) * _velocity(policy, levels[i], sigmas[i])
            off = float((levels[i + 1] - euler).abs().max())
            if i in band:
                assert off > 0.05, f"step {i} lands in the band but injected no noise ({off})"
            else:
                assert off < 1e-4, f"step {i} lands outside the band but left the Euler step by {off}"
    kinds = rollout.edge_kernel.reshape(steps, S)  # edges are added step by step, S per step
    assert rollout.kernels == ["ode", "flow-sde"]
    assert [int(k) for k in kinds[:, 0]] == [1 if i in band else 0 for i in range(steps)]
    assert bool(kinds.eq(kinds[:, :1]).all()) and not bool(rollout.trainable.any())

    # The same initial noise with two step generators: equal trajectories up to the first band step, apart after.
    noise = policy.initial_noise(S, torch.Generator().manual_seed(9))
    runs = []
    for seed in (10, 11):
        gen = torch.Generator().manual_seed(seed)
        plan = sampler.plan(sigmas, S, gen, clean_tail=policy.clean_tail_steps())
        with torch.no_grad():
            runs.append(_levels(run_chains(policy, _batch(), gen, plan, noise, S), steps))
    same = [bool(torch.allclose(a, b, rtol=FP32_RTOL, atol=FP32_ATOL)) for a, b in zip(*runs, strict=True)]
    assert same == [True, True] + [False] * (steps - 1)  # levels 0, 1 (before band step 1) agree, then diverge


def test_sde_band_keeps_the_clean_tail_deterministic() -> None:
    sigmas = torch.tensor([1.0, 0.9233, 0.8189, 0.6683, 0.4322, 0.0089, 0.0])
    sampler = SolverSampler(num_steps=6, solver="sde-band", noise_level=0.7, sde_band=(0.0, 1.0))
    assert sampler.step_kinds(sigmas, clean_tail=2) == [1, 1, 1, 1, 0, 0]  # diffusers grid: into σ_min and to 0
    assert sampler.step_kinds(sigmas, clean_tail=1) == [1, 1, 1, 1, 1, 0]
    assert SolverSampler(num_steps=6, solver="sde-band", noise_level=0.0).step_kinds(sigmas, 2) == [0] * 6


def test_sde_band_at_noise_level_zero_is_the_euler_rollout(policy: Any) -> None:
    euler = _rollout(SolverSampler(num_steps=4, solver="euler"), policy, seed=6)
    band = _rollout(SolverSampler(num_steps=4, solver="sde-band", noise_level=0.0), policy, seed=6)
    assert_fp32_close(band.states, euler.states)
    assert int((band.media.int() - euler.media.int()).abs().max()) <= PIXEL_ATOL


def test_shared_noise_gives_a_group_one_initial_state(policy: Any) -> None:
    rollout = _rollout(SolverSampler(num_steps=2, shared_noise=True), policy)
    start = _levels(rollout, 2)[0]
    assert_fp32_close(start[1], start[0])
    assert_fp32_close(start[3], start[2])
    assert not torch.equal(start[0], start[2])


@pytest.mark.parametrize(
    ("solver", "noise_level", "chunk_size"),
    [("euler", 0.0, 0), ("dpm-solver++2", 0.0, 3), ("sde-band", 0.7, 0), ("sde-band", 0.7, 1)],
)
def test_counts_equal_what_ran(policy: Any, solver: str, noise_level: float, chunk_size: int) -> None:
    steps = 3
    sampler = SolverSampler(num_steps=steps, solver=solver, noise_level=noise_level, chunk_size=chunk_size)  # type: ignore[arg-type]
    counts = sampler.counts(GROUPS, PER_GROUP)
    policy.encode(_batch().prompts)  # encoding is no denoiser forward; keep the cache warm anyway
    start = policy.forward_count
    rollout = _rollout(sampler, policy)
    ran = policy.forward_count - start
    assert ran == counts.rollout_forwards == S * steps == rollout.stats["perf/rollout_forwards"]
    assert counts.images == rollout.num_samples == rollout.media.shape[0] == S
    assert counts.trainable_edges == int(rollout.trainable.sum()) == 0
    assert counts.train_forwards == 0
    assert sampler.expected_rollout_forwards(GROUPS, PER_GROUP) == ran


def test_rollout_groups_batches_every_group_with_its_own_draws(policy: Any) -> None:
    sampler = SolverSampler(num_steps=6, solver="sde-band", noise_level=0.7)
    batch = _batch()
    with torch.no_grad():
        together = sampler.rollout_groups(policy, batch, [torch.Generator().manual_seed(20 + j) for j in range(2)])
        for j in range(GROUPS):
            one = PromptBatch([batch.prompts[j]], [{}], PER_GROUP)
            alone = sampler.rollout(policy, one, torch.Generator().manual_seed(20 + j))
            assert_fp32_close(together.states[-S:][j * PER_GROUP : (j + 1) * PER_GROUP], alone.states[-PER_GROUP:])


def test_evaluate_is_not_provided(policy: Any) -> None:
    rollout = _rollout(SolverSampler(num_steps=2), policy)
    with pytest.raises(NotImplementedError, match="edge-log-probs"):
        SolverSampler(num_steps=2).evaluate(policy, rollout, torch.arange(2))


def test_conformance_kit(rlpost_tiny_policy: Any) -> None:
    """The kit on the tiny SD3 policy. While the kit still demands trainable edges and ``evaluate`` of every sampler
    (edge-log-probs), those violations, and only those, skip the test: a sampler that does not provide the
    capability cannot meet them."""
    try:
        check_sampler(SolverSampler(num_steps=4, solver="sde-band", noise_level=0.7), rlpost_tiny_policy)
    except ConformanceError as err:
        edge_only = ("the rollout has no trainable edge", "evaluate() raised NotImplementedError")
        others = [v for v in err.violations if not v.startswith(edge_only)]
        if others:
            raise
        pytest.skip(f"check_sampler still requires edge-log-probs of every sampler: {err.violations}")


def test_validate_refuses_what_cannot_run(policy: Any) -> None:
    recipe = SimpleNamespace(model=policy)  # diffusers grid: a clean tail of 2 steps
    assert SolverSampler(solver="sde-band", noise_level=0.7).validate(recipe) == []
    assert SolverSampler(solver="dpm-solver++2", num_steps=1).validate(recipe) == []
    (noise,) = SolverSampler(solver="euler", noise_level=0.5).validate(recipe)
    assert noise.startswith("sampler.init_args.noise_level: 0.5 has no effect with solver 'euler'")
    for band in ((0.9, 0.3), (0.5, 0.5), (-0.1, 0.5), (0.2, 1.5), (float("nan"), 0.5)):
        (problem,) = SolverSampler(solver="sde-band", sde_band=band).validate(recipe)
        assert problem.startswith("sampler.init_args.sde_band: must be [lo, hi] with 0 <= lo < hi <= 1")
    (tail,) = SolverSampler(solver="sde-band", noise_level=0.7, num_steps=2).validate(recipe)
    assert tail.startswith("sampler.init_args.num_steps: 2 step(s) are all in the clean tail")


def test_plan_refuses_a_grid_that_does_not_end_clean() -> None:
    with pytest.raises(ValueError, match="ending at 0"):
        SolverSampler(num_steps=2).plan(torch.tensor([1.0, 0.5, 0.1]), 2, torch.Generator())
