"""rlpost.components.chain: the chain samplers' ``rollout_groups`` runs every group in one batch (one transformer call
per step instead of one per group and step) and draws what one rollout per group draws (the distributed path and
``run.speedups.overlap_groups`` use it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlpost.core.api import Sampler
from rlpost.core.contract import PromptBatch
from rlpost.core.merge import merge_rollouts
from rlpost_dancegrpo.sampler import DanceGRPOSampler
from rlpost_ddpo.sampler import DDPOSampler
from rlpost_mixgrpo.sampler import MixGRPOSampler

GROUPS, PER_GROUP, STEPS = 3, 2, 4
SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "dance": lambda: DanceGRPOSampler(num_steps=STEPS, timestep_fraction=0.5),
    "mix": lambda: MixGRPOSampler(num_steps=STEPS, window_size=2),
    "ddpo": lambda: DDPOSampler(num_steps=STEPS, timestep_fraction=0.5),
}


@pytest.fixture(scope="module")
def policy(tiny_sd3_dir: Any) -> Any:
    from rlpost.models import SD3Policy

    p = SD3Policy(str(tiny_sd3_dir), dtype="float32", resolution=32, guidance_scale=1.0, max_sequence_length=32)
    p.setup(torch.device("cpu"))
    return p


def _generators() -> list[torch.Generator]:
    return [torch.Generator().manual_seed(40 + j) for j in range(GROUPS)]


def _calls(policy: Any, run: Callable[[], Any]) -> tuple[Any, int]:
    calls = []
    handle = policy.transformer.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            return run(), len(calls)
    finally:
        handle.remove()


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_rollout_groups_is_one_batch_with_each_groups_own_draws(name: str, policy: Any) -> None:
    sampler = SAMPLERS[name]()
    sampler.begin_step(0, torch.Generator().manual_seed(0))
    batch = PromptBatch([f"a photo of object {j}" for j in range(GROUPS)], [{}] * GROUPS, PER_GROUP, group_offset=2)
    together, batched_calls = _calls(policy, lambda: sampler.rollout_groups(policy, batch, _generators()))
    alone_parts = []
    per_group_calls = 0
    for j, g in enumerate(_generators()):
        one = PromptBatch([batch.prompts[j]], [{}], PER_GROUP, group_offset=2 + j)
        part, n = _calls(policy, lambda one=one, g=g: sampler.rollout(policy, one, g))
        alone_parts.append(part)
        per_group_calls += n
    alone = merge_rollouts(alone_parts)
    assert batched_calls == STEPS and per_group_calls == GROUPS * STEPS  # guidance 1: one transformer call per step
    assert together.sample_group.tolist() == alone.sample_group.tolist()
    assert int((together.media.int() - alone.media.int()).abs().max()) <= 1
    for group in range(GROUPS):
        pick = [r.trainable & (r.node_group[r.edge_child] == group) for r in (together, alone)]
        a, b = (torch.sort(r.old_log_probs[m]).values for r, m in zip((together, alone), pick, strict=True))
        assert a.shape == b.shape and a.numel() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        steps = [sorted(r.edge_step[m].tolist()) for r, m in zip((together, alone), pick, strict=True)]
        assert steps[0] == steps[1]  # the same trained subset per group (DanceGRPO/DDPO draw it per group)


def test_a_missing_generator_is_refused(policy: Any) -> None:
    batch = PromptBatch(["a", "b"], [{}, {}], PER_GROUP)
    for make in SAMPLERS.values():
        sampler = make()
        sampler.begin_step(0, torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match="2 groups but 1 generators"):
            sampler.rollout_groups(policy, batch, _generators()[:1])
