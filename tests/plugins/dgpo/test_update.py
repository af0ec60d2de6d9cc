"""DGPO's update rule on the tiny SD3: the loss against the paper's group-DPO objective computed here, where the
gradient flows, the timestep and noise draws, and the counted rows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rlpost.core.api import REFERENCE, StepCounts
from rlpost.ops.training_noise import keyed_generator, noise_for, subset_without_replacement
from rlpost.testing import check_update_rule
from rlpost_dgpo.update import EMA_REF, DGPOUpdate, group_chunks
from tests.argument_checks import problems_of
from tests.plugins.dgpo.helpers import (
    GradBackend,
    Recorder,
    advantages_of,
    clean_rollout,
    context,
    copies_for,
)
from tests.tolerances import assert_fp32_close
from tests.unit.components.chain_helpers import perturb_lora

SEED, STEP = 5, 3
ADV = [1.2, -0.3, -0.9, 0.4, 2.0, -2.0]  # two groups of three


@pytest.fixture
def policy(make_sd3_policy: Any) -> Any:
    from rlpost.models import LoraSpec

    p = make_sd3_policy(lora=LoraSpec(rank=4, alpha=8), guidance_scale=4.5)
    perturb_lora(p)  # LoRA B starts at zero: without this the live and reference velocities coincide
    return p


def run_update(rule: DGPOUpdate, policy: Any, rollout: Any, adv: list[float], copies: Any) -> tuple[Any, GradBackend]:
    backend = GradBackend(policy.trainable_parameters())
    result = rule.update(context(policy, rollout, advantages_of(adv), backend, copies, SEED, STEP))
    return result, backend


def batch_inputs(policy: Any, rollout: Any, m: int) -> tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]:
    """x0, the group-shared ε of the m-th drawn timestep, conditioning and global groups, as the paper's setup."""
    x0 = rollout.states[rollout.sample_node]
    groups = rollout.sample_group + rollout.group_offset
    eps = torch.stack([noise_for(SEED, STEP, (int(g),), tuple(x0.shape[1:]), m) for g in groups])
    return x0, eps, policy.encode(rollout.prompts).select(rollout.sample_group), groups


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).square().flatten(1).mean(1)


def paper_objective(rule: DGPOUpdate, policy: Any, copies: Any, rollout: Any, adv: list[float]) -> dict[str, Any]:
    """The group-DPO objective written from the paper (arXiv 2510.08425, Sec. 3), no code shared with the rule.

    For a group ``g`` split into preferred and dispreferred samples by advantage sign, the group reward margin against
    the reference is ``R(G+) − R(G−) = −Σ_i A_i·β·(d_i − d_i^ref)/G`` (the ELBO form of the log-likelihood ratio,
    Diffusion-DPO), and the loss is ``−log σ(margin) = softplus(S_g)``. Its gradient is ``σ(S_g)·(β/G)·Σ A_i ∇d_i``,
    so ``(G/β)·softplus(S_g)`` has the gradient the rule's surrogate ``sg(σ(S_g))·A_i·d_i`` must have. Averaged over
    the ``S·M`` (sample, timestep) rows, plus ``kl_beta·mean_elem((v_θ − v_ref)²)``.
    """
    params = policy.trainable_parameters()
    sigmas = rollout.sigmas
    draws = subset_without_replacement(keyed_generator(SEED, STEP), rule.trunc_steps, rule.num_train_timesteps)
    a = torch.tensor(adv).clamp(-rule.adv_clip_max, rule.adv_clip_max)
    s, big_m = len(adv), len(draws)
    objective = torch.zeros(())
    surrogate_value = torch.zeros(())
    for m, j in enumerate(draws.tolist()):
        x0, eps, cond, groups = batch_inputs(policy, rollout, m)
        sigma = sigmas[j].expand(s)
        x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
        with torch.no_grad(), copies.use(REFERENCE):
            v_ref = policy.velocity(x_t, sigma, cond, guidance=rule.kl_cfg)
        policy.train(True)
        v = policy.velocity(x_t, sigma, cond, guidance=1.0)
        policy.train(False)
        d, d_ref = mse(eps - x0, v), mse(eps - x0, v_ref)
        for g in groups.unique():
            members = groups == g
            size = int(members.sum())
            score = (a[members] * rule.beta_dpo * (d[members] - d_ref[members])).sum() / size
            objective = objective + size / rule.beta_dpo * F.softplus(score)
            surrogate_value = surrogate_value + (torch.sigmoid(score) * a[members] * d[members]).sum().detach()
        objective = objective + rule.kl_beta * mse(v, v_ref).sum()
    objective = objective / (s * big_m)
    grads = torch.autograd.grad(objective, params, allow_unused=True)
    return {
        "grads": [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)],
        "policy": float(surrogate_value) / (s * big_m),
    }


