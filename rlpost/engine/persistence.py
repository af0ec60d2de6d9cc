"""A run's state in and out of checkpoints: what the runner saves and restores, next to the on-disk format
(:mod:`rlpost.engine.checkpoint`).

The runner hands its parts over as a :class:`RunState` (plain references, built once at set-up), so this module never
imports the runner: :func:`gather_state` / :func:`restore_state` turn the parts into the pickle-free state tree and
back; :func:`save_checkpoint` / :func:`load_checkpoint` add the weights, EMA, diffusers artefacts, manifest, rotation
and the run directory's resume record. What a checkpoint holds is described in ``docs/checkpoints.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from rlpost.components.prompts import PromptStream
from rlpost.core.context import RunContext
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.core.plugins import PluginHost
from rlpost.engine.backend import EngineBackend
from rlpost.engine.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointInfo,
    find_checkpoint,
    list_checkpoints,
    read_checkpoint,
    rotate,
    write_checkpoint,
)
from rlpost.engine.ema import EMA
from rlpost.engine.guards import Guards
from rlpost.engine.recipe import Recipe, state_breaking_changes
from rlpost.engine.rundir import RunDirectory
from rlpost.engine.weight_copies import EngineCopies
from rlpost.engine.weights import write_diffusers_artifacts

__all__ = [
    "RunState",
    "check_resume",
    "gather_state",
    "load_checkpoint",
    "published_weights",
    "restore_state",
    "save_checkpoint",
    "state_problems",
]


@dataclass(frozen=True)
class RunState:
    """The parts of a set-up run that a checkpoint saves or restores (references, not copies: restoring writes
    into them).

    Attributes:
        recipe: The run's recipe (components, ``checkpoint`` section, config for the manifest).
        host: The plugin host (``rlpost_save_state`` / ``rlpost_load_state``, component origins).
        ctx: The run context (step counter, history, main-process flag).
        seed: The run's seed (the checkpoint's, when a resume changed it).
        rollout_gen: The rollout noise stream (stream 1).
        minibatch_gen: The minibatch shuffling stream (stream 2).
        stream: The prompt stream.
        backend: Weights, torch optimizer, LR scheduler and step counters.
        guards: The non-finite guards (their skipped-step counter).
        ema: The EMA shadow, or ``None``.
        copies: The named weight copies (saved in the run state, restored exactly).
        rundir: The run directory (checkpoints, stored recipe, resume record).
        barrier: Waits for every rank (a no-op in one process).
    """

    recipe: Recipe
    host: PluginHost
    ctx: RunContext
    seed: int
    rollout_gen: torch.Generator
    minibatch_gen: torch.Generator
    stream: PromptStream
    backend: EngineBackend
    guards: Guards
    ema: EMA | None
    copies: EngineCopies
    rundir: RunDirectory
    barrier: Callable[[], None]


def gather_state(run: RunState) -> dict[str, Any]:
    """Everything needed to continue the run except the trainable weights: step, prompt stream, every RNG stream,
    torch optimizer and LR scheduler, component and plugin state, guard counters.

    Plugins add their own entries through ``rlpost_save_state`` under ``state["plugins"]``.
    """
    r, backend = run.recipe, run.backend
    # Checked per plugin before anything is written: a value that cannot be saved names its plugin and the
    # last good checkpoint on disk stays as it is.
    plugins = run.host.save_state(run.ctx)
    rng: dict[str, Any] = {
        "rollout": run.rollout_gen.get_state(),
        "minibatch": run.minibatch_gen.get_state(),
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return {
        "step": run.ctx.step,
        "seed": run.seed,
        "prompt_stream": run.stream.state_dict(),
        "rng": rng,
        "torch_optimizer": backend.optimizer.state_dict(),
        "lr_scheduler": backend.scheduler.state_dict() if backend.scheduler is not None else None,
        "backend": {"num_steps": backend.num_steps, "skipped_steps": backend.skipped_steps},
        "guards": {"skipped_steps": run.guards.skipped_steps},
        "components": {
            "sampler": r.sampler.state_dict(),
            "advantage": r.advantage.state_dict(),
            "optimizer": r.optimizer.state_dict(),
            "rewards": {reward.name: reward.state_dict() for reward in r.rewards},
        },
        "plugins": plugins,
        "copies": run.copies.state_dict(),  # collective under ZeRO (gathers each copy's shards)
    }


# What restore_state needs from a state tree, and of which type (gather_state writes all of it).
_STATE_LAYOUT: tuple[tuple[str, type], ...] = (
    ("step", int),
    ("prompt_stream", dict),
    ("rng", dict),
    ("rng.rollout", torch.Tensor),
    ("rng.minibatch", torch.Tensor),
    ("components", dict),
    ("components.sampler", dict),
    ("components.advantage", dict),
    ("components.optimizer", dict),
    ("components.rewards", dict),
    ("plugins", dict),
)


def state_problems(state: dict[str, Any]) -> list[str]:
    """What is missing from a state tree or of the wrong type (e.g. a hand-edited ``state.json``), by dotted key."""
    problems = []
    for key, kind in _STATE_LAYOUT:
        *parents, leaf = key.split(".")
        node: Any = state
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue  # its parent is missing or of the wrong type: reported already
        if leaf not in node:
            problems.append(f"{key}: missing")
        elif not isinstance(node[leaf], kind) or isinstance(node[leaf], bool):
            problems.append(f"{key}: expected {kind.__name__}, got {type(node[leaf]).__name__}")
    return problems


@contextlib.contextmanager
def _restoring(source: str, part: str) -> Iterator[None]:
    """Turn a part of the state that does not fit what it is loaded into (torch, NumPy and the components raise
    ``KeyError``/``TypeError``/``ValueError``/...) into a :class:`CheckpointError` naming the file and the part;
    a plugin's own failure keeps naming the plugin."""
    try:
        yield
    except PluginRuntimeError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise CheckpointError(f"{source}: {part} cannot be restored ({type(exc).__name__}: {exc})") from None


