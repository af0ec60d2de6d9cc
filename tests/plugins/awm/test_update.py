"""AWM's update rule (plugins/rlpost_awm/update.py) on the tiny SD3: the loss equals the paper's equations computed
here sample by sample, the gradient is upstream's ratio-1 PPO gradient ``-mean(A·∇ℓ_w)`` (nothing through the
reference or EMA velocities), the timestep strata are one index per stratum and shared within a micro-batch, the
draws do not depend on how samples are split over ranks, and the counts are exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost import (
    REFERENCE,
    Advantages,
    PromptBatch,
    StepCounts,
    UpdateContext,
    keyed_generator,
    noise_for,
    sample_keys,
    stratified_indices,
)
from rlpost.engine.backend import LocalBackend
from rlpost.engine.weight_copies import CopyConfig, EngineCopies
from rlpost.ops.sampling import RolloutBuilder
from rlpost.testing import tiny_policy
from rlpost_awm.update import EMA_COPY, AWMUpdate
from tests.unit.components.chain_helpers import perturb_lora

NUM_STEPS = 10
PROMPTS = ["a photo of a cat", "a red car", "a bowl of fruit", "a city at night"]
# Advantages beyond ±5 exercise the clamp; a zero one the no-signal case.
ADVANTAGES = [7.0, -2.0, 0.5, 0.0, -9.0, 3.0]


class GradRecorder(torch.optim.Optimizer):
    """A torch optimizer that keeps each step's gradients and leaves the weights alone."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.0})
        self.grads: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.grads.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


class LossRecorder(LocalBackend):
    """The engine's single-process backend, keeping the value of every loss passed to ``backward``."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.recorder = GradRecorder(params)
        super().__init__(params, self.recorder, None, max_grad_norm=None)
        self.losses: list[float] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach()))
        super().backward(loss)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory, rlpost_tiny_sd3_dir: Path) -> Iterator[Any]:
    policy = tiny_policy("sd3", rlpost_tiny_sd3_dir, lora_rank=4, resolution=16)
    perturb_lora(policy)  # LoRA B starts at zero: make the live velocity differ from the reference's
    yield policy


def clean_rollout(policy: Any, groups: int = 3, per_group: int = 2, group_offset: int = 0, seed: int = 0) -> Any:
    """A rollout of random clean latents on the policy's 10-step grid (what a solver rollout leaves for AWM)."""
    g = torch.Generator().manual_seed(seed)
    s = groups * per_group
    batch = PromptBatch(PROMPTS[group_offset : group_offset + groups], [{}] * groups, per_group, group_offset)
    builder = RolloutBuilder(batch, policy.sigmas(NUM_STEPS), ["ode"])
    group_of = torch.arange(groups).repeat_interleave(per_group)
    x0 = policy.initial_noise(s, g)
    nodes = builder.add_nodes(x0, NUM_STEPS, group_of)
    return builder.build(nodes, torch.zeros(s, 1, 4, 4, 3, dtype=torch.uint8))


def ema_copies(policy: Any) -> EngineCopies:
    """The run's copies with an ``ema`` copy that differs from the live weights."""
    params = policy.trainable_parameters()
    copies = EngineCopies(policy, params, {EMA_COPY: CopyConfig(rate=0.001, cap=0.3)})
    g = torch.Generator().manual_seed(5)
    for shadow in copies.shadows[EMA_COPY]:
        shadow.add_(0.02 * torch.randn(shadow.shape, generator=g))
    return copies


def run_update(
    rule: AWMUpdate, policy: Any, rollout: Any, advantages: list[float], step: int = 3, seed: int = 11
) -> tuple[Any, LossRecorder, int]:
    backend = LossRecorder(policy.trainable_parameters())
    adv = Advantages(edges=torch.zeros(rollout.num_edges), samples=torch.tensor(advantages))
    ctx = UpdateContext(
        policy,
        None,
        rollout,
        adv,
        backend,
        torch.Generator().manual_seed(0),
        step,
        ema_copies(policy),
        seed,  # type: ignore[arg-type]
    )
    rows0 = policy.forward_count
    result = rule.update(ctx)
    return result, backend, policy.forward_count - rows0


