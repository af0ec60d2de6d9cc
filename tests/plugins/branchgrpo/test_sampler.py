"""The branch sampler on the tiny SD3: closed-form counts = counted rows, the split noise, pruning as upstream prunes,
and importance ratio 1 before any update."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlpost.core.contract import PromptBatch, Rollout
from rlpost_branchgrpo.sampler import BranchSampler
from tests.argument_checks import problems_of

PROMPTS = ["a red cube", "a blue sphere", "a green cone"]


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir: Any) -> Any:
    from rlpost.models import SD3Policy
    from rlpost.models.adapter_settings import LoraSpec

    p = SD3Policy(
        str(tiny_sd3_dir),
        dtype="float32",
        resolution=32,
        guidance_scale=1.0,
        max_sequence_length=32,
        time_grid="shifted-linspace",
        shift=3.0,
        lora=LoraSpec(rank=4, alpha=8),
    )
    p.setup(torch.device("cpu"))
    return p


def run(policy: Any, sampler: BranchSampler, groups: int = 2, step: int = 0, seed: int = 0) -> tuple[Rollout, int]:
    batch = PromptBatch(prompts=PROMPTS[:groups], metadata=[{}] * groups, samples_per_group=4)
    policy.encode(batch.prompts)  # only transformer rows are counted below
    sampler.begin_step(step, torch.Generator().manual_seed(seed + 1))
    before = policy.forward_count
    with torch.no_grad():
        rollout = sampler.rollout(policy, batch, torch.Generator().manual_seed(seed))
    return rollout, policy.forward_count - before


def sizes(steps: int, splits: list[int], k: int) -> list[int]:
    """Nodes per tree at each depth, counted by growing the frontier one step at a time."""
    out = [1]
    for t in range(steps):
        out.append(out[-1] * (k if t in splits else 1))
    return out


@pytest.mark.parametrize(
    ("steps", "splits", "k", "final", "extra", "step"),
    [
        (4, [0, 1], 2, 1, {}, 0),
        (5, [1, 3], 3, 1, {"chunk_size": 3}, 0),  # chunking must not change counts
        (6, [0, 2], 2, 2, {"depth_pruning": [2]}, 0),
        (6, [0, 1], 2, 1, {"width_pruning": "best-per-branch"}, 0),
        (7, [0, 2], 2, 1, {"depth_pruning": [5, 6], "depth_pruning_slide": True, "slide_interval": 1}, 3),
        (6, [0], 2, 1, {"depth_pruning": [3], "prune_until_step": 1}, 4),  # pruning over: every SDE step trained
    ],
)
def test_counts_equal_counted_rows(
    policy: Any, steps: int, splits: list[int], k: int, final: int, extra: dict[str, Any], step: int
) -> None:
    sampler = BranchSampler(num_steps=steps, split_points=splits, num_splits=k, final_ode_steps=final, **extra)
    assert sampler.validate(None) == []
    g = 2
    rollout, forwards = run(policy, sampler, groups=g, step=step)
    c = sampler.step_counts(g, 4)
    n = sizes(steps, splits, k)
    assert rollout.num_samples == c.images == g * n[-1]
    assert forwards == c.rollout_forwards == rollout.stats["perf/rollout_forwards"] == g * sum(n[:-1])
    assert int(rollout.trainable.sum()) == c.trainable_edges
    train = rollout.trainable.nonzero().flatten()
    ev = sampler.evaluate(policy, rollout, train)
    assert ev.forwards == c.train_forwards == int(torch.unique(rollout.edge_parent[train]).numel())
    # Trained edges are SDE edges with finite log-probs; the final ODE steps are never trained.
    assert bool(torch.isfinite(rollout.old_log_probs[train]).all())
    assert int(rollout.edge_step[train].max()) < steps - final
    assert bool(torch.isnan(rollout.old_log_probs[rollout.edge_step >= steps - final]).all())
    assert bool((rollout.node_step[rollout.sample_node] == steps).all())
    assert all(int((rollout.sample_group == j).sum()) == n[-1] for j in range(g))


def test_split_children_are_wider_than_their_density(policy: Any) -> None:
    """Split children are μ + scale·z·s but scored under N(μ, s²): the recorded log-prob is that density's."""
    scale = 4.0
    sampler = BranchSampler(num_steps=4, split_points=[0, 1], split_noise_scale=scale)
    rollout, _ = run(policy, sampler, groups=1)
    edges = torch.arange(rollout.num_edges)[rollout.edge_kernel == 0]
    ev = sampler.evaluate(policy, rollout, edges)
    child = rollout.states[rollout.edge_child[edges]]
    z = ((child - ev.mean.detach()) / ev.std.detach()).flatten(1)
    split = rollout.edge_step[edges] <= 1
    assert z[split].std().item() == pytest.approx(scale, rel=0.1)
    assert z[~split].std().item() == pytest.approx(1.0, rel=0.1)
    # Gaussian log-density with the unscaled std, per-element mean, computed here from its formula.
    s = ev.std.detach().flatten(1)
    logp = (-0.5 * z**2 - torch.log(s) - 0.5 * torch.log(torch.tensor(2 * torch.pi))).mean(1)
    assert torch.allclose(logp.double(), rollout.old_log_probs[edges], atol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ratio_is_one_before_the_first_update(policy: Any, reduction: str) -> None:
    from tests.unit.components.chain_helpers import perturb_lora

    perturb_lora(policy, seed=1)  # a LoRA that changes the velocity, so the ratio test is not trivially 1
    sampler = BranchSampler(num_steps=4, split_points=[0, 2], logprob_reduction=reduction)  # type: ignore[arg-type]
    rollout, _ = run(policy, sampler, seed=5)
    train = rollout.trainable.nonzero().flatten()
    ev = sampler.evaluate(policy, rollout, train)
    old = rollout.old_log_probs[train]
    dev = (torch.exp(ev.log_prob.detach().double() - old) - 1).abs().max().item()
    ulp = torch.finfo(torch.float32).eps * old.abs().max().item()
    assert dev <= (1e-6 if reduction == "mean" else 4 * ulp)
    assert ev.log_prob.requires_grad


def upstream_pruned_steps(
    step1: int,
    total: int,
    splits: list[int],
    depths: list[int],
    slide: bool,
    interval: int,
    stop: int | None,
    width: int,
    ratio: float,
) -> list[int]:
    """Upstream's pruning (L1268-1420) over one leaf chain's sample dicts, in its DFS order with tied advantages."""
    samples = [{"step": t, "child_depth": t + 1, "adv": 0.25} for t in range(total)]
    if depths:
        active = sorted(depths)
        if slide:
            stop_depth = max(splits) if stop is None else stop
            shift = min(max(0, step1 // max(1, interval)), max(0, active[0] - stop_depth))
            active = [d - shift for d in active]
        samples = [s for s in samples if s["child_depth"] not in set(active)]
    if width == 1:
        last = max(splits)
        other = [s for s in samples if s["step"] <= last]
        tail = [s for s in samples if s["step"] > last]
        keep = max(1, int(len(tail) * ratio))
        samples = other + sorted(tail, key=lambda s: s["adv"], reverse=True)[:keep]
    return sorted(s["step"] for s in samples)


@pytest.mark.parametrize(
    ("depths", "slide", "interval", "stop", "width", "step"),
    [
        ([], False, 1, None, 1, 0),
        ([15, 16, 17, 18], False, 1, None, 0, 0),
        ([15, 16, 17, 18], True, 30, 9, 0, 95),  # the launch script's sliding window after 96 steps
        ([15, 16, 17, 18], True, 30, 9, 0, 400),  # slide capped at the stop depth
        ([12, 13], True, 1, None, 1, 1),
    ],
)
def test_pruning_matches_upstream(
    depths: list[int], slide: bool, interval: int, stop: int | None, width: int, step: int
) -> None:
    # Upstream samples every step with the SDE; final_ode_steps 0 is not allowed here, so compare the SDE steps of a
    # 21-step schedule with upstream's 20 (the extra last step is our untrained ODE step to 0).
    splits = [0, 3, 6, 9]
    sampler = BranchSampler(
        num_steps=21,
        split_points=splits,
        depth_pruning=depths or None,
        depth_pruning_slide=slide,
        slide_interval=interval,
        stop_depth=stop,
        width_pruning="best-per-branch" if width else "off",
    )
    expected = upstream_pruned_steps(step + 1, 20, splits, depths, slide, interval, stop, width, 0.5)
    assert sampler.trained_steps(step) == expected


def test_validation_names_fields() -> None:
    assert any("split_points" in p for p in BranchSampler(num_steps=4, split_points=[3]).validate(None))
    assert any("split_points" in p for p in BranchSampler(num_steps=4, split_points=[]).validate(None))
    pruned = BranchSampler(num_steps=3, split_points=[0], depth_pruning=[1, 2])
    assert any("depth_pruning" in p for p in pruned.validate(None))
    assert problems_of(BranchSampler, "sampler", eta=0.0)  # declared range: eta > 0
