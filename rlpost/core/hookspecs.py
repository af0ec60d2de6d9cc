"""Hook specifications: the whole surface a plugin can implement.

A plugin is a module (or object) with functions decorated by :data:`rlpost.hookimpl` whose names match the specs
below, registered through the ``rlpost`` entry-point group::

    [project.entry-points.rlpost]
    myreward = "rlpost_myreward"

Registration hooks hand plugins a typed :class:`~rlpost.core.registry.Registry`; plugins register component *classes*
(which name themselves). The recipe, not the set of installed plugins, decides which component runs: behaviour is
never chosen by ``firstresult`` hooks, so an ablation is a one-line recipe overlay.

Lifecycle hooks are called by the runner at fixed points; every implementation runs and return values are ignored.
Implementations may accept fewer arguments than the spec (pluggy's opt-in arguments), so new arguments can be
appended without breaking plugins. Every hook is documented in ``docs/plugin_hooks.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from rlpost.core.api import (
        AdvantageEstimator,
        Advantages,
        Policy,
        PolicyOptimizer,
        PromptSource,
        RewardSource,
        Sampler,
    )
    from rlpost.core.context import RunContext, RunStatus
    from rlpost.core.contract import RewardScores, Rollout
    from rlpost.core.registry import Registry

PROJECT = "rlpost"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marker for plugin hook implementations: ``from rlpost import hookimpl``."""

__all__ = [
    "hookimpl",
    "hookspec",
    "rlpost_after_advantages",
    "rlpost_after_rewards",
    "rlpost_after_rollout",
    "rlpost_after_run",
    "rlpost_after_step",
    "rlpost_before_run",
    "rlpost_load_state",
    "rlpost_register_advantage_estimators",
    "rlpost_register_models",
    "rlpost_register_optimizers",
    "rlpost_register_prompt_sources",
    "rlpost_register_reward_sources",
    "rlpost_register_samplers",
    "rlpost_save_state",
]

# -------------------------------------------------------------------------------------------------------------
# Registration hooks: called once per process, after plugins are loaded and before the recipe is parsed (so
# short component names from plugins resolve). Every implementation runs.
# -------------------------------------------------------------------------------------------------------------


@hookspec
def rlpost_register_samplers(register: Registry[Sampler]) -> None:
    """Register sampler classes (rollouts that record per-step log-probs).

    :param register: Call ``register(SamplerClass)``; the class names itself with ``name`` and declares the
        capabilities it ``provides`` (e.g. ``{"tree"}``).
    """


@hookspec
def rlpost_register_advantage_estimators(register: Registry[AdvantageEstimator]) -> None:
    """Register advantage-estimator classes.

    :param register: Call ``register(EstimatorClass)``; the class declares what it ``requires`` of the sampler.
    """


@hookspec
def rlpost_register_reward_sources(register: Registry[RewardSource]) -> None:
    """Register reward-source classes. Load heavy models in ``setup()``, never at import or registration.

    :param register: Call ``register(RewardClass)``.
    """


@hookspec
def rlpost_register_optimizers(register: Registry[PolicyOptimizer]) -> None:
    """Register policy-update rules (clipped surrogate, KL terms, minibatching). Torch optimizers are not
    registered: the recipe names them (``torch_optimizer: {class_path: torch.optim.AdamW, ...}``).

    :param register: Call ``register(RuleClass)``.
    """


@hookspec
def rlpost_register_models(register: Registry[Policy]) -> None:
    """Register policy model adapters (SD3, FLUX, ...).

    :param register: Call ``register(PolicyClass)``.
    """


@hookspec
def rlpost_register_prompt_sources(register: Registry[PromptSource]) -> None:
    """Register prompt sources (files, Hugging Face datasets, built-in prompt sets).

    :param register: Call ``register(PromptSourceClass)``.
    """


# -------------------------------------------------------------------------------------------------------------
# Lifecycle hooks: called by the runner, on every rank (check ``run.is_main_process`` before printing or
# writing files). Implementations should only read their arguments.
# -------------------------------------------------------------------------------------------------------------


@hookspec
def rlpost_before_run(run: RunContext) -> None:
    """Called once after components are built and the policy is set up, before the first step.

    :param run: The run context (recipe, components, output directory, step counter, stash).
    """


@hookspec
def rlpost_after_rollout(run: RunContext, rollout: Rollout) -> None:
    """Called after the sampler produced this step's rollout, before rewards are computed.

    :param run: The run context.
    :param rollout: Nodes, edges, old log-probs and decoded media (``[S, F, H, W, 3]``, ``F = 1`` for images).
    """


@hookspec
def rlpost_after_rewards(run: RunContext, rollout: Rollout, scores: RewardScores) -> None:
    """Called after every reward source scored the rollout's samples.

    :param run: The run context.
    :param rollout: This step's rollout.
    :param scores: Per-source scores (never pre-summed) and their recipe weights.
    """


@hookspec
def rlpost_after_advantages(run: RunContext, rollout: Rollout, advantages: Advantages) -> None:
    """Called after the advantage estimator ran, before the policy update.

    :param run: The run context.
    :param rollout: This step's rollout.
    :param advantages: Per-edge and per-sample advantages.
    """


@hookspec
def rlpost_after_step(run: RunContext, metrics: Mapping[str, float]) -> None:
    """Called after the policy update of every step, with that step's metrics (progress bars, trackers).

    :param run: The run context; ``run.step`` is the number of completed steps.
    :param metrics: Namespaced metrics (``reward/*``, ``adv/*``, ``loss/*``, ``train/*``, ``perf/*``).
    """


@hookspec
def rlpost_save_state(run: RunContext, state: dict[str, Any]) -> None:
    """Called when a checkpoint is written; add JSON-serialisable entries under your plugin's own key.

    :param run: The run context.
    :param state: Mutable mapping saved into the checkpoint's ``plugins.json``.
    """


@hookspec
def rlpost_load_state(run: RunContext, state: Mapping[str, Any]) -> None:
    """Called when a run resumes from a checkpoint, with what ``rlpost_save_state`` stored.

    :param run: The run context.
    :param state: The mapping saved by ``rlpost_save_state`` implementations.
    """


@hookspec
def rlpost_after_run(run: RunContext, status: RunStatus) -> None:
    """Called once when the run ends, also when it stops early, fails or is interrupted.

    :param run: The run context; ``run.step`` is the number of completed steps, ``run.history`` their metrics.
    :param status: How the run ended, a ``str`` enum equal to its value: ``"completed"`` (every step ran),
        ``"stopped"`` (the reward-hacking alarm asked the run to end early, ``eval.alarm.stop``), ``"failed"`` or
        ``"interrupted"``.
    """
