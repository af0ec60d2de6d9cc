"""``rlpost export``: copy a checkpoint's diffusers-loadable weights out of a run, with a model card.

:func:`export_run` loads no model and writes a ``huggingface_hub.ModelCard`` (``README.md``: base model, license, tags,
the run's held-out results and its resolved recipe). The artefact itself (``lora/`` or ``transformer/``) is written
into every checkpoint by :func:`rlpost.engine.weights.write_diffusers_artifacts`; ``rlpost sample`` lives in
:mod:`rlpost.apps.sample`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard, ModelCardData, try_to_load_from_cache

from rlpost.core.user_files import read_text_file
from rlpost.core.yaml_limits import SAVED_LIMITS
from rlpost.engine.checkpoint import CheckpointError, find_checkpoint, sha256_file, verify_checkpoint
from rlpost.engine.evaluation import markdown_table, read_evals
from rlpost.engine.rundir import RunDirectory
from rlpost.engine.weights import LORA_DIR, TRANSFORMER_DIR

__all__ = ["export_run"]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")
_TAG = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_BACKTICKS = re.compile(r"`{3,}")


def _fenced(text: str, info: str) -> str:
    """``text`` as a fenced code block whose fence is longer than any backtick run inside it (CommonMark: a fence
    closes only on a run at least as long), so a prompt holding three backticks cannot end the block early."""
    fence = "`" * max([3, *(len(run) + 1 for run in _BACKTICKS.findall(text))])
    return f"{fence}{info}\n{text.rstrip()}\n{fence}\n"


def _recipe_section(run_dir: Path) -> str:
    """The card's ``## Recipe`` section: the resolved recipe the run wrote when it started, verbatim."""
    recipe = run_dir / RunDirectory.RECIPE
    if not recipe.is_file():
        return "## Recipe\n\nThe run directory holds no `recipe.yaml`.\n"
    return (
        "## Recipe\n\nThe resolved recipe the run started with (`recipe.yaml` in its run directory; paths are the "
        "training host's):\n\n" + _fenced(read_text_file(recipe, "run recipe", SAVED_LIMITS.max_bytes), "yaml")
    )


def _base_model(manifest: dict[str, Any], run_dir: Path) -> tuple[str | None, Path | None]:
    """(``base_model`` for the card, local directory of the base model) from the manifest or the stored recipe.

    ``base_model`` is the Hub id when the run loaded one (directly, or through a snapshot in the Hugging Face cache,
    ``.../models--org--name/snapshots/<rev>``), otherwise the local path the run loaded, made absolute; ``None``
    when the model was not loaded from pretrained weights.
    """
    base = manifest.get("base_model")
    if not base:
        try:
            model = RunDirectory(run_dir).stored_recipe().get("model") or {}
        except CheckpointError:  # no readable recipe.yaml (export_run refuses that before writing a card)
            model = {}
        base = (model.get("init_args") or {}).get("pretrained") if isinstance(model, dict) else None
    if not isinstance(base, str) or not base:
        return None, None
    local = Path(base).expanduser()
    if local.is_dir():
        cached = _CACHE_SNAPSHOT.search(local.resolve().as_posix())
        if cached:
            return f"{cached.group(1)}/{cached.group(2)}", local
        return str(local.resolve()), local
    return base, None  # a Hub id, or a path not on this host (trained elsewhere): kept as the run loaded it


def _base_license(base: str | None, local: Path | None) -> dict[str, str]:
    """The base model's ``license``/``license_name``/``license_link`` from its own model card, read offline.

    Looks in the base model's directory, then (for a Hub id) in the local Hugging Face cache; nothing is downloaded.
    A relative ``license_link`` (``LICENSE.md``) is made absolute on the Hub when the id is known.
    """
    readme: Path | None = local / "README.md" if local is not None else None
    if (readme is None or not readme.is_file()) and base is not None and _HUB_ID.match(base):
        try:
            cached = try_to_load_from_cache(base, "README.md")
        except ValueError:  # huggingface_hub refuses the id (e.g. "a/b..c"): nothing cached under it
            cached = None
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None or not readme.is_file():
        return {}
    try:
        data = ModelCard.load(readme, ignore_metadata_errors=True).data
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    found = {k: getattr(data, k, None) for k in ("license", "license_name", "license_link")}
    out = {k: v for k, v in found.items() if isinstance(v, str) and v}
    link = out.get("license_link")
    if link and "://" not in link:
        if base is not None and _HUB_ID.match(base):
            out["license_link"] = f"https://huggingface.co/{base}/blob/main/{link.lstrip('./')}"
        else:
            out.pop("license_link")
    return out if "license" in out else {}