def test_gradient_equals_the_papers_group_dpo_objective(policy: Any) -> None:
    rule = DGPOUpdate(beta_dpo=2000.0, kl_beta=0.5, clip_dsm=False, num_train_timesteps=2, trunc_steps=4)
    rollout = clean_rollout(policy, [0, 1], 3)
    copies = copies_for(policy)
    result, backend = run_update(rule, policy, rollout, ADV, copies)
    expected = paper_objective(rule, policy, copies, rollout, ADV)
    (got,) = backend.grads
    assert any(float(g.abs().max()) > 1e-4 for g in got)
    for a, b in zip(got, expected["grads"], strict=True):
        assert_fp32_close(a, b, rtol=1e-4, atol=1e-7)
    assert result.metrics["loss/policy"] == pytest.approx(expected["policy"], rel=1e-4)


VARIANTS = {  # name -> (w_g detached, clipped rows without gradient, weight 1 − sigmoid instead of sigmoid)
    "dgpo": (True, True, False),
    "grad through w_g": (False, True, False),
    "no clip": (True, False, False),
    "1 - sigmoid": (True, True, True),
}


def surrogate_grads(
    rule: DGPOUpdate, policy: Any, copies: Any, rollout: Any, adv: list[float]
) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor]:
    """Per :data:`VARIANTS` entry the gradient of ``mean_rows(w_g·A_i·d_i)`` written from the equations, and the clip
    mask of every row (the ``"dgpo"`` entry is DGPO's; the others are what a wrong implementation would compute)."""
    params = policy.trainable_parameters()
    draws = subset_without_replacement(keyed_generator(SEED, STEP), rule.trunc_steps, rule.num_train_timesteps)
    a = torch.tensor(adv)
    grads = {name: [torch.zeros_like(p) for p in params] for name in VARIANTS}
    masks = []
    for m, j in enumerate(draws.tolist()):
        x0, eps, cond, groups = batch_inputs(policy, rollout, m)
        sigma = rollout.sigmas[j].expand(len(adv))
        x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
        with torch.no_grad(), copies.use(EMA_REF):
            d_old = mse(eps - x0, policy.velocity(x_t, sigma, cond, guidance=1.0))
        with torch.no_grad(), copies.use(REFERENCE):
            d_ref = mse(eps - x0, policy.velocity(x_t, sigma, cond, guidance=1.0))
        d = mse(eps - x0, policy.velocity(x_t, sigma, cond, guidance=1.0))
        ratio = torch.exp(d_old - d.detach())
        clipped = torch.where(a > 0, ratio > 1 + rule.clip_range, ratio < 1 - rule.clip_range)
        masks.append(clipped)
        for name, (detach_w, clip, flip) in VARIANTS.items():
            total = torch.zeros(())
            for g in groups.unique():
                members = groups == g
                score = (a[members] * rule.beta_dpo * (d[members] - d_ref[members])).sum() / int(members.sum())
                w = 1 - torch.sigmoid(score) if flip else torch.sigmoid(score)
                w = w.detach() if detach_w else w
                keep = ~(clipped[members] & clip)
                total = total + (w * a[members][keep] * d[members][keep]).sum()
            # Gradients per timestep: the next one swaps the EMA copy's values into the weights this graph saved.
            step = torch.autograd.grad(total / (len(adv) * len(draws)), params, allow_unused=True, retain_graph=True)
            grads[name] = [acc if g is None else acc + g for acc, g in zip(grads[name], step, strict=True)]
    return grads, torch.stack(masks)


