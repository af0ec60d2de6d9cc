"""The tree sampler on the tiny SD3: closed-form counts, topology, and ratio 1 with unchanged parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlpost.core.contract import PromptBatch, Rollout
from rlpost_treegrpo.advantage import TreeBackupAdvantage
from rlpost_treegrpo.sampler import WINDOW_START, TreeSampler

PROMPTS = ["a red cube", "a blue sphere"]


@pytest.fixture(scope="module")
def policies(tiny_sd3_dir: Any) -> dict[float, Any]:
    """One tiny SD3 policy per guidance scale (1.0: no CFG; 3.0: CFG doubles the transformer batch), with LoRA."""
    from rlpost.models import SD3Policy
    from rlpost.models._common import LoraSpec

    out = {}
    for g in (1.0, 3.0):
        policy = SD3Policy(
            str(tiny_sd3_dir),
            dtype="float32",
            resolution=32,
            guidance_scale=g,
            max_sequence_length=32,
            lora=LoraSpec(rank=4, alpha=8),
        )
        policy.setup(torch.device("cpu"))
        out[g] = policy
    return out


def run(policy: Any, sampler: TreeSampler, seed: int = 0, groups: int = 2) -> tuple[Rollout, int]:
    batch = PromptBatch(prompts=PROMPTS[:groups], metadata=[{}] * groups, samples_per_group=4)
    policy.encode(batch.prompts)  # warm the prompt cache so only transformer forwards are counted below
    before = policy.forward_count
    sampler.begin_step(0, torch.Generator().manual_seed(seed + 1))  # the step's window start
    with torch.no_grad():
        rollout = sampler.rollout(policy, batch, torch.Generator().manual_seed(seed))
    return rollout, policy.forward_count - before


@pytest.mark.parametrize(
    ("steps", "k", "depth", "start", "trees", "guidance", "chunk"),
    [
        (4, 2, 1, 0, 1, 1.0, 64),
        (4, 2, 2, 1, 1, 1.0, 3),  # chunking must not change counts
        (4, 3, 2, 0, 1, 3.0, 64),  # CFG: counts are batch rows before doubling
        (5, 2, 3, 1, 2, 1.0, 64),  # two trees per prompt
        (3, 2, 2, 0, 1, 1.0, 64),  # window ends right before the last step
    ],
)
def test_counts_match_closed_form(
    policies: dict[float, Any], steps: int, k: int, depth: int, start: int, trees: int, guidance: float, chunk: int
) -> None:
    sampler = TreeSampler(
        num_steps=steps, k=k, depth=depth, window="fixed", fixed_start=start, trees_per_prompt=trees, chunk_size=chunk
    )
    assert sampler.validate(None) == []
    g = 2
    rollout, forwards = run(policies[guidance], sampler, groups=g)
    c = sampler.counts(g, samples_per_group=4)
    assert rollout.stash[WINDOW_START] == start
    assert rollout.num_samples == c.images == g * trees * k**depth
    assert int(rollout.trainable.sum()) == c.trainable_edges == g * trees * sum(k**j for j in range(1, depth + 1))
    assert (
        forwards
        == c.rollout_forwards
        == g * trees * (start + sum(k**j for j in range(depth)) + k**depth * (steps - start - depth))
    )
    assert rollout.stats["perf/rollout_forwards"] == forwards
    window_parents = torch.unique(rollout.edge_parent[rollout.trainable]).numel()
    assert window_parents == c.train_forwards
    # Topology: every step is one edge layer; trainable edges are exactly the window steps.
    assert torch.equal(torch.unique(rollout.edge_step[rollout.trainable]), torch.arange(start, start + depth))
    assert bool(torch.isnan(rollout.old_log_probs[~rollout.trainable]).all())
    assert bool(torch.isfinite(rollout.old_log_probs[rollout.trainable]).all())
    assert bool((rollout.node_step[rollout.sample_node] == steps).all())
    assert torch.equal(rollout.children_count()[rollout.sample_node], torch.zeros(c.images, dtype=torch.long))
    branching = rollout.children_count()
    assert int((branching == k).sum()) == c.train_forwards and int((branching > k).sum()) == 0
    # Leaves of one prompt group are contiguous and the group sizes are trees·k^d.
    assert torch.equal(torch.bincount(rollout.sample_group), torch.full((g,), trees * k**depth))
    assert rollout.images.shape == (c.images, 32, 32, 3)
    # One shared initial noise per tree: exactly g·trees root nodes.
    assert int((rollout.node_step == 0).sum()) == g * trees


def test_window_parents_share_one_gaussian(policies: dict[float, Any]) -> None:
    """k children are drawn around the same mean: recomputing the mean per parent explains every child's log-prob."""
    sampler = TreeSampler(num_steps=4, k=3, depth=2, window="fixed", fixed_start=1)
    rollout, _ = run(policies[1.0], sampler)
    edges = rollout.trainable.nonzero().flatten()
    ev = sampler.evaluate(policies[1.0], rollout, edges)
    parents, inverse = rollout.parents_of(edges)
    assert ev.forwards == parents.numel() == 2 * (1 + 3)
    for p in range(parents.numel()):
        sel = inverse == p
        assert int(sel.sum()) == 3
        assert torch.allclose(ev.mean[sel], ev.mean[sel][:1].expand_as(ev.mean[sel]))