def expected_objective(rule: AWMUpdate, policy: Any, rollout: Any, step: int, seed: int) -> tuple[torch.Tensor, float]:
    """The AWM objective written from the paper's equations, one (sample, timestep) pair at a time, with the
    reference and EMA velocities as constants: (upstream's PPO form as a function of the live weights, ``ratio =
    exp(ℓ_w - sg(ℓ_w))``, ``-mean(max(-A·ratio, -A·clip(ratio, 0, 2)))`` (clip range 1) plus the KL terms; the value
    of ``-mean(A·ℓ_w)`` plus the KL terms)."""
    copies = ema_copies(policy)
    sigmas, keys = rollout.sigmas, sample_keys(rollout)
    cond = policy.encode(rollout.prompts)
    x0_all = rollout.states[rollout.sample_node]
    m, n_t, p = rule.minibatch_samples, rule.num_train_timesteps, rule.ghuber_power
    lo = 1 if rule.time_type == "discrete_wo_init" else 0
    hi = int(NUM_STEPS * rule.max_index_fraction)
    pairs = []  # (sample, sigma [1], x_t [1, ...], eps [1, ...], conditioning)
    for start in range(0, rollout.num_samples, m):
        members = list(range(start, min(start + m, rollout.num_samples)))
        idx = stratified_indices(keyed_generator(seed, step, 2, *keys[members[0]]), lo, hi, n_t)
        for j in range(n_t):
            for i in members:
                sigma = sigmas[idx[j]].reshape(1)
                eps = noise_for(seed, step, keys[i], x0_all.shape[1:], j)[None]
                x_t = (1 - sigma) * x0_all[i : i + 1] + sigma * eps
                pairs.append((i, sigma, x_t, eps, cond.select(rollout.sample_group[i : i + 1])))
    # The frozen velocities first: a copy is swapped into the parameters in place, which would invalidate the
    # autograd graph of a live velocity computed before it.
    frozen = []
    with torch.no_grad():
        for _, sigma, x_t, _, c in pairs:
            with policy.reference():
                v_ref = policy.velocity(x_t, sigma, c, guidance=1.0).double()
            with copies.use(EMA_COPY):
                v_ema = policy.velocity(x_t, sigma, c, guidance=1.0).double()
            frozen.append((v_ref, v_ema))
    terms, values = [], []
    for (i, sigma, x_t, eps, c), (v_ref, v_ema) in zip(pairs, frozen, strict=True):
        v = policy.velocity(x_t, sigma, c, guidance=1.0).double()
        x0 = x0_all[i : i + 1].double()
        mse = ((v - (eps.double() - x0)) ** 2).mean()
        log_w = -((mse + 1e-10) ** p - 1e-10**p) * float(sigma) / p
        a = min(max(ADVANTAGES[i], -5.0), 5.0) / 5.0
        ratio = torch.exp(log_w - log_w.detach())
        ppo = torch.maximum(-a * ratio, -a * ratio.clamp(0.0, 2.0))
        kl = ((v - v_ref) ** 2).mean()
        kl_ema = ((v - v_ema) ** 2).mean()
        reg = rule.kl_beta * kl + rule.ema_beta * kl_ema
        terms.append(ppo + reg)
        values.append(float(-a * log_w + reg))
    return torch.stack(terms).sum() / len(terms), sum(values) / len(values)


def test_loss_and_gradient_equal_the_papers_equations(policy: Any) -> None:
    """On 6 samples in micro-batches of 4 and 2 at 3 timesteps: the summed micro-batch losses equal
    ``-mean(A·ℓ_w) + β·KL + β_ema·KL_ema`` over the 18 (timestep, sample) pairs, and the gradient equals that of
    upstream's ratio form (nothing through ``v_ref`` or ``v_ema``), within fp32 forward rounding (batched forwards in
    the rule, one row at a time here)."""
    rule = AWMUpdate(kl_beta=0.05, ema_beta=0.5, minibatch_samples=4, num_train_timesteps=3)
    rollout = clean_rollout(policy)
    result, backend, _ = run_update(rule, policy, rollout, ADVANTAGES)
    params = policy.trainable_parameters()
    policy.train(True)
    ppo_form, value = expected_objective(rule, policy, rollout, step=3, seed=11)
    expected_grads = torch.autograd.grad(ppo_form, params, allow_unused=True)
    policy.train(False)
    assert len(backend.losses) == 2
    assert sum(backend.losses) == pytest.approx(value, rel=1e-5)
    (got,) = backend.recorder.grads
    for g, e in zip(got, expected_grads, strict=True):
        e = torch.zeros_like(g) if e is None else e
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-9)
    assert any(float(g.abs().max()) > 0 for g in got)
    assert result.metrics["train/optimizer_steps"] == 1.0