def test_gradient_flows_only_through_unclipped_denoising_errors(policy: Any) -> None:
    rule = DGPOUpdate(beta_dpo=2000.0, kl_beta=0.0, clip_range=1e-3, num_train_timesteps=2, trunc_steps=4)
    rollout = clean_rollout(policy, [0, 1], 3)
    copies = copies_for(policy, ema_shift=0.05)  # the EMA copy differs from the live weights: the clip can bind
    result, backend = run_update(rule, policy, rollout, ADV, copies)
    (got,) = backend.grads
    expected, clipped = surrogate_grads(rule, policy, copies, rollout, ADV)
    assert 0 < int(clipped.sum()) < clipped.numel(), "the check needs clipped and unclipped rows"
    assert result.metrics["train/clipfrac"] == pytest.approx(float(clipped.double().mean()))
    for a, b in zip(got, expected["dgpo"], strict=True):
        assert_fp32_close(a, b, rtol=1e-4, atol=1e-7)
    # Neither a gradient through w_g, nor one from the clipped rows, nor the opposite sign convention of the group
    # weight (1 − sigmoid, commented out upstream) matches, so the comparison above can fail.
    scale = max(float(g.abs().max()) for g in got)
    for name in ("grad through w_g", "no clip", "1 - sigmoid"):
        gap = max(float((a - b).abs().max()) for a, b in zip(got, expected[name], strict=True))
        assert gap > 1e-3 * scale, name


def test_clipped_samples_carry_no_gradient(policy: Any) -> None:
    # One timestep (index 0): pick each sample's advantage sign so that its ratio is on the clipped side.
    rule = DGPOUpdate(beta_dpo=100.0, kl_beta=0.0, clip_range=1e-6, num_train_timesteps=1, trunc_steps=0)
    rollout = clean_rollout(policy, [0, 1], 2)
    copies = copies_for(policy, ema_shift=0.05)
    x0, eps, cond, _ = batch_inputs(policy, rollout, 0)
    sigma = rollout.sigmas[0].expand(4)
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
    with torch.no_grad():
        d = mse(eps - x0, policy.velocity(x_t, sigma, cond, guidance=1.0))
        with copies.use(EMA_REF):
            d_old = mse(eps - x0, policy.velocity(x_t, sigma, cond, guidance=1.0))
    above = (d_old - d) > 0  # ratio > 1: clipped for A > 0; ratio < 1: clipped for A <= 0
    all_clipped = [1.0 if up else -1.0 for up in above.tolist()]
    result, backend = run_update(rule, policy, rollout, all_clipped, copies)
    assert result.metrics["train/clipfrac"] == 1.0
    assert result.metrics["loss/policy"] != 0.0  # the loss keeps its value ...
    assert all(float(g.abs().max()) == 0.0 for g in backend.grads[0])  # ... but no gradient
    none_clipped = [-a for a in all_clipped]
    result, backend = run_update(rule, policy, rollout, none_clipped, copies)
    assert result.metrics["train/clipfrac"] == 0.0
    assert any(float(g.abs().max()) > 0 for g in backend.grads[0])