@pytest.mark.parametrize(("reduction", "guidance"), [("mean", 1.0), ("mean", 3.0), ("sum", 1.0), ("sum", 3.0)])
def test_recomputed_ratio_is_one(policies: dict[float, Any], reduction: str, guidance: float) -> None:
    sampler = TreeSampler(num_steps=4, k=2, depth=2, window="geometric", logprob_reduction=reduction)  # type: ignore[arg-type]
    rollout, _ = run(policies[guidance], sampler, seed=3)
    edges = rollout.trainable.nonzero().flatten()
    ev = sampler.evaluate(policies[guidance], rollout, edges)
    old = rollout.old_log_probs[edges]
    dev = (torch.exp(ev.log_prob.detach() - old) - 1).abs().max().item()
    if reduction == "mean":
        assert dev <= 1e-6
    else:
        # Summed log-probs are O(latent elements) (~1.4e3 here, ~6.5e4 for SD3.5 at 512 px) and fp32 resolves them
        # only to one ulp (1.2e-4 here): the rollout and training forwards batch different rows, so the last bit can
        # differ. The ratio is then exact up to a few ulps of |log π| -- see docs/algorithms/treegrpo.md.
        ulp = torch.finfo(torch.float32).eps * old.abs().max().item()
        assert dev <= 4 * ulp
    assert ev.log_prob.requires_grad  # gradients reach the LoRA parameters


def test_rollout_is_reproducible_and_backup_runs(policies: dict[float, Any]) -> None:
    sampler = TreeSampler(num_steps=4, k=2, depth=2)
    a, _ = run(policies[1.0], sampler, seed=7)
    b, _ = run(policies[1.0], sampler, seed=7)
    assert torch.equal(a.states, b.states) and a.stash[WINDOW_START] == b.stash[WINDOW_START]
    from rlpost.core.contract import RewardScores

    rewards = a.images.float().mean(dim=(1, 2, 3))
    adv = TreeBackupAdvantage().estimate(a, RewardScores({"r": rewards}, {"r": 1.0}))
    assert adv.edges.shape == (a.num_edges,) and torch.isfinite(adv.edges).all()
    assert adv.metrics["adv/backup_ess"] == pytest.approx(2.0, abs=1e-2)  # mean reduction: near-uniform weights


def test_counts_expectation_and_worst_case() -> None:
    s = TreeSampler(num_steps=10, k=3, depth=3, ratio=0.5)
    c = s.counts(1, 1)
    assert (c.images, c.trainable_edges, c.train_forwards) == (27, 39, 13)  # arXiv 2512.08153 tree-shape ablation
    assert c.rollout_forwards == s.rollout_forwards_at(0, 1) == 0 + 13 + 27 * 7
    expected = sum(p * s.rollout_forwards_at(i, 1) for i, p in enumerate(s.window_probs().tolist()))
    assert s.expected_rollout_forwards(1) == pytest.approx(expected)
    assert s.expected_rollout_forwards(1) < c.rollout_forwards