def _model_card(manifest: dict[str, Any], run_dir: Path, kind: str, license: str | None = None) -> ModelCard:
    """The exported weights' model card, metadata as the Hugging Face Hub reads it.

    Follows diffusers' own LoRA training scripts (``huggingface/diffusers``
    ``examples/dreambooth/train_dreambooth_lora_sd3.py@58eb52c080``, ``save_model_card``): ``library_name:
    diffusers``, ``base_model``, ``text-to-image``/``diffusers``/``lora`` tags and ``license: other`` with a pointer
    to the base model's terms when the license is not known. Here the base model's own card supplies the license
    when it can be read offline, and ``license`` overrides both.
    """
    # Family-agnostic usage: DiffusionPipeline picks the pipeline class (StableDiffusion3Pipeline, FluxPipeline, ...)
    # from the base model's model_index.json, AutoModel the transformer class from its config.json.
    comps = manifest.get("components", {})
    base, local = _base_model(manifest, run_dir)
    lora = kind == LORA_DIR
    rewards = ", ".join(manifest.get("rewards", [])) or "unknown"
    components = " + ".join(f"{k}={comps[k]}" for k in ("sampler", "advantage", "optimizer") if k in comps)
    # The plugin that registered the sampler names the algorithm (treegrpo, dancegrpo, mixgrpo, ddpo, a third party).
    algorithm = (manifest.get("origins") or {}).get("sampler")
    # Older checkpoints carry no "media": they are all image models.
    task = "text-to-video" if manifest.get("media") == "video" else "text-to-image"
    tags = [task, "diffusers", *(["lora"] if lora else []), "rlpost", "rl-post-training"]
    for extra in (comps.get("model"), algorithm):
        tag = str(extra).lower() if extra else ""
        if _TAG.match(tag) and tag not in tags:
            tags.append(tag)
    terms = {"license": license} if license else _base_license(base, local)
    data = ModelCardData(
        base_model=base,
        base_model_relation=("adapter" if lora else "finetune") if base else None,
        pipeline_tag=task,
        library_name="diffusers",
        tags=tags,
        license=terms.get("license", "other"),
        license_name=terms.get("license_name"),
        license_link=terms.get("license_link"),
    )
    shown = base or "<base model>"
    if lora:
        usage = (
            "```python\nfrom diffusers import DiffusionPipeline\n\n"
            f'pipe = DiffusionPipeline.from_pretrained("{shown}")\n'
            'pipe.load_lora_weights("<this directory>")\n```\n'
        )
    else:
        usage = (
            "```python\nfrom diffusers import AutoModel, DiffusionPipeline\n\n"
            'transformer = AutoModel.from_pretrained("<this directory>/transformer")\n'
            f'pipe = DiffusionPipeline.from_pretrained("{shown}", transformer=transformer)\n```\n'
        )
    if license:
        terms_text = f"Released under `{license}` (set at export)."
    elif terms:
        terms_text = f"`{terms['license']}`, inherited from the base model's card: the base model's terms apply."
    else:
        where = f" ([{base}](https://huggingface.co/{base}))" if base and _HUB_ID.match(base) else ""
        terms_text = (
            f"These weights are derived from the base model{where}; use them under the base model's license "
            "(`license: other`; `export_run(..., license=...)` sets one)."
        )
    body = (
        f"# {run_dir.name}\n\n"
        f"Online RL post-training of `{shown}` with rlpost ({'LoRA' if lora else 'full fine-tune'}).\n\n"
        f"- **Algorithm:** {algorithm or 'unknown'} (components: {components or 'unknown'})\n"
        f"- **Rewards:** {rewards}\n"
        f"- **Training steps:** {manifest.get('step')}\n"
        f"- **EMA weights:** {'yes' if manifest.get('ema') else 'no'}\n\n"
        "## Held-out evaluation\n\n"
        + markdown_table(read_evals(run_dir))
        + "\n## Usage\n\n"
        + usage
        + "\n## License\n\n"
        + terms_text
        + "\n\n"
        + _recipe_section(run_dir)
    )
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def _check_out(out: Path, checkpoint: Path) -> None:
    """Refuse an export directory inside the checkpoint, or inside the ``checkpoints/`` folder that holds it, or one
    that is a file.

    Raises:
        CheckpointError: ``out`` lies inside the checkpoint or its ``checkpoints/`` folder.
        FileExistsError: ``out`` exists and is not a directory.
    """
    resolved = out.resolve()
    for inside, why in (
        (
            checkpoint,
            "exporting into the checkpoint would add or replace files its manifest vouches for (corrupting it)",
        ),
        (checkpoint.parent, f"{checkpoint.parent} holds only checkpoints"),
    ):
        root = inside.resolve()
        if resolved == root or root in resolved.parents:
            raise CheckpointError(f"export directory {out} lies inside {inside}: {why}; choose a directory outside it")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export directory {out} exists and is not a directory")


