"""Per-step sampler state advances once per training step, whatever the rank and group counts.

For every first-party sampler, on the tiny SD3: one rank holding 4 groups, two in-process ranks holding 2 groups
each (``GroupSharding``), one group per step and the single-process path (``LocalSharding``) must give the same
per-step schedule: the same TreeGRPO window start and MixGRPO window for every group of a step, MixGRPO's scheduler
counting one iteration per step, and the same per-group trained steps for DanceGRPO/DDPO. A resumed sampler (fresh
instance + ``load_state_dict``) continues the schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlpost.components.prompts import PromptStream
from rlpost.core.api import Sampler
from rlpost.core.contract import Rollout
from rlpost.engine.sharding import GroupSharding, LocalSharding, merge_rollouts
from rlpost_dancegrpo.sampler import DanceGRPOSampler
from rlpost_ddpo.sampler import DDPOSampler
from rlpost_mixgrpo.sampler import MixGRPOSampler
from rlpost_mixgrpo.window import WindowScheduler
from rlpost_treegrpo.sampler import TreeSampler

SEED = 5
STEPS = 3
GROUPS = 4
PER_GROUP = 2
PROMPTS = [(f"a photo of object {i}", {}) for i in range(5)]

# Small enough for CPU, large enough that windows move every step (MixGRPO: 4 starts, shift every step; a fixed
# window of 4 groups per step would land every group-0 rollout on start 0 under a per-group advance).
SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "tree": lambda: TreeSampler(num_steps=4, k=2, depth=1, window="uniform"),
    "mix": lambda: MixGRPOSampler(num_steps=6, window_size=1, shift_interval=1, window_stride=1),
    "dance": lambda: DanceGRPOSampler(num_steps=3, timestep_fraction=0.5),
    "ddpo": lambda: DDPOSampler(num_steps=3, timestep_fraction=0.5),
}
SHARED_WINDOW = {"tree", "mix"}  # samplers whose schedule is one window per step


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir: Any) -> Any:
    from rlpost.models import SD3Policy

    p = SD3Policy(str(tiny_sd3_dir), dtype="float32", resolution=32, guidance_scale=1.0, max_sequence_length=32)
    p.setup(torch.device("cpu"))
    return p


def group_patterns(rollout: Rollout) -> dict[int, tuple[tuple[int, ...], tuple[bool, ...]]]:
    """Per global group: the schedule index and trainable flag of each of its edges, in edge order."""
    edge_group = rollout.node_group[rollout.edge_child]
    out = {}
    for g in torch.unique(edge_group).tolist():
        sel = edge_group == g
        out[rollout.group_offset + int(g)] = (
            tuple(rollout.edge_step[sel].tolist()),
            tuple(rollout.trainable[sel].tolist()),
        )
    return out


def trained_steps(pattern: tuple[tuple[int, ...], tuple[bool, ...]]) -> tuple[int, ...]:
    """The distinct schedule indices a group trains (its window, for tree and mix)."""
    return tuple(sorted({s for s, t in zip(*pattern, strict=True) if t}))


def run_sharded(
    make: Callable[[], Sampler],
    policy: Any,
    world: int,
    groups: int,
    first: int = 0,
    state: dict[str, Any] | None = None,
) -> tuple[list[dict[int, Any]], list[Sampler], list[dict[str, Any]]]:
    """Steps ``first … STEPS-1`` with ``groups`` groups per step split over ``world`` in-process ranks (one fresh
    sampler per rank, as in separate processes, given ``state`` when resuming): the per-step patterns of the merged
    (gathered) rollout, the samplers, and rank 0's sampler ``state_dict`` after each step."""
    samplers = [make() for _ in range(world)]
    for sampler in samplers:
        if state is not None:
            sampler.load_state_dict(state)
    streams = [PromptStream(PROMPTS, seed=SEED) for _ in range(world)]
    shards = [GroupSharding(SEED, r, world, gather=lambda obj: [obj]) for r in range(world)]
    patterns, states = [], []
    for step in range(first, STEPS):
        parts = []
        for r in range(world):
            batch = shards[r].next_batch(streams[r], groups, PER_GROUP)
            with torch.no_grad():
                parts.append(shards[r].rollout(samplers[r], policy, batch, step))
        patterns.append(group_patterns(merge_rollouts(parts)))
        states.append(samplers[0].state_dict())
    return patterns, samplers, states


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_schedule_independent_of_ranks_and_groups(name: str, policy: Any) -> None:
    make = SAMPLERS[name]
    one_rank, (single,), states = run_sharded(make, policy, world=1, groups=GROUPS)
    two_ranks, pair, _ = run_sharded(make, policy, world=2, groups=GROUPS)
    one_group, (lone,), _ = run_sharded(make, policy, world=1, groups=1)
    assert two_ranks == one_rank, "2 ranks x 2 groups must sample what 1 rank x 4 groups samples"
    for step in range(STEPS):
        assert sorted(one_rank[step]) == list(range(GROUPS))
        assert one_group[step][0] == one_rank[step][0], f"step {step}: group 0 differs with 1 vs {GROUPS} groups/step"
        if name in SHARED_WINDOW:
            windows = {trained_steps(p) for p in one_rank[step].values()}
            assert len(windows) == 1, f"step {step}: groups of one step train different windows {windows}"
    if name == "mix":
        expected = WindowScheduler(num_steps=6, window_size=1, shift_interval=1, stride=1).sequence(STEPS)
        assert [trained_steps(one_rank[s][0]) for s in range(STEPS)] == [(i,) for i in expected]
        # One iteration per training step on every rank, whatever the number of groups it sampled.
        for sampler in (single, *pair, lone):
            assert isinstance(sampler, MixGRPOSampler)
            assert sampler.scheduler.iteration == STEPS - 1
    # Resume: fresh samplers given the state saved after step 1 sample the last step as the uninterrupted run.
    resumed, _, _ = run_sharded(make, policy, world=2, groups=GROUPS, first=STEPS - 1, state=states[STEPS - 2])
    assert resumed[0] == one_rank[STEPS - 1]
    if name in SHARED_WINDOW:
        # The single-process path derives per-step state from the same (seed, step) generator.
        sampler, stream = make(), PromptStream(PROMPTS, seed=SEED)
        local = LocalSharding(SEED, torch.Generator().manual_seed(123), torch.Generator().manual_seed(0))
        for step in range(STEPS):
            with torch.no_grad():
                rollout = local.rollout(sampler, policy, local.next_batch(stream, GROUPS, PER_GROUP), step)
            windows = {trained_steps(p) for p in group_patterns(rollout).values()}
            assert windows == {trained_steps(one_rank[step][0])}, f"step {step}: local and sharded windows differ"
