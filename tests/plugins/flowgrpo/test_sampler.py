"""The flow-grpo sampler: step kernels against the paper's equations, plans and windows, counted rows equal the closed
form for every preset and window draw, ratio 1, recorded old means, and the capability it declares."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from rlpost import EDGE_OLD_MEANS, PromptBatch
from rlpost_flowgrpo.sampler import FlowGRPOSampler
from tests.argument_checks import problems_of
from tests.unit.components.chain_helpers import check_rollout_contract, perturb_lora

# Presets on the tiny model (4 steps): Flow-GRPO (SDE), Flow-GRPO with CPS, Fast (CPS window), Fast without window.
PRESETS = {
    "flowgrpo": {"num_steps": 4, "kernel": "sde", "noise_level": 0.7, "timestep_fraction": 0.99},
    "cps": {"num_steps": 4, "kernel": "cps", "noise_level": 0.8, "timestep_fraction": 0.5},
    "fast": {"num_steps": 4, "kernel": "cps", "noise_level": 0.8, "sde_window_size": 2, "sde_window_range": (0, 3)},
    "fast-sde": {"num_steps": 5, "kernel": "sde", "noise_level": 0.7, "sde_window_size": 1, "sde_window_range": (1, 4)},
}


def _state(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 3, 3, generator=gen), torch.randn(3, 2, 3, 3, generator=gen)


def test_sde_kernel_and_log_prob_follow_the_paper() -> None:
    """Flow-SDE (arXiv 2505.05470 eq. 9-10): mean, std s_t·sqrt(-dt) and the Gaussian log-density with constants,
    per-element mean; the first step (σ = 1) uses σ_1 in 1 - σ."""
    x, v = _state()
    sigma, nxt = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.4, 0.0])
    kernel = FlowGRPOSampler(kernel="sde", noise_level=0.7)._kernels[0]
    assert kernel is not None
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    out = kernel.step(x, v, sigma, nxt, None, noise=z)
    for i in range(3):
        s, sn = float(sigma[i]), float(nxt[i])
        dt = sn - s
        st = 0.7 * math.sqrt(s / (1 - (sn if s == 1.0 else s)))
        mean = x[i] * (1 + st**2 / (2 * s) * dt) + v[i] * (1 + st**2 * (1 - s) / (2 * s)) * dt
        std = st * math.sqrt(-dt)
        torch.testing.assert_close(out.mean[i], mean, rtol=1e-5, atol=1e-6)
        assert math.isclose(float(out.std[i].flatten()[0]), std, rel_tol=1e-6)
        sample = mean + std * z[i]
        torch.testing.assert_close(out.next_latents[i], sample, rtol=1e-5, atol=1e-6)
        elem = -((out.next_latents[i].double() - out.mean[i].double()) ** 2) / (2 * std**2)
        logp = (elem - math.log(std) - 0.5 * math.log(2 * math.pi)).mean()
        assert math.isclose(float(out.log_prob[i]), float(logp), rel_tol=1e-6)  # fp32 std
    assert out.log_prob.dtype == torch.float64


def test_cps_kernel_and_constant_free_log_prob() -> None:
    """CPS (sd3_sde_with_logprob.py sde_type='cps'): std σ'·sin(aπ/2), mean (1-σ')x̂0 + sqrt(σ'² - s²)x̂1, and the
    log-prob -mean((x' - μ)²) without constants, fp64."""
    x, v = _state(2)
    sigma, nxt = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.4, 0.1])
    kernel = FlowGRPOSampler(kernel="cps", noise_level=0.8)._kernels[0]
    assert kernel is not None
    out = kernel.step(x, v, sigma, nxt, torch.Generator().manual_seed(3))
    for i in range(3):
        s, sn = float(sigma[i]), float(nxt[i])
        std = sn * math.sin(0.8 * math.pi / 2)
        mean = (1 - sn) * (x[i] - s * v[i]) + math.sqrt(sn**2 - std**2) * (x[i] + (1 - s) * v[i])
        torch.testing.assert_close(out.mean[i], mean, rtol=1e-5, atol=1e-6)
        assert math.isclose(float(out.std[i].flatten()[0]), std, rel_tol=1e-6)
        logp = -((out.next_latents[i].double() - out.mean[i].double()) ** 2).mean()
        assert math.isclose(float(out.log_prob[i]), float(logp), rel_tol=1e-12)
    assert out.log_prob.dtype == torch.float64


def test_plans_train_the_first_steps_or_the_window() -> None:
    sigmas = torch.linspace(1, 0, 11)
    full = FlowGRPOSampler(num_steps=10, timestep_fraction=0.99)
    assert full.train_steps == 9  # int(10 x 0.99)
    plan = full.plan(sigmas, 3, torch.Generator())
    assert plan.step_kernel == [0] * 10 and plan.kernel_names == ["flow-sde", "ode"]
    assert plan.trainable[:, :9].all() and not plan.trainable[:, 9].any()
    fast = FlowGRPOSampler(num_steps=10, kernel="cps", noise_level=0.8, sde_window_size=3, sde_window_range=(0, 5))
    assert fast.window_starts() == [0, 1, 2] and fast.train_steps == 3
    for start in fast.window_starts():
        plan = fast.plan_for(sigmas, 2, start)
        window = list(range(start, start + 3))
        assert plan.step_kernel == [0 if i in window else 1 for i in range(10)]
        assert plan.trainable[:, window].all() and int(plan.trainable.sum()) == 2 * 3
    draws = Counter(fast.draw_window(torch.Generator().manual_seed(s)) for s in range(600))
    assert set(draws) == {0, 1, 2} and min(draws.values()) > 150  # uniform over [lo, hi - w]


def test_validate_names_fields() -> None:
    assert FlowGRPOSampler().validate(None) == []
    problems = problems_of(FlowGRPOSampler, "sampler", timestep_fraction=1.5, noise_level=0.0)
    assert "sampler.init_args.timestep_fraction: must be in (0, 1], got 1.5" in problems
    assert "sampler.init_args.noise_level: must be > 0, got 0.0" in problems
    bad = FlowGRPOSampler(num_steps=10, sde_window_size=3, sde_window_range=(4, 6)).validate(None)
    assert bad and bad[0].startswith("sampler.init_args.sde_window_range")
    assert "noise_level" in "".join(FlowGRPOSampler(kernel="cps", noise_level=1.5).validate(None))
    assert "timestep_fraction" in "".join(FlowGRPOSampler(num_steps=2, timestep_fraction=0.4).validate(None))


def test_capability_follows_record_old_means() -> None:
    assert EDGE_OLD_MEANS not in FlowGRPOSampler().provides
    assert EDGE_OLD_MEANS in FlowGRPOSampler(record_old_means=True).provides
    assert EDGE_OLD_MEANS not in FlowGRPOSampler.provides  # the class default is unchanged


@pytest.fixture(scope="module")
def policy(rlpost_tiny_policy):  # type: ignore[no-untyped-def]
    perturb_lora(rlpost_tiny_policy)
    return rlpost_tiny_policy


@pytest.mark.parametrize("preset", list(PRESETS))
def test_counted_rows_equal_the_closed_form_for_every_window_draw(preset: str, policy, monkeypatch) -> None:
    """For each preset and each window start it can draw: denoiser rows, trained edges and training forwards equal
    counts(); recomputed log-probs give ratio 1; only window edges are trained and the rest of a window chain is ODE."""
    sampler = FlowGRPOSampler(chunk_size=5, **PRESETS[preset])
    for start in sampler.window_starts():
        monkeypatch.setattr(sampler, "draw_window", lambda generator, s=start: s)
        rollout = check_rollout_contract(sampler, policy, groups=2, per_group=3, seed=start)
        steps = rollout.edge_step
        if sampler.sde_window_size:
            window = (steps >= start) & (steps < start + sampler.sde_window_size)
            assert torch.equal(rollout.trainable, window)
            assert torch.equal(rollout.edge_kernel == 0, window)  # SDE inside the window, ODE outside
            assert rollout.stats["sampler/window_start"] == start
        else:
            assert torch.equal(rollout.trainable, steps < sampler.train_steps)
            assert bool((rollout.edge_kernel == 0).all())
        assert rollout.edge_extras == {}  # nothing recorded unless asked


def test_same_latent_and_recorded_old_means(policy) -> None:
    sampler = FlowGRPOSampler(num_steps=3, same_latent=True, record_old_means=True, chunk_size=4)
    rollout = check_rollout_contract(sampler, policy, groups=2, per_group=2, seed=1)
    roots = rollout.states[rollout.node_step == 0]
    assert torch.equal(roots[0], roots[1]) and not torch.equal(roots[0], roots[2])
    means = rollout.edge_extras[EDGE_OLD_MEANS]
    assert means.shape == (rollout.num_edges, *rollout.states.shape[1:]) and means.dtype == torch.float32
    edges = torch.arange(rollout.num_edges)
    with torch.no_grad():
        evaluation = sampler.evaluate(policy, rollout, edges)
    torch.testing.assert_close(means, evaluation.mean.cpu(), rtol=1e-5, atol=1e-6)  # the behaviour step means
    # A window rollout records the deterministic edges' means too (their next states).
    fast = FlowGRPOSampler(num_steps=4, kernel="sde", sde_window_size=1, sde_window_range=(1, 3), record_old_means=True)
    batch = PromptBatch(["a cat"], [{}], 2)
    with torch.no_grad():
        out = fast.rollout(policy, batch, torch.Generator().manual_seed(0))
    ode = out.edge_kernel == 1
    torch.testing.assert_close(out.edge_extras[EDGE_OLD_MEANS][ode], out.states[out.edge_child[ode]])


def test_rollout_groups_equals_one_rollout_per_group_with_a_window(policy) -> None:
    """Each group draws its own window from its own generator, as a rollout of it alone; extras survive the merge."""
    sampler = FlowGRPOSampler(num_steps=4, kernel="cps", noise_level=0.8, sde_window_size=1, record_old_means=True)
    batch = PromptBatch(["a cat", "a dog", "a car"], [{}, {}, {}], 2)
    gens = [torch.Generator().manual_seed(10 + j) for j in range(3)]
    with torch.no_grad():
        together = sampler.rollout_groups(policy, batch, gens)
        alone = [
            sampler.rollout(policy, PromptBatch([p], [{}], 2), torch.Generator().manual_seed(10 + j))
            for j, p in enumerate(batch.prompts)
        ]
    assert together.edge_extras[EDGE_OLD_MEANS].shape[0] == together.num_edges
    for j, part in enumerate(alone):
        rows = together.node_group[together.edge_parent] == j
        assert torch.equal(together.edge_step[rows & together.trainable], part.edge_step[part.trainable])
        torch.testing.assert_close(together.old_log_probs[rows], part.old_log_probs, equal_nan=True)