def test_strata_one_per_stratum_shared_within_a_micro_batch(policy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rule = AWMUpdate(kl_beta=0.0, ema_beta=0.0, minibatch_samples=2, num_train_timesteps=6)
    rollout = clean_rollout(policy)
    calls: list[torch.Tensor] = []
    velocity = policy.velocity

    def spy(latents: torch.Tensor, sigma: torch.Tensor, cond: Any, guidance: float | None = None) -> torch.Tensor:
        calls.append(sigma.detach().clone())
        return velocity(latents, sigma, cond, guidance=guidance)

    monkeypatch.setattr(policy, "velocity", spy)
    run_update(rule, policy, rollout, ADVANTAGES, step=7, seed=0)
    assert len(calls) == 3  # one batched forward per micro-batch of 2 samples: 2 x 6 rows
    grid = rollout.sigmas
    draws = []
    for sigma in calls:
        assert sigma.shape == (12,)
        per_stratum = sigma.reshape(6, 2)  # rows are timestep-major: both samples share each stratum's sigma
        assert torch.equal(per_stratum[:, 0], per_stratum[:, 1])
        index = [int((grid == s).nonzero()) for s in per_stratum[:, 0]]
        # discrete_wo_init on 10 steps: indices 1..9 in strata {1}, {2}, {3,4}, {5}, {6}, {7,8}
        assert index[0] == 1 and index[1] == 2 and index[2] in (3, 4) and index[3] == 5 and index[4] == 6
        assert index[5] in (7, 8)
        draws.append(tuple(index))
    assert len(set(draws)) > 1, "each micro-batch draws its own indices"


def test_draws_do_not_depend_on_the_rank_split(policy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks holding group 0 and groups 1-2 train each sample at the noisy states one rank would."""
    rule = AWMUpdate(kl_beta=0.0, ema_beta=0.0, minibatch_samples=2, num_train_timesteps=3)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    velocity = policy.velocity

    def spy(latents: torch.Tensor, sigma: torch.Tensor, cond: Any, guidance: float | None = None) -> torch.Tensor:
        seen.append((latents.detach().clone(), sigma.detach().clone()))
        return velocity(latents, sigma, cond, guidance=guidance)

    monkeypatch.setattr(policy, "velocity", spy)
    whole = clean_rollout(policy)
    run_update(rule, policy, whole, ADVANTAGES)
    one_rank = list(seen)
    seen.clear()
    states = whole.states
    for offset, groups in ((0, 1), (1, 2)):
        part = clean_rollout(policy, groups=groups, group_offset=offset)
        part.states = states[offset * 2 : (offset + groups) * 2].clone()
        run_update(rule, policy, part, ADVANTAGES[offset * 2 : (offset + groups) * 2])
    assert len(seen) == len(one_rank) == 3
    for (x_a, s_a), (x_b, s_b) in zip(one_rank, seen, strict=True):
        assert torch.equal(s_a, s_b) and torch.equal(x_a, x_b)


@pytest.mark.parametrize(("kl_beta", "ema_beta"), [(0.001, 1.0), (0.0, 1.0), (0.001, 0.0), (0.0, 0.0)])
def test_counts_equal_what_ran(policy: Any, kl_beta: float, ema_beta: float) -> None:
    rule = AWMUpdate(kl_beta=kl_beta, ema_beta=ema_beta, minibatch_samples=3, num_train_timesteps=4)
    rollout = clean_rollout(policy)
    counts = rule.train_counts(
        StepCounts(images=6, trainable_edges=0, rollout_forwards=6 * NUM_STEPS, train_forwards=0)
    )
    result, _, rows = run_update(rule, policy, rollout, ADVANTAGES)
    expected_nograd = {name: 24 for name, beta in ((REFERENCE, kl_beta), (EMA_COPY, ema_beta)) if beta > 0}
    assert counts.grad_rows == result.train_forwards == 24
    assert dict(counts.nograd_rows) == dict(result.copy_forwards) == expected_nograd
    assert result.reference_forwards == counts.nograd_total
    assert rows == result.train_forwards + result.reference_forwards
    assert counts.rows_per_call == 12
    assert rule.required_copies() == (frozenset({EMA_COPY}) if ema_beta > 0 else frozenset())
    assert result.trained_edges == 0 and result.nonfinite_losses == 0


def test_skipped_steps_train_nothing_and_report_zero(policy: Any) -> None:
    rule = AWMUpdate(skip_first_steps=2, num_train_timesteps=2)
    rollout = clean_rollout(policy)
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    result, backend, rows = run_update(rule, policy, rollout, ADVANTAGES, step=1)
    assert rows == 0 and backend.losses == [] and backend.num_steps == 0
    assert (result.train_forwards, result.reference_forwards, result.trained_edges) == (0, 0, 0)
    assert result.metrics["train/skipped_step"] == 1.0
    assert all(torch.equal(p, b) for p, b in zip(policy.trainable_parameters(), before, strict=True))
    result, backend, rows = run_update(rule, policy, rollout, ADVANTAGES, step=2)
    assert rows > 0 and backend.num_steps == 1 and "train/skipped_step" not in result.metrics


def test_nonfinite_loss_is_counted_and_kept_from_backward(policy: Any) -> None:
    rule = AWMUpdate(kl_beta=0.0, ema_beta=0.0, minibatch_samples=4)
    rollout = clean_rollout(policy)
    rollout.states[rollout.sample_node[0]] = float("nan")  # poisons the first micro-batch only
    result, backend, _ = run_update(rule, policy, rollout, ADVANTAGES)
    assert result.nonfinite_losses == 1 and len(backend.losses) == 1 and backend.refused_losses == 0
