"""``rlpost sample``: images from a run's checkpoint.

:func:`sample_run` rebuilds the policy from the run's ``recipe.yaml``, loads the checkpoint's trainable weights (EMA
weights when the run kept them) and samples PNGs with the held-out ODE sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlpost.core.plugins import PluginHost
from rlpost.engine.backend import resolve_device
from rlpost.engine.checkpoint import find_checkpoint, read_checkpoint
from rlpost.engine.evaluation import ode_sample
from rlpost.engine.recipe import RecipeError, validate
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
        RecipeError: The run's stored recipe no longer validates (e.g. a plugin is missing), or the model cannot
            read its files.
    """
    stored = RunDirectory(run_dir).stored_recipe()  # first: names a missing run directory or recipe.yaml
    weights, _, ema = read_checkpoint(find_checkpoint(checkpoint, run_dir))  # verified before the model loads
    # Sampling logs nothing and runs in one process: a run trained with TensorBoard, W&B or DeepSpeed must sample on
    # a host without them, so those sections are not validated again; ``device`` replaces the training device.
    for section in ("logging", "distributed"):
        stored.pop(section, None)
    if device is not None and isinstance(stored.get("run"), dict):
        stored["run"] = {**stored["run"], "device": device}
    recipe = validate(stored, host)
    try:
        recipe.model.setup(resolve_device(device or recipe.run.device))
    except OSError as exc:  # unreadable or corrupt base weights (the loader names the file): a bad input, not a bug
        raise RecipeError([str(exc)]) from None
    load_trainable(recipe.model.trainable_parameters(), ema if ema is not None else weights)
    if num_steps is None:
        num_steps = (
            recipe.eval.settings.num_steps if recipe.eval is not None else int(getattr(recipe.sampler, "num_steps", 20))
        )
    recipe.model.train(False)
    images = ode_sample(recipe.model, list(prompts), [seed + i for i in range(len(prompts))], num_steps, batch_size)
    paths = save_images(images, out)
    (out / "prompts.txt").write_text("".join(f"{p.name}\t{seed + i}\t{prompts[i]}\n" for i, p in enumerate(paths)))
    return paths
