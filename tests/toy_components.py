"""Toy components for core tests (defined in the test suite, never shipped as product).

A 2x2 single-channel "latent" with a linear velocity field stands in for the denoiser, so the runner, recipe and
plugin machinery can be tested end to end in milliseconds. The sampler draws independent chains with the real
Flow-GRPO SDE kernel and the shared sampling helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from rlpost import hookimpl
from rlpost.core.api import (
    AdvantageEstimator,
    Advantages,
    Conditioning,
    EdgeEval,
    Policy,
    RewardSource,
    Sampler,
    StepCounts,
    resolve_guidance,
)
from rlpost.core.contract import PromptBatch, RewardScores, Rollout
from rlpost.ops.kernels import make_kernel
from rlpost.ops.sampling import RolloutBuilder, evaluate_edges


class ToyPolicy(Policy):
    """Velocity ``v = a * x + b_prompt`` with trainable ``a`` and per-prompt-hash bias; with ``guidance_scale > 1``,
    classifier-free guidance against a constant negative-prompt bias (``negative_bias``), as SD3 combines it.

    Args:
        scale: Initial value of ``a``.
        guidance_scale: The configured (rollout) guidance; ``> 1`` turns CFG on.
    """

    name: ClassVar[str] = "toy-policy"

    def __init__(self, scale: float = -1.0, guidance_scale: float = 1.0) -> None:
        self.scale = scale
        self.guidance_scale = guidance_scale
        self.a: nn.Parameter | None = None
        self.forward_count = 0

    def setup(self, device: torch.device) -> None:
        self.a = nn.Parameter(torch.tensor(self.scale))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def sigmas(self, num_steps: int) -> Tensor:
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def initial_noise(self, num: int, generator: torch.Generator) -> Tensor:
        return torch.randn((num, 1, 2, 2), generator=generator)

    def encode(self, prompts: Sequence[str]) -> Conditioning:
        bias = torch.tensor([(sum(map(ord, p)) % 7) / 7.0 for p in prompts])
        if self.guidance_scale <= 1.0:
            return Conditioning({"bias": bias})
        return Conditioning({"bias": bias, "negative_bias": torch.full((len(prompts),), -0.5)})

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance: float | None = None) -> Tensor:
        assert self.a is not None
        scale = resolve_guidance(guidance, self.guidance_scale, can_guide=self.guidance_scale > 1.0)
        self.forward_count += latents.shape[0]
        text = self.a * latents + cond.tensors["bias"].view(-1, 1, 1, 1)
        if scale <= 1.0:
            return text
        uncond = self.a * latents + cond.tensors["negative_bias"].view(-1, 1, 1, 1)
        return uncond + scale * (text - uncond)

    def decode(self, latents: Tensor) -> Tensor:
        img = ((latents.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return img.repeat(1, 3, 1, 1).permute(0, 2, 3, 1).unsqueeze(1).contiguous()  # [B, 1, H, W, 3]: one frame

    def trainable_parameters(self) -> list[nn.Parameter]:
        assert self.a is not None
        return [self.a]


class ToyChainSampler(Sampler):
    """Independent SDE chains, ``samples_per_group`` per group, every step trainable.

    Args:
        num_steps: Denoising steps.
    """

    name: ClassVar[str] = "toy-chain"
    provides: ClassVar[frozenset[str]] = frozenset({"chain", "clean-samples", "edge-log-probs"})

    def __init__(self, num_steps: int = 3) -> None:
        self.num_steps = num_steps
        self.kernels = [make_kernel("flow-sde", noise_level=0.7)]

    def validate(self, recipe: Any) -> list[str]:
        return [] if self.num_steps >= 1 else [f"sampler.init_args.num_steps: must be >= 1, got {self.num_steps}"]

    def rollout(self, policy: Policy, batch: PromptBatch, generator: torch.Generator) -> Rollout:
        n = batch.num_groups * batch.samples_per_group
        groups = torch.arange(batch.num_groups).repeat_interleave(batch.samples_per_group)
        sigmas = policy.sigmas(self.num_steps)
        cond = policy.encode(batch.prompts).select(groups)
        builder = RolloutBuilder(batch, sigmas, ["flow-sde"])
        x = policy.initial_noise(n, generator)
        ids = builder.add_nodes(x, 0, groups)
        for i in range(self.num_steps):
            s, s_next = sigmas[i].expand(n), sigmas[i + 1].expand(n)
            out = self.kernels[0].step(x, policy.velocity(x, s, cond), s, s_next, generator)
            child = builder.add_nodes(out.next_latents, i + 1, groups)
            builder.add_edges(ids, child, out.log_prob, trainable=True, kernel=0)
            x, ids = out.next_latents, child
        return builder.build(ids, policy.decode(x))

    def evaluate(self, policy: Policy, rollout: Rollout, edges: Tensor) -> EdgeEval:
        return evaluate_edges(policy, rollout, edges, self.kernels, "mean")

    def counts(self, num_groups: int, samples_per_group: int) -> StepCounts:
        n = num_groups * samples_per_group
        return StepCounts(n, n * self.num_steps, n * self.num_steps, n * self.num_steps)


class ToyMeanReward(RewardSource):
    """Mean pixel brightness in [0, 1]."""

    name: ClassVar[str] = "toy-brightness"

    def score(self, images: Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> Tensor:
        return images.float().mean(dim=(1, 2, 3)) / 255.0


class ToyGroupAdvantage(AdvantageEstimator):
    """Per-group z-score of the weighted reward, copied to every edge of the sample's chain."""

    name: ClassVar[str] = "toy-group"
    requires: ClassVar[frozenset[str]] = frozenset({"chain"})

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        r = scores.weighted_sum()
        adv = torch.zeros_like(r)
        for g in rollout.sample_group.unique():
            m = rollout.sample_group == g
            adv[m] = (r[m] - r[m].mean()) / (r[m].std() + 1e-8)
        # Walk each chain backwards from its sample node, giving every edge the sample's advantage.
        node_adv = torch.zeros(rollout.num_nodes)
        node_adv[rollout.sample_node] = adv
        parent_of = torch.full((rollout.num_nodes,), -1, dtype=torch.long)
        parent_of[rollout.edge_child] = rollout.edge_parent
        edge_adv = torch.zeros(rollout.num_edges)
        child_to_edge = torch.full((rollout.num_nodes,), -1, dtype=torch.long)
        child_to_edge[rollout.edge_child] = torch.arange(rollout.num_edges)
        frontier = rollout.sample_node.clone()
        values = adv.clone()
        while True:
            e = child_to_edge[frontier]
            keep = e >= 0
            if not keep.any():
                break
            edge_adv[e[keep]] = values[keep]
            frontier, values = parent_of[frontier[keep]], values[keep]
        return Advantages(edges=edge_adv, samples=adv, metrics={"abs_mean": float(adv.abs().mean())})