def test_timesteps_and_noise_do_not_depend_on_ranks_or_minibatches(policy: Any) -> None:
    """One timestep set per step for every sample; one ε per group and timestep, the same however the groups are
    split over ranks or minibatches, and different between groups."""
    copies = copies_for(policy)

    def draws(groups: list[int], minibatch: int = 0) -> dict[tuple[int, int], tuple[float, torch.Tensor]]:
        """(global sample, m) -> (σ, ε) of the live policy's calls (minibatch by minibatch, each at every m)."""
        rollout = clean_rollout(policy, groups, 2)
        x0 = rollout.states[rollout.sample_node]
        recorder = Recorder(policy, copies)
        try:  # no clip, no KL: only the reference's and the live policy's calls
            layout = DGPOUpdate(
                kl_beta=0.0, clip_dsm=False, num_train_timesteps=2, trunc_steps=4, minibatch_samples=minibatch
            )
            backend = GradBackend(policy.trainable_parameters())
            adv = advantages_of([1.0, -1.0] * len(groups))
            layout.update(context(policy, rollout, adv, backend, copies, SEED, STEP))
        finally:
            recorder.close()
        out = {}
        start, m = 0, 0
        for call in (c for c in recorder.calls if c.weights == "live"):
            assert call.guidance == 1.0
            sigma = float(call.sigma[0])
            assert bool((call.sigma == call.sigma[0]).all()), "one σ for every sample of a call"
            for row in range(call.sigma.numel()):
                eps = (call.latents[row] - (1 - sigma) * x0[start + row]) / sigma
                out[(2 * groups[0] + start + row, m)] = (sigma, eps)
            m += 1
            if m == 2:
                start, m = start + call.sigma.numel(), 0
        return out

    whole = draws([0, 1])
    split = {**draws([0]), **draws([1])}
    minibatched = draws([0, 1], minibatch=2)
    assert whole.keys() == split.keys() == minibatched.keys()
    expected = subset_without_replacement(keyed_generator(SEED, STEP), 4, 2)
    for m in range(2):
        sigmas = {whole[(i, m)][0] for i in range(4)}
        assert sigmas == {float(clean_rollout(policy, [0], 2).sigmas[int(expected[m])])}
        for i in range(4):
            assert whole[(i, m)][0] == split[(i, m)][0] == minibatched[(i, m)][0]
            assert_fp32_close(whole[(i, m)][1], split[(i, m)][1], rtol=1e-4, atol=1e-5)
            assert_fp32_close(whole[(i, m)][1], minibatched[(i, m)][1], rtol=1e-4, atol=1e-5)
        assert_fp32_close(whole[(0, m)][1], whole[(1, m)][1], rtol=1e-4, atol=1e-5)  # shared within group 0
        assert_fp32_close(whole[(2, m)][1], whole[(3, m)][1], rtol=1e-4, atol=1e-5)  # and within group 1
        assert float((whole[(0, m)][1] - whole[(2, m)][1]).abs().max()) > 0.5  # not across groups


@pytest.mark.parametrize(
    ("settings", "nograd"),
    [
        ({}, {REFERENCE: 4, EMA_REF: 4}),  # KL + clip: the reference and the EMA copy
        ({"kl_beta": 0.0, "use_ema_ref": True}, {EMA_REF: 4}),  # S_g against the EMA copy, no KL: no reference
        ({"kl_beta": 0.0, "clip_dsm": False}, {REFERENCE: 4}),  # S_g against the reference, no clip: no EMA copy
        ({"kl_cfg": 4.5, "minibatch_samples": 2}, {REFERENCE: 4, EMA_REF: 4}),  # a CFG reference counts its rows once
    ],
)
def test_counts_equal_what_ran(policy: Any, settings: dict[str, Any], nograd: dict[str, int]) -> None:
    rule = DGPOUpdate(num_train_timesteps=1, trunc_steps=0, **settings)
    rollout = clean_rollout(policy, [0, 1], 2)
    copies = copies_for(policy)
    predicted = rule.train_counts(StepCounts(images=4, trainable_edges=0, rollout_forwards=24, train_forwards=0))
    assert predicted.grad_rows == 4 and dict(predicted.nograd_rows) == nograd
    assert predicted.rows_per_call == settings.get("minibatch_samples", 4)
    recorder = Recorder(policy, copies)
    start = policy.forward_count
    try:
        result, _ = run_update(rule, policy, rollout, [1.0, -1.0, 0.5, -0.5], copies)
    finally:
        recorder.close()
    assert policy.forward_count - start == predicted.grad_rows + predicted.nograd_total
    assert (result.train_forwards, result.reference_forwards) == (predicted.grad_rows, predicted.nograd_total)
    assert dict(result.copy_forwards) == nograd and result.trained_edges == 0 and result.nonfinite_losses == 0
    rows: dict[str, int] = {}
    for call in recorder.calls:  # the reference at kl_cfg, the live policy and the EMA copy without CFG
        rows[call.weights] = rows.get(call.weights, 0) + call.sigma.numel()
        assert call.guidance == (rule.kl_cfg if call.weights == REFERENCE else 1.0)
    assert rows == {"live": 4, **nograd}


