"""Export and inference from a run's checkpoints.

* :func:`write_diffusers_artifacts` writes the diffusers-loadable form of the trainable weights into a checkpoint:
  ``lora/pytorch_lora_weights.safetensors`` for policies with a LoRA adapter (through the policy's ``save_lora``),
  or ``transformer/`` (``save_pretrained``) for a fully fine-tuned transformer.
* :func:`export_run` (``rlpost export``) copies that artefact out of a checkpoint, without loading any model, and
  writes a model card.
* :func:`sample_run` (``rlpost sample``) rebuilds the policy from the run's ``recipe.yaml``, loads the checkpoint's
  trainable weights (EMA weights when the run kept them) and samples PNGs with the held-out ODE sampler.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlpost.core.api import Policy
from rlpost.core.plugins import PluginHost
from rlpost.engine.checkpoint import CheckpointError, find_checkpoint, read_checkpoint, verify_checkpoint
from rlpost.engine.evaluation import markdown_table, ode_sample, read_evals
from rlpost.engine.rundir import RunDirectory
from rlpost.ops.images import save_images

__all__ = [
    "export_run",
    "load_trainable",
    "sample_run",
    "trainable_weights",
    "write_diffusers_artifacts",
]

LORA_DIR = "lora"
TRANSFORMER_DIR = "transformer"


def trainable_weights(parameters: Sequence[nn.Parameter]) -> dict[str, Tensor]:
    """Trainable parameters keyed by position (``trainable.0000`` ...): works for every policy, restored bitwise."""
    return {f"trainable.{i:04d}": p.detach() for i, p in enumerate(parameters)}


@torch.no_grad()
def load_trainable(parameters: Sequence[nn.Parameter], weights: dict[str, Tensor]) -> None:
    """Copy checkpointed weights into ``parameters`` (same order as ``Policy.trainable_parameters()``).

    Raises:
        CheckpointError: The count or a shape differs (the recipe's model or LoRA settings changed).
    """
    if len(weights) != len(parameters):
        raise CheckpointError(
            f"the checkpoint holds {len(weights)} trainable tensors but the policy has {len(parameters)} trainable "
            "parameters (did the model, LoRA rank/targets or full_finetune change?)"
        )
    for i, p in enumerate(parameters):
        t = weights.get(f"trainable.{i:04d}")
        if t is None or t.shape != p.shape:
            got = None if t is None else tuple(t.shape)
            raise CheckpointError(f"trainable parameter {i}: checkpoint shape {got} != policy shape {tuple(p.shape)}")
        p.copy_(t.to(p.device, p.dtype))


def write_diffusers_artifacts(policy: Policy, directory: Path) -> list[str]:
    """Write the diffusers-loadable form of ``policy``'s trainable weights into ``directory``; returns what."""
    written: list[str] = []
    save_lora = getattr(policy, "save_lora", None)
    if callable(save_lora) and getattr(policy, "lora", None) is not None:
        save_lora(directory / LORA_DIR)
        written.append(LORA_DIR)
    elif getattr(policy, "full_finetune", False) and hasattr(getattr(policy, "transformer", None), "save_pretrained"):
        policy.transformer.save_pretrained(str(directory / TRANSFORMER_DIR), safe_serialization=True)  # type: ignore[attr-defined]
        written.append(TRANSFORMER_DIR)
    return written


def _model_card(manifest: dict[str, Any], run_dir: Path, kind: str) -> str:
    comps = manifest.get("components", {})
    base = manifest.get("base_model", "unknown")
    rewards = ", ".join(manifest.get("rewards", [])) or "unknown"
    algorithm = " + ".join(f"{k}={comps[k]}" for k in ("sampler", "advantage", "optimizer") if k in comps)
    if kind == LORA_DIR:
        usage = (
            "```python\nfrom diffusers import StableDiffusion3Pipeline\n\n"
            f'pipe = StableDiffusion3Pipeline.from_pretrained("{base}")\n'
            'pipe.load_lora_weights("<this directory>")\n```\n'
        )
    else:
        usage = (
            "```python\nfrom diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline\n\n"
            'transformer = SD3Transformer2DModel.from_pretrained("<this directory>/transformer")\n'
            f'pipe = StableDiffusion3Pipeline.from_pretrained("{base}", transformer=transformer)\n```\n'
        )
    return (
        f"---\nlibrary_name: diffusers\nbase_model: {base}\ntags: [rlpost, text-to-image, rl-post-training]\n---\n\n"
        f"# {run_dir.name}\n\n"
        f"Online RL post-training of `{base}` with rlpost ({'LoRA' if kind == LORA_DIR else 'full fine-tune'}).\n\n"
        f"- **Algorithm (components):** {algorithm or 'unknown'}\n"
        f"- **Rewards:** {rewards}\n"
        f"- **Training steps:** {manifest.get('step')}\n"
        f"- **EMA weights:** {'yes' if manifest.get('ema') else 'no'}\n\n"
        "## Held-out evaluation\n\n" + markdown_table(read_evals(run_dir)) + "\n## Usage\n\n" + usage
    )


def export_run(run_dir: Path, out: Path, checkpoint: str = "latest") -> Path:
    """Copy a checkpoint's diffusers-loadable weights to ``out`` with a model card ``README.md``.

    Raises:
        CheckpointError: No such checkpoint, a file fails its manifest sha256 (nothing is copied), or it holds no
            diffusers artefact (the policy has no LoRA or full fine-tune form; its raw trainable weights are in
            ``weights.safetensors``).
    """
    info = find_checkpoint(checkpoint, run_dir)
    verify_checkpoint(info)  # as ``sample`` and ``--resume`` do: never hand out a corrupt artefact
    kinds = [k for k in (LORA_DIR, TRANSFORMER_DIR) if (info.path / k).is_dir()]
    if not kinds:
        raise CheckpointError(
            f"{info.path}: no diffusers-loadable weights (neither {LORA_DIR}/ nor {TRANSFORMER_DIR}/); "
            "only policies with a LoRA adapter or full fine-tuning can be exported"
        )
    kind = kinds[0]
    listed = set(info.manifest["files"])
    unlisted = sorted(str(f.relative_to(info.path)) for f in (info.path / kind).rglob("*") if f.is_file())
    unlisted = [f for f in unlisted if f not in listed]
    if unlisted:
        raise CheckpointError(
            f"{info.path}: {unlisted[:5]} are not in the manifest (cannot be verified); not exporting"
        )
    out.mkdir(parents=True, exist_ok=True)
    if kind == LORA_DIR:
        for f in (info.path / LORA_DIR).iterdir():
            shutil.copy2(f, out / f.name)  # pytorch_lora_weights.safetensors at the top: load_lora_weights(out)
    else:
        shutil.copytree(info.path / TRANSFORMER_DIR, out / TRANSFORMER_DIR, dirs_exist_ok=True)
    (out / "README.md").write_text(_model_card(info.manifest, run_dir, kind))
    return out


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
    """Generate one PNG per prompt from a run's checkpoint (image ``i`` uses seed ``seed + i``).

    Raises:
        CheckpointError: No such checkpoint, or its weights do not fit the rebuilt policy.
        RecipeError: The run's stored recipe no longer validates (e.g. a plugin is missing).
    """
    from rlpost.engine.recipe import validate
    from rlpost.engine.runner import resolve_device

    info = find_checkpoint(checkpoint, run_dir)
    stored = RunDirectory(run_dir).stored_recipe()
    # Sampling logs nothing and runs in one process: a run trained with TensorBoard, W&B or DeepSpeed must sample on
    # a host without them, so those sections are not validated again; ``device`` replaces the training device.
    for section in ("logging", "distributed"):
        stored.pop(section, None)
    if device is not None and isinstance(stored.get("run"), dict):
        stored["run"] = {**stored["run"], "device": device}
    recipe = validate(stored, host)
    recipe.model.setup(resolve_device(device or recipe.run.device))
    weights, _, ema = read_checkpoint(info)
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
