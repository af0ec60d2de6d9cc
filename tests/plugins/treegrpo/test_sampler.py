"""The tree sampler on the tiny SD3: closed-form counts, topology, and ratio 1 with unchanged parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlpost.core.contract import PromptBatch, Rollout
from rlpost_treegrpo.advantage import TreeBackupAdvantage
from rlpost_treegrpo.sampler import TreeSampler

PROMPTS = ["a red cube", "a blue sphere"]


@pytest.fixture(scope="module")
def policies(tiny_sd3_dir: Any) -> dict[float, Any]:
    """One tiny SD3 policy per guidance scale (1.0: no CFG; 3.0: CFG doubles the transformer batch), with LoRA."""
    from rlpost.models import SD3Policy
    from rlpost.models.adapter_settings import LoraSpec

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
    assert rollout.stats["tree/window_start"] == start == sampler.window_start
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
    assert rollout.media.shape == (c.images, 1, 32, 32, 3)
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
    assert torch.equal(a.states, b.states) and a.stats["tree/window_start"] == b.stats["tree/window_start"]
    from rlpost.core.contract import RewardScores

    rewards = a.media.float().mean(dim=(1, 2, 3, 4))
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


def _canonical(rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainable edges' old log-probs and child states ordered by (group, step), keeping the in-layer order (parents
    in order, children of a parent adjacent): the same order whether groups were sampled together or alone."""
    edges = rollout.trainable.nonzero().flatten()
    child = rollout.edge_child[edges]
    key = rollout.node_group[child] * 1000 + rollout.node_step[child]
    order = torch.sort(key, stable=True).indices
    return rollout.old_log_probs[edges[order]], rollout.states[child[order]]


@pytest.mark.parametrize("tail", [{}, {"tail": "dpm-solver++", "tail_steps": 2}])
def test_groups_batched_in_one_forward_equal_groups_sampled_alone(policies: dict[float, Any], tail: Any) -> None:
    """Four groups in one rollout_groups call (one transformer call per depth) give the leaves, window edges and
    log-probs of four one-group rollouts with the same per-group generators, with the same transformer rows."""
    from rlpost.engine.sharding import merge_rollouts
    from tests.tolerances import assert_fp32_close, assert_pixels_close

    policy = policies[3.0]
    prompts = ["a red cube", "a blue sphere", "a green cone", "a white torus"]
    sampler = TreeSampler(num_steps=5, k=2, depth=2, trees_per_prompt=2, chunk_size=64, **tail)
    batch = PromptBatch(prompts=prompts, metadata=[{}] * 4, samples_per_group=4, group_offset=8)
    policy.encode(prompts)
    sampler.begin_step(0, torch.Generator().manual_seed(11))

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + j) for j in range(4)]

    with torch.no_grad():
        rows0 = policy.forward_count
        together = sampler.rollout_groups(policy, batch, gens())
        rows_together = policy.forward_count - rows0
        parts = []
        for j, g in enumerate(gens()):
            one = PromptBatch([prompts[j]], [{}], 4, group_offset=8 + j)
            parts.append(sampler.rollout(policy, one, g))
        alone = merge_rollouts(parts)
        rows_alone = policy.forward_count - rows0 - rows_together
    assert (
        rows_together == rows_alone == together.stats["perf/rollout_forwards"] == alone.stats["perf/rollout_forwards"]
    )
    assert together.stats["perf/rollout_calls"] * 4 == alone.stats["perf/rollout_calls"]
    assert together.group_offset == alone.group_offset == 8
    assert together.sample_group.tolist() == alone.sample_group.tolist()
    assert_fp32_close(together.states[together.sample_node], alone.states[alone.sample_node])
    assert_pixels_close(together.media, alone.media)
    lp_t, x_t = _canonical(together)
    lp_a, x_a = _canonical(alone)
    assert_fp32_close(lp_t, lp_a)
    assert_fp32_close(x_t, x_a)
    # The groups really differ (per-group generators, not one shared draw).
    assert (together.states[together.sample_node][:8] - together.states[together.sample_node][8:16]).abs().max() > 0.1


def test_rollout_groups_checks_its_generators(policies: dict[float, Any]) -> None:
    sampler = TreeSampler(num_steps=3, k=2, depth=1)
    sampler.begin_step(0, torch.Generator().manual_seed(0))
    batch = PromptBatch(prompts=PROMPTS, metadata=[{}] * 2, samples_per_group=1)
    with pytest.raises(ValueError, match="2 groups but 1 generators"):
        sampler.rollout_groups(policies[1.0], batch, [torch.Generator()])
