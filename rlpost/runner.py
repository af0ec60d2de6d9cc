"""The online RL loop: prompts -> rollout -> rewards -> advantages -> policy update -> hooks.

There is no algorithm name in this file: what varies between TreeGRPO, DanceGRPO, MixGRPO and DDPO lives in the
sampler, advantage estimator and update rule the recipe chose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlpost.api import UpdateContext
from rlpost.backend import LocalBackend
from rlpost.contract import RewardScores, Rollout, Stash
from rlpost.plugins import PluginHost
from rlpost.prompts import PromptStream
from rlpost.recipe import Recipe
from rlpost.rundir import RunDirectory

__all__ = ["RunContext", "Runner", "resolve_device"]

# Offsets that derive independent RNG streams from the root seed (documented in docs/design.md).
STREAM_ROLLOUT = 1
STREAM_MINIBATCH = 2


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


@dataclass
class RunContext:
    """What lifecycle hooks see.

    Attributes:
        recipe: The validated recipe with its components.
        output_dir: The run directory.
        host: The plugin host.
        step: Number of completed steps.
        rank: This process's rank; ``world_size`` the number of ranks.
        stash: Typed plugin-private state for the run.
        history: Metrics of every completed step (main process).
    """

    recipe: Recipe
    output_dir: Path
    host: PluginHost
    step: int = 0
    rank: int = 0
    world_size: int = 1
    stash: Stash = field(default_factory=Stash)
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (the only rank that prints or writes shared files)."""
        return self.rank == 0