def test_groups_stay_whole_in_minibatches() -> None:
    groups = torch.tensor([4, 4, 4, 5, 5, 5, 6, 6, 6])
    assert [c.tolist() for c in group_chunks(groups, 0)] == [list(range(9))]
    assert [c.tolist() for c in group_chunks(groups, 7)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    assert [c.tolist() for c in group_chunks(groups, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="minibatch_samples: 2 is smaller than a prompt group"):
        group_chunks(groups, 2)
    with pytest.raises(ValueError, match="not adjacent"):
        group_chunks(torch.tensor([0, 1, 0]), 0)


def recipe_like(num_steps: int = 10, per_group: int = 4, groups: int = 2, do_cfg: bool = False) -> Any:
    counts = StepCounts(images=per_group * groups, trainable_edges=0, rollout_forwards=0, train_forwards=0)
    return SimpleNamespace(
        sampler=SimpleNamespace(num_steps=num_steps),
        model=SimpleNamespace(do_cfg=do_cfg),
        run=SimpleNamespace(groups_per_step=groups),
        counts=lambda: counts,
    )


def test_validation_names_each_problem() -> None:
    field = "optimizer.init_args."
    assert problems_of(DGPOUpdate, "optimizer", recipe_like()) == []
    assert problems_of(DGPOUpdate, "optimizer", beta_dpo=0.0)[0].startswith(f"{field}beta_dpo:")
    assert problems_of(DGPOUpdate, "optimizer", kl_cfg=0.5)[0].startswith(f"{field}kl_cfg:")
    assert problems_of(DGPOUpdate, "optimizer", train_guidance=0.0)[0].startswith(f"{field}train_guidance:")
    (too_many,) = problems_of(DGPOUpdate, "optimizer", recipe_like(), num_train_timesteps=6, trunc_steps=4)
    assert too_many.startswith(f"{field}num_train_timesteps: 6 distinct timesteps")
    (past,) = problems_of(DGPOUpdate, "optimizer", recipe_like(num_steps=4), trunc_steps=4)
    assert past.startswith(f"{field}trunc_steps: 4 is past the sampler's last step")
    (split,) = problems_of(DGPOUpdate, "optimizer", recipe_like(per_group=4), minibatch_samples=3)
    assert split.startswith(f"{field}minibatch_samples: 3 is smaller than a prompt group (4 samples)")
    (cfg,) = problems_of(DGPOUpdate, "optimizer", recipe_like(do_cfg=False), kl_cfg=4.5)
    assert cfg.startswith(f"{field}kl_cfg: 4.5 needs classifier-free guidance")
    assert problems_of(DGPOUpdate, "optimizer", recipe_like(do_cfg=True), kl_cfg=4.5) == []
    # The reference is not evaluated at all with use_ema_ref and no KL: its guidance does not matter.
    assert problems_of(DGPOUpdate, "optimizer", recipe_like(), kl_cfg=4.5, kl_beta=0.0, use_ema_ref=True) == []


def test_copies_and_rollout_switch() -> None:
    rule = DGPOUpdate(switch_ema_ref=2)
    assert rule.required_copies() == {EMA_REF}
    assert [rule.rollout_copy(step) for step in range(4)] == [None, None, None, EMA_REF]  # upstream: step > switch


@pytest.mark.parametrize(
    "settings",
    [{}, {"kl_beta": 0.0, "use_ema_ref": True}, {"kl_cfg": None, "train_guidance": None, "use_shared_noise": False}],
    ids=["mode-1", "ema-reference", "configured-guidance"],
)
def test_conforms_to_the_update_rule_contract(rlpost_tiny_policy: Any, settings: dict[str, Any]) -> None:
    from rlpost.components.solver_sampler import SolverSampler

    rule = DGPOUpdate(num_train_timesteps=2, trunc_steps=2, **settings)
    check_update_rule(rule, rlpost_tiny_policy, SolverSampler(num_steps=4), groups=2, samples_per_group=2)
