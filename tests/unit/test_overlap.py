"""Overlapped rollouts (``run.speedups.overlap_groups``, rlpost/engine/overlap.py): each finished part of a step is
scored while the next part samples, and the results are those of sampling the step's groups in one part."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from rlpost import RewardSource, hookimpl
from rlpost.apps.host import build_host
from rlpost.engine.recipe import RecipeError, parse_recipe, validate
from rlpost.engine.runner import Runner
from tests import toy_components
from tests.toy_components import toy_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY_TREE = str(ROOT / "recipes" / "tiny" / "treegrpo.yaml")
# Counted rows and the sampler's closed form; rewards, advantages and losses up to batch effects of fp32 forwards.
TOL = 1e-5


def _history(tmp_path: Path, name: str, overlap_groups: int) -> tuple[list[dict[str, float]], Runner]:
    host = build_host()
    pairs = [
        ("run.output_dir", str(tmp_path / name)),
        ("run.groups_per_step", "2"),
        ("run.speedups", f"{{overlap_groups: {overlap_groups}}}"),
    ]
    runner = Runner(validate(parse_recipe([TINY_TREE], pairs, host), host), host)
    return runner.run(), runner


def test_overlap_gives_the_rewards_and_advantages_of_one_part(tmp_path: Path) -> None:
    # Two parts of one group each (scored while the next samples) against one part of both groups (no overlap): the
    # same per-group noise streams, so the same samples up to the batch a transformer forward ran at.
    overlapped, runner = _history(tmp_path, "two-parts", overlap_groups=1)
    whole, _ = _history(tmp_path, "one-part", overlap_groups=2)
    counts = runner.recipe.sampler.counts(2, runner.recipe.run.samples_per_group)
    for a, b in zip(overlapped, whole, strict=True):
        assert a["perf/rollout_forwards"] == b["perf/rollout_forwards"] <= counts.rollout_forwards
        assert a["perf/images"] == b["perf/images"] == counts.images
        assert a["train/edges"] == b["train/edges"] == counts.trainable_edges
        for key in ("reward/jpeg-compressibility", "reward/weighted", "adv/std", "loss/policy"):
            if key in a:
                assert abs(a[key] - b[key]) <= TOL, (key, a[key], b[key])
        assert a["perf/reward_sec"] == 0.0  # scoring is inside the rollout phase when overlapped
    assert any("adv/" in k for k in overlapped[0])


# ------------------------------------------------------------------------- the overlap really happens


WATCH: dict[str, Any] = {}
# Generous: each wait ends as soon as the other thread gets there; it only runs out when the overlap is broken.
HANDSHAKE_S = 120.0


class WaitsForTheNextPart(RewardSource):
    """Scores like ``toy-brightness``; its first call (part 0) says it started, then waits until the sampler has begun
    the next part. The sampler's second part in turn starts only once part 0's scoring has started (the wrapper in
    the test), so under overlap the two meet whatever the thread scheduling; without overlap part 1 would be sampled
    before any scoring and both waits run out (recorded as a failure, not a hang)."""

    name: ClassVar[str] = "waits-for-next-part"

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        WATCH.setdefault("threads", []).append(threading.current_thread().name)
        WATCH.setdefault("sizes", []).append(int(images.shape[0]))
        if "first" not in WATCH:
            WATCH["scoring_started"].set()
            WATCH["first"] = WATCH["next_part_sampling"].wait(HANDSHAKE_S)
        return images.float().mean(dim=(1, 2, 3)) / 255.0


class _Plugin:
    @hookimpl
    def rlpost_register_reward_sources(self, register: Any) -> None:
        register(WaitsForTheNextPart)


def test_a_part_is_scored_while_the_next_one_samples(tmp_path: Path) -> None:
    WATCH.clear()
    WATCH.update(scoring_started=threading.Event(), next_part_sampling=threading.Event(), waited=[])
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components, _Plugin()))
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=1, groups_per_step=3, speedups={"overlap_groups": 1})
    cfg["rewards"] = [{"class_path": "waits-for-next-part"}]
    runner = Runner(validate(cfg, host), host)
    sampler = runner.recipe.sampler
    rollout_groups = sampler.rollout_groups
    calls = []

    def next_part_waits_for_scoring(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        if len(calls) == 2:  # part 1 begins only once part 0 is being scored, and says so
            WATCH["waited"].append(WATCH["scoring_started"].wait(HANDSHAKE_S))
            WATCH["next_part_sampling"].set()
        return rollout_groups(*args, **kwargs)

    sampler.rollout_groups = next_part_waits_for_scoring  # type: ignore[method-assign]
    (metrics,) = runner.run()
    assert len(calls) == 3 and not any(name.startswith("rlpost-overlap") for name in calls)
    assert WATCH["waited"] == [True], "part 1 was sampled before part 0's scoring started"
    assert WATCH["first"] is True, "the first part's scoring saw no sampling of the next part"
    assert WATCH["sizes"] == [4, 4, 4]  # one call per part of one group of 4 samples
    assert all(name.startswith("rlpost-overlap") for name in WATCH["threads"])
    assert metrics["perf/images"] == 12


def test_bad_overlap_groups_are_a_recipe_problem(tmp_path: Path) -> None:
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components,))
    with pytest.raises(RecipeError, match=r"run\.speedups\.overlap_groups: must be >= 0"):
        validate(toy_recipe(str(tmp_path / "run"), speedups={"overlap_groups": -1}), host)
    assert torch.is_grad_enabled()


def test_the_worker_scores_with_half_the_threads_and_leaves_the_samplers_alone() -> None:
    """The scoring thread gets half the intra-op threads (at least one); the calling thread keeps its own."""
    from rlpost.core.contract import PromptBatch, RewardScores
    from rlpost.engine.overlap import sample_and_score
    from rlpost.ops.sampling import RolloutBuilder

    def part(j: int) -> Any:
        batch = PromptBatch([f"p{j}"], [{}], 1, group_offset=j)
        builder = RolloutBuilder(batch, torch.linspace(1, 0, 2), ["ode"])
        node = builder.add_nodes(torch.zeros(1, 1, 2, 2), 0, torch.zeros(1, dtype=torch.long))
        return builder.build(node, torch.zeros(1, 1, 4, 4, 3, dtype=torch.uint8))

    seen: list[int] = []

    def score(rollout: Any) -> RewardScores:
        seen.append(torch.get_num_threads())
        return RewardScores(scores={"r": torch.ones(rollout.num_samples)}, weights={"r": 1.0})

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        merged, scores = sample_and_score((part(j) for j in range(3)), score)
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
        assert merged.num_samples == 3 and scores.scores["r"].tolist() == [1.0, 1.0, 1.0]
    finally:
        torch.set_num_threads(before)
