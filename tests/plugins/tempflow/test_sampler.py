"""The comb sampler on the tiny SD3: closed-form counts = counted rows, the comb topology, ODE completion of each
child, and importance ratio 1 before any update."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlpost.core.contract import PromptBatch, Rollout
from rlpost_tempflow.sampler import TempFlowSampler

PROMPTS = ["a red cube", "a blue sphere"]


@pytest.fixture(scope="module")
def policies(tiny_sd3_dir: Any) -> dict[float, Any]:
    """One tiny SD3 policy per guidance scale (3.0: CFG doubles the transformer batch), with LoRA."""
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


def run(policy: Any, sampler: TempFlowSampler, seed: int = 0, groups: int = 2) -> tuple[Rollout, int]:
    batch = PromptBatch(prompts=PROMPTS[:groups], metadata=[{}] * groups, samples_per_group=1)
    policy.encode(batch.prompts)  # warm the prompt cache so only transformer forwards are counted below
    before = policy.forward_count
    with torch.no_grad():
        rollout = sampler.rollout(policy, batch, torch.Generator().manual_seed(seed))
    return rollout, policy.forward_count - before


def expected_rows(steps: int, k: int, branch: list[int], trunks: int, groups: int, tail: int | None = None) -> int:
    """Per trunk: one trunk row per step up to the last branch step, ``min(tail, T-i-1)`` rows per child."""
    n = [steps - i - 1 if tail is None else min(tail, steps - i - 1) for i in branch]
    return groups * trunks * (max(branch) + 1 + k * sum(n))


@pytest.mark.parametrize(
    ("steps", "k", "branch", "trunks", "guidance", "chunk", "tail"),
    [
        (4, 2, None, 1, 1.0, 64, None),
        (4, 3, None, 1, 3.0, 5, None),  # CFG (rows before doubling) and chunking
        (5, 2, [0, 2], 2, 1.0, 64, None),  # two trunks per prompt, a subset of steps
        (4, 2, [1, 3], 1, 1.0, 64, None),  # a branch at the last step: its children are the samples
        (6, 2, None, 1, 1.0, 64, 2),  # shortened Euler tail
    ],
)
def test_counts_match_counted_rows(
    policies: dict[float, Any],
    steps: int,
    k: int,
    branch: list[int] | None,
    trunks: int,
    guidance: float,
    chunk: int,
    tail: int | None,
) -> None:
    extra: dict[str, Any] = {} if tail is None else {"tail": "euler", "tail_steps": tail}
    sampler = TempFlowSampler(
        num_steps=steps, k=k, branch_steps=branch, trunks_per_prompt=trunks, chunk_size=chunk, **extra
    )
    assert sampler.validate(None) == []
    g = 2
    rollout, forwards = run(policies[guidance], sampler, groups=g)
    rollout.validate()
    c = sampler.counts(g, samples_per_group=1)
    b = list(range(steps - 1)) if branch is None else branch
    assert forwards == c.rollout_forwards == expected_rows(steps, k, b, trunks, g, tail)
    assert rollout.stats["perf/rollout_forwards"] == forwards
    assert rollout.num_samples == c.images == g * trunks * k * len(b) == rollout.media.shape[0]
    assert int(rollout.trainable.sum()) == c.trainable_edges == c.images
    parents = torch.unique(rollout.edge_parent[rollout.trainable])
    assert parents.numel() == c.train_forwards == g * trunks * len(b)


def test_upstream_preset_counts() -> None:
    # T=10, k=6, every step but the last: 9 trunk rows + 6·(9+8+…+1) = 279 rows and 54 images per trunk.
    c = TempFlowSampler().counts(num_groups=1, samples_per_group=1)
    assert c.rollout_forwards == 9 + 6 * sum(9 - i for i in range(9)) == 279
    assert c.images == c.trainable_edges == 54 and c.train_forwards == 9


def test_comb_topology_and_ode_completion(policies: dict[float, Any]) -> None:
    steps, k = 4, 2
    sampler = TempFlowSampler(num_steps=steps, k=k, chunk_size=64)
    policy = policies[1.0]
    rollout, _ = run(policy, sampler, groups=1)
    sig = rollout.sigmas
    # Trunk: a chain of ODE edges through steps 0..T-2; every trunk node up to T-2 has k trainable children + 1 trunk.
    train = rollout.trainable
    branch_parents = rollout.edge_parent[train]
    assert torch.unique(rollout.node_step[branch_parents]).tolist() == list(range(steps - 1))
    counts = rollout.children_count()
    for p in torch.unique(branch_parents).tolist():
        step = int(rollout.node_step[p])
        assert int((branch_parents == p).sum()) == k
        assert int(counts[p]) == k + (1 if step < steps - 2 else 0)
    # Each branch child follows single-child ODE edges to exactly one sample, with independent Euler steps.
    child_of = {int(p): int(c) for p, c in zip(rollout.edge_parent, rollout.edge_child, strict=True)}
    samples = set(rollout.sample_node.tolist())
    cond = policy.encode(rollout.prompts)
    for e in train.nonzero().flatten().tolist():
        node = int(rollout.edge_child[e])
        x = rollout.states[node : node + 1]
        while node not in samples:
            assert int(counts[node]) == 1
            t = int(rollout.node_step[node])
            with torch.no_grad():
                v = policy.velocity(x, sig[t : t + 1], cond.select(torch.tensor([0])))
            x = x + (sig[t + 1] - sig[t]) * v  # Euler: x' = x + (σ' - σ)·v
            node = child_of[node]
            torch.testing.assert_close(x, rollout.states[node : node + 1], rtol=1e-4, atol=1e-5)
            x = rollout.states[node : node + 1]
        assert int(rollout.node_step[node]) == steps  # completed to σ = 0
    # The trunk itself is never decoded: every sample descends from a branch edge.
    assert len(samples) == int(train.sum())


def test_children_are_drawn_around_the_flow_sde_mean(policies: dict[float, Any]) -> None:
    # The k children of a trunk node at step j are μ_j + S_j·z with Flow-GRPO's mean and std (restated here).
    sampler = TempFlowSampler(num_steps=4, k=3, kernel_args={"noise_level": 0.7})
    policy = policies[1.0]
    rollout, _ = run(policy, sampler, groups=1)
    cond = policy.encode(rollout.prompts)
    sig = rollout.sigmas.double()
    for p in torch.unique(rollout.edge_parent[rollout.trainable]).tolist():
        t = int(rollout.node_step[p])
        x = rollout.states[p : p + 1].double()
        with torch.no_grad():
            v = policy.velocity(rollout.states[p : p + 1], rollout.sigmas[t : t + 1], cond.select(torch.tensor([0])))
        s, dt = sig[t], sig[t + 1] - sig[t]
        denom = sig[1] if s >= 1 else s
        std_t = 0.7 * torch.sqrt(s / (1 - denom))
        mean = x + dt * (v.double() + std_t**2 / (2 * s) * (x + (1 - s) * v.double()))
        S = std_t * torch.sqrt(-dt)
        kids = rollout.edge_child[(rollout.edge_parent == p) & rollout.trainable]
        z = (rollout.states[kids].double() - mean) / S
        assert z.shape[0] == 3
        assert 0.5 < float(z.std()) < 1.5  # standard normal draws around the mean (tiny latents: 3·16·4·4 values)
        assert abs(float(z.mean())) < 0.2


def test_ratio_is_one_before_any_update(policies: dict[float, Any]) -> None:
    sampler = TempFlowSampler(num_steps=4, k=2, trunks_per_prompt=2)
    policy = policies[3.0]
    rollout, _ = run(policy, sampler)
    trained = rollout.trainable.nonzero().flatten()
    before = policy.forward_count
    evaluation = sampler.evaluate(policy, rollout, trained)
    assert policy.forward_count - before == evaluation.forwards == sampler.counts(2, 1).train_forwards
    ratio = torch.exp(evaluation.log_prob.detach() - rollout.old_log_probs[trained])
    assert float((ratio - 1).abs().max()) <= 1e-6


def test_per_group_generators_match_one_rollout_per_group(policies: dict[float, Any]) -> None:
    sampler = TempFlowSampler(num_steps=3, k=2)
    policy = policies[1.0]
    batch = PromptBatch(prompts=PROMPTS, metadata=[{}, {}], samples_per_group=1)
    with torch.no_grad():
        both = sampler.rollout_groups(policy, batch, [torch.Generator().manual_seed(s) for s in (5, 6)])
        one = sampler.rollout(policy, PromptBatch([PROMPTS[1]], [{}], 1), torch.Generator().manual_seed(6))
    n = one.num_samples
    torch.testing.assert_close(both.states[both.sample_node[n:]], one.states[one.sample_node], rtol=1e-4, atol=1e-5)


def test_validate_names_the_field() -> None:
    problems = TempFlowSampler(num_steps=4, branch_steps=[0, 4]).validate(None)
    assert any("sampler.init_args.branch_steps" in p for p in problems)
    problems = TempFlowSampler(num_steps=4, tail_steps=2).validate(None)
    assert any("sampler.init_args.tail" in p for p in problems)
