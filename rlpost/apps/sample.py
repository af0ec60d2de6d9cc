"""``rlpost sample``: images from a run's checkpoint.

:func:`sample_run` rebuilds the policy from the run's ``recipe.yaml``, loads the checkpoint's trainable weights (EMA
weights when the run kept them) and samples PNGs with the held-out ODE sampler. Only the ``model`` section is built
(:func:`rlpost.engine.recipe.build_section`): the run's reward plugins, prompt files, trackers and launcher settings
play no part in sampling, so a run samples on a host that lacks them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlpost.core.api import Policy
from rlpost.core.plugins import PluginHost
from rlpost.engine.backend import resolve_device
from rlpost.engine.checkpoint import find_checkpoint, read_checkpoint
from rlpost.engine.evaluation import ode_sample
from rlpost.engine.recipe import RecipeError, RunConfig, build_section, device_problem
from rlpost.engine.rundir import RunDirectory
from rlpost.engine.weights import load_trainable
from rlpost.ops.images import save_images

__all__ = ["sample_run"]


def sample_run(
    run_dir: Path,
    host: PluginHost,
    prompts: Sequence[str],
    out: Path,
    checkpoint: str = "latest",
    num_steps: int | None = None,
    seed: int = 0,
    batch_size: int = 4,
    device: str | None = None,
) -> list[Path]:
    """Generate one sample per prompt from a run's checkpoint (sample ``i`` uses seed ``seed + i``): a PNG each, and for
    a video model an animated GIF beside it (:func:`rlpost.ops.images.save_images`).

    Raises:
        CheckpointError: The run directory or its ``recipe.yaml`` is missing or unreadable, no such checkpoint, a
            checkpoint file is corrupt, or its weights do not fit the rebuilt policy (each names the path).
        RecipeError: The run's stored ``model`` section no longer validates (e.g. its plugin is missing), the device
            is not usable here, or the model cannot read its files.
    """
    stored = RunDirectory(run_dir).stored_recipe()  # first: names a missing run directory or recipe.yaml
    weights, _, ema = read_checkpoint(find_checkpoint(checkpoint, run_dir))  # verified before the model loads
    # Sampling runs in one process on this host: ``device`` replaces the training device (a run trained on a GPU
    # samples on a CPU host with --device cpu).
    run = stored.get("run")
    spec = device or str(run.get("device", RunConfig.device) if isinstance(run, Mapping) else RunConfig.device)
    problem = device_problem(spec)
    if problem is not None:
        raise RecipeError([f"{'--device' if device else 'run.device'}: {problem}"])
    model: Policy = build_section(stored, "model", host)
    try:
        model.setup(resolve_device(spec))
    except OSError as exc:  # unreadable or corrupt base weights (the loader names the file): a bad input, not a bug
        raise RecipeError([str(exc)]) from None
    load_trainable(model.trainable_parameters(), ema if ema is not None else weights)
    if num_steps is None:
        num_steps = default_num_steps(stored)
    model.train(False)
    images = ode_sample(model, list(prompts), [seed + i for i in range(len(prompts))], num_steps, batch_size)
    paths = save_images(images, out)
    (out / "prompts.txt").write_text("".join(f"{p.name}\t{seed + i}\t{prompts[i]}\n" for i, p in enumerate(paths)))
    return paths


def default_num_steps(stored: Mapping[str, Any]) -> int:
    """The ODE steps a run's held-out evaluation used (``eval.num_steps``), else its sampler's ``num_steps``, else 20,
    read from the stored recipe's plain data (the resolved ``recipe.yaml`` lists every default)."""
    section = stored.get("eval")
    if isinstance(section, Mapping) and isinstance(section.get("num_steps"), int):
        return int(section["num_steps"])
    sampler = stored.get("sampler")
    init = sampler.get("init_args") if isinstance(sampler, Mapping) else None
    if isinstance(init, Mapping) and isinstance(init.get("num_steps"), int):
        return int(init["num_steps"])
    return 20