def restore_state(run: RunState, state: dict[str, Any], source: str = "the run state") -> None:
    """Restore what :func:`gather_state` returned into ``run``'s parts; calls ``rlpost_load_state``.

    Raises:
        CheckpointError: ``state`` lacks a part or a part does not fit (named with ``source``, e.g. the
            checkpoint's ``state.json``).
    """
    problems = state_problems(state)
    if problems:
        raise CheckpointError(f"{source}: not a run state ({'; '.join(problems[:5])})")
    r, backend = run.recipe, run.backend
    run.ctx.step = int(state["step"])
    with _restoring(source, "prompt_stream"):
        run.stream.load_state_dict(state["prompt_stream"])
    rng = state["rng"]
    with _restoring(source, "rng"):
        run.rollout_gen.set_state(rng["rollout"])
        run.minibatch_gen.set_state(rng["minibatch"])
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(_as_tuple(rng["python"]))
            np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    with _restoring(source, "torch_optimizer"):
        if "torch_optimizer" in state:
            backend.optimizer.load_state_dict(state["torch_optimizer"])
    with _restoring(source, "lr_scheduler"):
        if state.get("lr_scheduler") is not None and backend.scheduler is not None:
            backend.scheduler.load_state_dict(state["lr_scheduler"])
    with _restoring(source, "backend/guards counters"):
        counters = state.get("backend", {})
        backend.num_steps = int(counters.get("num_steps", 0))
        backend.skipped_steps = int(counters.get("skipped_steps", 0))
        run.guards.skipped_steps = int(state.get("guards", {}).get("skipped_steps", 0))
    comps = state["components"]
    for name in ("sampler", "advantage", "optimizer"):
        with _restoring(source, f"components.{name}"):
            getattr(r, name).load_state_dict(comps[name])
    for reward in r.rewards:
        with _restoring(source, f"components.rewards.{reward.name}"):
            reward.load_state_dict(comps["rewards"].get(reward.name, {}))
    with _restoring(source, "copies"):  # a state from before weight copies existed holds none
        run.copies.load_state_dict(state.get("copies") or {})
    run.host.load_state(run.ctx, state["plugins"])


@contextlib.contextmanager
def published_weights(ema: EMA | None, backend: EngineBackend | None, whole: bool = False) -> Iterator[None]:
    """EMA weights swapped in when EMA is enabled (evaluation, diffusers artefacts); live weights otherwise.

    ``whole``: also gather ZeRO-3's partitioned trainable parameters, for saving them from the module. Collective
    under ZeRO: every rank enters.
    """
    with ema.swapped() if ema is not None else contextlib.nullcontext():
        with backend.gathered() if whole and backend is not None else contextlib.nullcontext():
            yield