class ToyTreeOnlyAdvantage(AdvantageEstimator):
    """An estimator that needs a tree (used to test the compatibility check)."""

    name: ClassVar[str] = "toy-tree-only"
    requires: ClassVar[frozenset[str]] = frozenset({"tree"})

    def estimate(self, rollout: Rollout, scores: RewardScores) -> Advantages:
        raise NotImplementedError


@hookimpl
def rlpost_register_models(register: Any) -> None:
    register(ToyPolicy)


@hookimpl
def rlpost_register_samplers(register: Any) -> None:
    register(ToyChainSampler)


@hookimpl
def rlpost_register_reward_sources(register: Any) -> None:
    register(ToyMeanReward)


@hookimpl
def rlpost_register_advantage_estimators(register: Any) -> None:
    register(ToyGroupAdvantage)
    register(ToyTreeOnlyAdvantage)


def toy_recipe(output_dir: str, **run: Any) -> dict[str, Any]:
    """A complete recipe dict using the toy components."""
    return {
        "run": {
            "seed": 0,
            "output_dir": output_dir,
            "max_steps": 3,
            "groups_per_step": 2,
            "samples_per_group": 4,
            "progress": False,
            **run,
        },
        "model": {"class_path": "toy-policy"},
        "prompts": {"class_path": "prompt-list", "init_args": {"prompts": ["a cat", "a dog", "a fish"]}},
        "sampler": {"class_path": "toy-chain", "init_args": {"num_steps": 3}},
        "rewards": [{"class_path": "toy-brightness"}],
        "advantage": {"class_path": "toy-group"},
        "optimizer": {"class_path": "clipped-surrogate", "init_args": {"clip_range": 0.2, "minibatch_edges": 8}},
        "torch_optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}},
    }
