"""``rlpost export``: copy a checkpoint's diffusers-loadable weights out of a run, with a model card.

:func:`export_run` loads no model. The artefact itself (``lora/`` or ``transformer/``) is written into every
checkpoint by :func:`rlpost.engine.weights.write_diffusers_artifacts`; ``rlpost sample`` lives in
:mod:`rlpost.apps.sample`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rlpost.engine.checkpoint import CheckpointError, find_checkpoint, verify_checkpoint
from rlpost.engine.evaluation import markdown_table, read_evals
from rlpost.engine.weights import LORA_DIR, TRANSFORMER_DIR

__all__ = ["export_run"]


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
