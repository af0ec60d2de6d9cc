"""DiffusionNFT's update rule on the toy linear policy: the gradient of one step equals an independent computation
from the paper's equations with the same keyed draws (whatever the minibatch size), the counts are what ran, the old
copy and the rollout are left alone, a non-finite loss never reaches ``backward``; the declared argument ranges.

The toy velocity is ``v = a·x + b_prompt`` (``tests/toy_components.py``), so the old copy and the reference are the
same field with other values of ``a``, and ``∂ℓ/∂a`` can be formed here by autograd on a fresh scalar in fp64.
"""

from __future__ import annotations

import pytest
import torch

from rlpost import Advantages, UpdateContext, grid_permutations, noise_for, sample_keys
from rlpost.engine.weight_copies import CopyConfig, EngineCopies
from rlpost.testing import sample_rollout
from rlpost_nft.loss import WEIGHT_FLOOR
from rlpost_nft.update import OLD, NFTUpdate
from tests.argument_checks import problems_of
from tests.plugins.old_copy_helpers import A_REF, RecordingBackend, RefToyPolicy
from tests.toy_components import ToyChainSampler

A_LIVE, A_OLD = -1.0, -0.8
SEED, STEP = 11, 3
ADVANTAGES = [-7.0, -2.0, 0.5, 1.5, 3.0, 8.0]  # beyond ±adv_clip_max on both sides


def _setup(guidance_scale: float = 1.0) -> tuple[RefToyPolicy, ToyChainSampler, EngineCopies, UpdateContext]:
    policy = RefToyPolicy(scale=A_LIVE, guidance_scale=guidance_scale)
    policy.setup(torch.device("cpu"))
    sampler = ToyChainSampler(num_steps=5)
    rollout = sample_rollout(sampler, policy, groups=2, samples_per_group=3, seed=0)
    policy.guidances = []
    params = policy.trainable_parameters()
    copies = EngineCopies(policy, params, {OLD: CopyConfig()})
    copies.shadows[OLD][0].fill_(A_OLD)
    adv = Advantages(edges=torch.zeros(rollout.num_edges), samples=torch.tensor(ADVANTAGES))
    ctx = UpdateContext(policy, sampler, rollout, adv, RecordingBackend(params), torch.Generator(), STEP, copies, SEED)
    return policy, sampler, copies, ctx


def _expected_grad(ctx: UpdateContext, keep: int, beta: float, kl_beta: float, m: float = 5.0) -> float:
    """``∂/∂a`` of the mean over (sample, kept timestep) of the paper's per-row loss, in fp64, velocity space:
    ``x̂0± - x0 = t·(ε - x0 - v±)``, ``v±`` the implicit policies, weights held constant."""
    rollout = ctx.rollout
    keys = sample_keys(rollout)
    x0 = rollout.states[rollout.sample_node].double()
    bias = ctx.policy.encode(rollout.prompts).select(rollout.sample_group).tensors["bias"].double()
    grid = rollout.sigmas.numel() - 1
    slots = grid_permutations(SEED, STEP, keys, grid, keep)
    a = torch.tensor(A_LIVE, dtype=torch.float64, requires_grad=True)
    total = torch.zeros((), dtype=torch.float64)
    for s, key in enumerate(keys):
        r = 0.5 + 0.5 * min(max(ADVANTAGES[s] / m, -1.0), 1.0)
        for j in range(keep):
            i = int(slots[s, j])
            t = float(rollout.sigmas[i])
            eps = noise_for(SEED, STEP, key, x0.shape[1:], i).double()
            x_t = (1 - t) * x0[s] + t * eps
            v_theta, v_old, v_ref = (c * x_t + bias[s] for c in (a, A_OLD, A_REF))
            losses = []
            for v in (beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta):
                err = t * ((eps - x0[s]) - v)
                losses.append((err**2).mean() / max(float(err.abs().mean()), WEIGHT_FLOOR))
            total = total + m * (r * losses[0] + (1 - r) * losses[1]) / beta
            total = total + kl_beta * ((v_theta - v_ref) ** 2).mean()
    (total / (len(keys) * keep)).backward()
    assert a.grad is not None
    return float(a.grad)