def save_checkpoint(run: RunState, reason: str = "periodic") -> Path | None:
    """Write a checkpoint of ``run`` (main process) and rotate old ones; returns its directory (``None`` on the
    other ranks, which take part in the collective gathers).

    Raises:
        CheckpointError: The trainable (or EMA) weights are not finite: nothing is written.
    """
    r, ctx = run.recipe, run.ctx
    # Collective under ZeRO: every rank takes part in gathering weights and optimizer state; rank 0 writes.
    weights = run.backend.full_state_dict()
    state = gather_state(run)
    ema = run.ema.state_dict() if run.ema is not None else None  # collective under ZeRO, like the weights
    if not ctx.is_main_process:
        # Rank 0 saves the artefacts from its module, EMA swapped in, ZeRO-3 partitions gathered: take part.
        with published_weights(run.ema, run.backend, whole=True):
            pass
        run.barrier()
        return None
    config_text = yaml.safe_dump(r.config, sort_keys=False)

    def artefacts(directory: Path) -> None:
        with published_weights(run.ema, run.backend, whole=True):
            write_diffusers_artifacts(r.model, directory)

    manifest = {
        "reason": reason,
        "recipe_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "base_model": (r.config.get("model", {}).get("init_args") or {}).get("pretrained"),
        "components": {k: getattr(r, k).name for k in ("model", "sampler", "advantage", "optimizer")},
        # Which plugin registered each: the sampler's names the algorithm on the exported model card.
        "origins": {k: run.host.component_origin(k, getattr(r, k))[1] for k in ("sampler", "advantage")},
        "rewards": [reward.name for reward in r.rewards],
        "ema": run.ema is not None,
        "media": r.model.media,  # "image" or "video": the exported card's pipeline_tag
    }
    path = write_checkpoint(
        run.rundir.path,
        ctx.step,
        weights,
        state,
        extra=artefacts,
        ema=ema,
        manifest_extra=manifest,
    )
    (path.parent / "latest.json").write_text(json.dumps({"step": ctx.step, "path": path.name}))
    rotate(run.rundir.path, r.checkpoint.keep_last)
    run.barrier()
    return path


def load_checkpoint(run: RunState, info: CheckpointInfo) -> None:
    """Restore weights, EMA and state from a checkpoint into ``run`` (set up, with everything built); the main
    process truncates the metrics to the checkpoint's step and records the resume in the run directory.

    Raises:
        CheckpointError: The checkpoint does not verify, or the recipe enables EMA and it holds no EMA weights.
    """
    weights, state, ema = read_checkpoint(info)
    source = str(info.path / "state.json")
    problems = state_problems(state)  # checked before any weight is replaced
    if not problems and state["step"] != info.step:
        problems.append(f"step: {state['step']}, but {MANIFEST} says {info.step}")
    if problems:
        raise CheckpointError(f"{source}: not a run state ({'; '.join(problems[:5])})")
    run.backend.load_full_state_dict(weights)
    if run.ema is not None:
        if ema is None:
            raise CheckpointError(f"{info.path}: the recipe enables ema but the checkpoint holds no EMA weights")
        run.ema.load_state_dict(ema)
    restore_state(run, state, source)
    config, stored = run.recipe.config, run.rundir.stored_recipe()
    changed = sorted(k for k in set(config) | set(stored) if config.get(k) != stored.get(k))
    if run.ctx.is_main_process:  # truncates metrics and records the resume: rank 0 only
        run.ctx.history = run.rundir.reopen(run.ctx.step, str(info.path), changed)
    run.barrier()


def _as_tuple(obj: Any) -> Any:
    """JSON turned Python's RNG state tuples into lists; ``random.setstate`` needs tuples again."""
    if isinstance(obj, list):
        return tuple(_as_tuple(v) for v in obj)
    return obj


def check_resume(
    resume: str, run_dir: Path, config: dict[str, Any], seed: int
) -> tuple[CheckpointInfo | None, Path, int]:
    """Where a resume continues, checked before anything heavy loads.

    Args:
        resume: ``"latest"``, a run directory or a checkpoint directory.
        run_dir: This run's directory (where ``"latest"`` is looked up).
        config: This run's resolved recipe, compared with the stored one.
        seed: This run's ``run.seed``.

    Returns:
        The checkpoint, the run directory it belongs to (a resume always continues the checkpoint's own run
        directory) and the seed to use: the stored one (a changed ``run.seed`` is ignored, with a warning). The
        checkpoint is ``None`` for ``"latest"`` in a run directory without one: the run restarts from step 0 in it
        (:meth:`rlpost.engine.rundir.RunDirectory.check_restart`), with this recipe and seed.

    Raises:
        CheckpointError: No such checkpoint, a run that cannot be restarted, no or an unreadable stored recipe, or
            the recipe changed in a way the checkpoint cannot honour
            (:func:`rlpost.engine.recipe.state_breaking_changes`).
    """
    import warnings

    if resume == "latest" and not list_checkpoints(run_dir):
        RunDirectory(run_dir).check_restart()
        return None, run_dir, seed
    info = find_checkpoint(resume, run_dir)
    own = info.path.parent.parent
    stored = RunDirectory(own).stored_recipe()
    breaking = state_breaking_changes(stored, config)
    if breaking:
        raise CheckpointError(
            f"cannot resume from {info.path}: the recipe changed in a way the checkpoint cannot honour:\n  - "
            + "\n  - ".join(breaking)
            + "\nstart a new run (another run.output_dir) instead"
        )
    stored_seed = int(stored.get("run", {}).get("seed", seed))
    if stored_seed != seed:
        warnings.warn(
            f"run.seed changed from {stored_seed} to {seed}; resuming with the checkpoint's seed and RNG "
            "states (the new seed is ignored)",
            UserWarning,
            stacklevel=3,
        )
    return info, own, stored_seed