def _holds(path: Path, digest: str) -> bool:
    """Whether ``path`` is a regular file whose sha256 is ``digest`` (what the export would write there)."""
    return not path.is_symlink() and path.is_file() and sha256_file(path) == digest


def export_run(
    run_dir: Path, out: Path, checkpoint: str = "latest", license: str | None = None, force: bool = False
) -> Path:
    """Copy a checkpoint's diffusers-loadable weights to ``out`` with a model card ``README.md``.

    The card is a :class:`huggingface_hub.ModelCard` (``ModelCard.load(out / "README.md")`` reads it back) whose
    metadata carries ``base_model``, ``pipeline_tag`` (``text-to-image``, or ``text-to-video`` for a video model),
    ``library_name: diffusers``, tags and the
    license: ``license`` when given, else the base model's own (read offline from its card), else ``other``; its
    text ends with the run's resolved recipe as a YAML code block.

    The export never overwrites a file it did not write: a file already at one of its paths (the weights, the
    ``README.md``) that does not hold exactly what the export writes there is refused, all of them named, before
    anything is written; ``force`` overwrites them. Re-exporting the same checkpoint into the same directory is a
    no-op.

    Raises:
        CheckpointError: The run directory or its ``recipe.yaml`` is missing or unreadable, no such checkpoint, a
            file fails its manifest sha256 (nothing is copied), it holds no diffusers artefact (the policy has no
            LoRA or full fine-tune form; its raw trainable weights are in ``weights.safetensors``), ``out`` lies
            inside the checkpoint, or ``out`` cannot be written.
        FileExistsError: ``out`` holds files the export would overwrite (without ``force``), or is a file.
    """
    RunDirectory(run_dir).stored_recipe()  # the card quotes it: a missing or corrupt one is named, not skipped
    info = find_checkpoint(checkpoint, run_dir)
    verify_checkpoint(info)  # as ``sample`` and ``--resume`` do: never hand out a corrupt artefact
    kinds = [k for k in (LORA_DIR, TRANSFORMER_DIR) if (info.path / k).is_dir()]
    if not kinds:
        raise CheckpointError(
            f"{info.path}: no diffusers-loadable weights (neither {LORA_DIR}/ nor {TRANSFORMER_DIR}/); "
            "only policies with a LoRA adapter or full fine-tuning can be exported"
        )
    kind = kinds[0]
    digests: dict[str, str] = info.manifest["files"]
    unlisted = sorted(str(f.relative_to(info.path)) for f in (info.path / kind).rglob("*") if f.is_file())
    unlisted = [f for f in unlisted if f not in digests]
    if unlisted:
        raise CheckpointError(
            f"{info.path}: {unlisted[:5]} are not in the manifest (cannot be verified); not exporting"
        )
    # Exactly the files the manifest vouches for (an empty folder in lora/ holds none): a LoRA's at the top of
    # ``out`` (``load_lora_weights(out)`` finds pytorch_lora_weights.safetensors there), transformer/ as it is.
    files = sorted(f for f in digests if f.startswith(f"{kind}/"))
    if not files:
        raise CheckpointError(f"{info.path / kind}: holds no file the manifest lists; nothing to export")
    targets = {out / (Path(f).relative_to(kind) if kind == LORA_DIR else Path(f)): f for f in files}
    _check_out(out, info.path)
    card = str(_model_card(info.manifest, run_dir, kind, license)).encode("utf-8")
    readme = out / "README.md"
    ours = {readme: hashlib.sha256(card).hexdigest(), **{t: digests[f] for t, f in targets.items()}}
    conflicts = [t for t, digest in ours.items() if os.path.lexists(t) and not _holds(t, digest)]
    if conflicts and not force:
        names = ", ".join(str(t.relative_to(out)) for t in conflicts)
        raise FileExistsError(
            f"export directory {out} already holds {names}, which the export would overwrite: choose another "
            "--out, or pass --force to overwrite them"
        )
    try:
        for target, f in targets.items():
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_symlink():  # --force replaces the link itself, never the file it points to
                target.unlink()
            shutil.copy2(info.path / f, target)
        if readme.is_symlink():
            readme.unlink()
        readme.write_bytes(card)  # what ModelCard.save writes (utf-8, newlines as they are)
    except OSError as exc:
        raise CheckpointError(f"export directory {out}: cannot write the export ({exc})") from None
    return out