@pytest.mark.parametrize(("beta", "kl_beta"), [(1.0, 1e-4), (0.1, 0.5), (0.5, 0.0)])
@pytest.mark.parametrize("minibatch", [1, 4, 6])
def test_gradient_equals_the_papers_loss_with_the_same_draws(beta, kl_beta, minibatch):
    policy, _, copies, ctx = _setup()
    rule = NFTUpdate(beta=beta, kl_beta=kl_beta, minibatch_samples=minibatch)
    keep = rule.kept_timesteps(5)
    assert keep == 4  # int(5 · 0.99)
    rows0 = policy.forward_count
    result = rule.update(ctx)
    backend = ctx.backend
    assert isinstance(backend, RecordingBackend)
    assert backend.steps == 1  # one optimizer step per training step
    expected = _expected_grad(ctx, keep, beta, kl_beta)
    assert float(backend.grads[0]) == pytest.approx(expected, rel=1e-5)

    pairs = 6 * keep
    with_ref = kl_beta > 0
    assert result.train_forwards == pairs and result.trained_edges == 0 and result.nonfinite_losses == 0
    assert dict(result.copy_forwards) == ({OLD: pairs, "reference": pairs} if with_ref else {OLD: pairs})
    assert result.reference_forwards == pairs * (2 if with_ref else 1)
    assert policy.forward_count - rows0 == result.train_forwards + result.reference_forwards
    assert backend.backward_calls == -(-6 // minibatch) * keep  # one pass per (minibatch, kept timestep)
    assert float(copies.shadows[OLD][0]) == pytest.approx(A_OLD)  # the update never trains the old copy
    assert float(policy.a) == pytest.approx(A_LIVE)  # the recording backend applied nothing; every swap undone
    assert result.metrics["train/optimality_r_mean"] == pytest.approx(
        sum(0.5 + 0.5 * min(max(a / 5, -1), 1) for a in ADVANTAGES) / 6
    )
    assert result.metrics["train/adv_clipped_frac"] == pytest.approx(2 / 6)
    assert (result.metrics["loss/kl"] > 0) == with_ref


def test_train_counts_follow_the_sampler_grid():
    counts = ToyChainSampler(num_steps=10).counts(4, 6)  # 24 images, 240 rollout rows
    assert NFTUpdate(kl_beta=1e-4, minibatch_samples=9).train_counts(counts).__dict__ == {
        "grad_rows": 24 * 9,
        "nograd_rows": {OLD: 24 * 9, "reference": 24 * 9},
        "rows_per_call": 9,
    }
    no_kl = NFTUpdate(kl_beta=0.0, timestep_fraction=0.5, minibatch_samples=64).train_counts(counts)
    assert (no_kl.grad_rows, dict(no_kl.nograd_rows), no_kl.rows_per_call) == (24 * 5, {OLD: 24 * 5}, 24)


def test_copies_and_rollout_copy():
    rule = NFTUpdate()
    assert rule.required_copies() == {OLD} and rule.rollout_copy(0) == OLD and rule.rollout_copy(500) == OLD
    assert rule.requires == {"clean-samples"}


def test_training_velocities_use_train_guidance():
    """Every training velocity (old, reference, live) is called at ``train_guidance``: 1.0 trains the conditional
    branch of a CFG rollout (4.0 here), ``null`` the configured guidance, a different gradient."""
    grads = {}
    for train_guidance in (1.0, None):
        policy, _, _, ctx = _setup(guidance_scale=4.0)
        NFTUpdate(minibatch_samples=6, train_guidance=train_guidance).update(ctx)
        assert policy.guidances == [train_guidance] * (3 * 4)  # old, reference, live at 4 timesteps, one minibatch
        assert isinstance(ctx.backend, RecordingBackend)
        grads[train_guidance] = float(ctx.backend.grads[0])
    assert grads[1.0] != pytest.approx(grads[None], rel=1e-3)


def test_nonfinite_loss_never_reaches_backward():
    """A NaN old copy makes every loss NaN: none is passed to ``backward``, each is counted, the gradient is zero."""
    policy, _, copies, ctx = _setup()
    copies.shadows[OLD][0].fill_(float("nan"))
    result = NFTUpdate(minibatch_samples=4).update(ctx)
    backend = ctx.backend
    assert isinstance(backend, RecordingBackend)
    assert backend.backward_calls == 0 and result.nonfinite_losses == 2 * 4  # 2 minibatches x 4 timesteps
    assert float(backend.grads[0]) == 0.0 and bool(torch.isfinite(policy.a).all())


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"beta": 0.0}, "optimizer.init_args.beta: must be > 0, got 0.0"),
        ({"kl_beta": -1e-4}, "optimizer.init_args.kl_beta: must be >= 0, got -0.0001"),
        ({"adv_clip_max": 0.0}, "optimizer.init_args.adv_clip_max: must be > 0, got 0.0"),
        ({"timestep_fraction": 1.5}, "optimizer.init_args.timestep_fraction: must be in (0, 1], got 1.5"),
        ({"timestep_fraction": 0.0}, "optimizer.init_args.timestep_fraction: must be in (0, 1], got 0.0"),
        ({"minibatch_samples": 0}, "optimizer.init_args.minibatch_samples: must be >= 1, got 0"),
        ({"train_guidance": 0.5}, "optimizer.init_args.train_guidance: must be >= 1, got 0.5"),
    ],
)
def test_declared_ranges(kwargs, problem):
    assert problems_of(NFTUpdate, "optimizer", **kwargs) == [problem]