class Runner:
    """Drives a recipe's components through ``run.max_steps`` training steps.

    Args:
        recipe: A validated recipe (see :func:`rlpost.recipe.load_recipe`).
        host: The plugin host whose lifecycle hooks are called.
    """

    def __init__(self, recipe: Recipe, host: PluginHost) -> None:
        self.recipe = recipe
        self.host = host
        self.device = resolve_device(recipe.run.device)
        self.rundir = RunDirectory(Path(recipe.run.output_dir))
        self.ctx = RunContext(recipe=recipe, output_dir=self.rundir.path, host=host)
        seed = recipe.run.seed
        self.rollout_gen = torch.Generator().manual_seed(seed * 1_000_003 + STREAM_ROLLOUT)
        self.minibatch_gen = torch.Generator().manual_seed(seed * 1_000_003 + STREAM_MINIBATCH)
        self.stream: PromptStream | None = None
        self.backend: LocalBackend | None = None

    def setup(self) -> None:
        """Create the run directory, load weights, build the torch optimizer and the prompt stream."""
        r = self.recipe
        self.rundir.create(r.config, self.host)
        r.model.setup(self.device)
        for reward in r.rewards:
            reward.setup(self.device)
        params = r.model.trainable_parameters()
        optimizer = r.torch_optimizer(params)
        scheduler = r.lr_scheduler(optimizer) if r.lr_scheduler is not None else None
        self.backend = LocalBackend(params, optimizer, scheduler, r.run.max_grad_norm)
        self.stream = PromptStream(r.prompts.load(), seed=r.run.seed)

    def score(self, rollout: Rollout) -> RewardScores:
        """Score the rollout's images with every reward source; a non-finite score is an error naming the source."""
        scores = {}
        for reward in self.recipe.rewards:
            values = reward.score(rollout.images, rollout.sample_prompts, rollout.sample_metadata).float().cpu()
            if values.shape != (rollout.num_samples,):
                raise ValueError(
                    f"reward {reward.name!r} returned shape {tuple(values.shape)}, expected ({rollout.num_samples},)"
                )
            if not torch.isfinite(values).all():
                raise FloatingPointError(f"reward {reward.name!r} returned non-finite scores: {values.tolist()}")
            scores[reward.name] = values
        return RewardScores(scores=scores, weights=dict(self.recipe.reward_weights))

    def step(self) -> dict[str, float]:
        """One training step; returns its metrics."""
        assert self.stream is not None and self.backend is not None, "call setup() first"
        r, hook, t = self.recipe, self.host.hook, {"start": time.perf_counter()}
        batch = self.stream.next_batch(r.run.groups_per_step, r.run.samples_per_group)
        with torch.no_grad():
            rollout = r.sampler.rollout(r.model, batch, self.rollout_gen)
        t["rollout"] = time.perf_counter()
        hook.rlpost_after_rollout(run=self.ctx, rollout=rollout)
        scores = self.score(rollout)
        t["reward"] = time.perf_counter()
        hook.rlpost_after_rewards(run=self.ctx, rollout=rollout, scores=scores)
        advantages = r.advantage.estimate(rollout, scores)
        hook.rlpost_after_advantages(run=self.ctx, rollout=rollout, advantages=advantages)
        t["advantage"] = time.perf_counter()
        update = r.optimizer.update(
            UpdateContext(r.model, r.sampler, rollout, advantages, self.backend, self.minibatch_gen, self.ctx.step)
        )
        t["update"] = time.perf_counter()
        metrics = self._metrics(rollout, scores, advantages.metrics, update, t)
        self.ctx.step += 1
        self.ctx.history.append(metrics)
        if self.ctx.is_main_process and self.ctx.step % r.run.log_every == 0:
            self.rundir.log_metrics(self.ctx.step, metrics)
        hook.rlpost_after_step(run=self.ctx, metrics=metrics)
        return metrics

    @staticmethod
    def _metrics(
        rollout: Rollout, scores: RewardScores, adv: dict[str, float], update: dict[str, float], t: dict[str, float]
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, values in scores.scores.items():
            metrics[f"reward/{name}"] = float(values.mean())
        metrics["reward/weighted"] = float(scores.weighted_sum().mean())
        metrics.update({k if "/" in k else f"adv/{k}": v for k, v in adv.items()})
        metrics.update(update)
        metrics.update(rollout.stats)
        metrics["perf/images"] = float(rollout.num_samples)
        metrics["perf/rollout_sec"] = t["rollout"] - t["start"]
        metrics["perf/reward_sec"] = t["reward"] - t["rollout"]
        metrics["perf/advantage_sec"] = t["advantage"] - t["reward"]
        metrics["perf/update_sec"] = t["update"] - t["advantage"]
        metrics["perf/step_sec"] = t["update"] - t["start"]
        if torch.cuda.is_available():
            metrics["perf/peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return metrics

    def state(self) -> dict[str, Any]:
        """Everything needed to continue this run: step, prompt stream, RNG streams, component and plugin state.

        Plugins add their own entries through ``rlpost_save_state`` under ``state["plugins"]``.
        """
        assert self.stream is not None, "call setup() first"
        r = self.recipe
        plugins: dict[str, Any] = {}
        self.host.hook.rlpost_save_state(run=self.ctx, state=plugins)
        return {
            "step": self.ctx.step,
            "prompt_stream": self.stream.state_dict(),
            "rng": {"rollout": self.rollout_gen.get_state(), "minibatch": self.minibatch_gen.get_state()},
            "components": {
                "sampler": r.sampler.state_dict(),
                "advantage": r.advantage.state_dict(),
                "optimizer": r.optimizer.state_dict(),
                "rewards": {reward.name: reward.state_dict() for reward in r.rewards},
            },
            "plugins": plugins,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned (after :meth:`setup`); calls ``rlpost_load_state``."""
        assert self.stream is not None, "call setup() first"
        r = self.recipe
        self.ctx.step = int(state["step"])
        self.stream.load_state_dict(state["prompt_stream"])
        self.rollout_gen.set_state(state["rng"]["rollout"])
        self.minibatch_gen.set_state(state["rng"]["minibatch"])
        comps = state["components"]
        r.sampler.load_state_dict(comps["sampler"])
        r.advantage.load_state_dict(comps["advantage"])
        r.optimizer.load_state_dict(comps["optimizer"])
        for reward in r.rewards:
            reward.load_state_dict(comps["rewards"].get(reward.name, {}))
        self.host.hook.rlpost_load_state(run=self.ctx, state=state["plugins"])

    def run(self) -> list[dict[str, float]]:
        """Set up, run every step, and call ``rlpost_after_run`` with the final status (also on failure)."""
        self.setup()
        self.host.hook.rlpost_before_run(run=self.ctx)
        status = "failed"
        try:
            while self.ctx.step < self.recipe.run.max_steps:
                self.step()
            status = "completed"
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        finally:
            self.rundir.write_summary(status, self.ctx.step, self.ctx.history)
            self.host.hook.rlpost_after_run(run=self.ctx, status=status)
        return self.ctx.history
