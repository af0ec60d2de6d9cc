"""``rlpost export``: copy a checkpoint's diffusers-loadable weights out of a run, with a model card.

:func:`export_run` loads no model and writes a ``huggingface_hub.ModelCard`` (``README.md``: base model, license, tags,
the run's held-out results and its resolved recipe). The artefact itself (``lora/`` or ``transformer/``) is written
into every checkpoint by :func:`rlpost.engine.weights.write_diffusers_artifacts`; ``rlpost sample`` lives in
:mod:`rlpost.apps.sample`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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

__all__ = ["export_run", "hub_repo_id", "push_to_hub"]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")
_TAG = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_BACKTICKS = re.compile(r"`{3,}")


def _is_hub_id(text: str) -> bool:
    """Whether ``text`` is an ``org/name`` repository id huggingface_hub accepts (``validate_repo_id``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]  # documented, not re-exported

    if not _HUB_ID.match(text):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def hub_repo_id(text: str) -> str:
    """``text`` when it is a Hugging Face Hub repository id (``org/name``), for ``argparse``'s ``type=``.

    Raises:
        argparse.ArgumentTypeError: It is not one.
    """
    if not _is_hub_id(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Hugging Face Hub id (org/name)")
    return text


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
    """(the base model as the run loaded it, its local directory) from the manifest or the stored recipe.

    A directory in the Hugging Face cache (``.../models--org--name/snapshots/<rev>``) becomes its Hub id, any other
    existing directory its absolute path; ``None`` when the model was not loaded from pretrained weights.
    """
    base = manifest.get("base_model")
    if not base:
        model = _stored(run_dir).get("model") or {}
        base = (model.get("init_args") or {}).get("pretrained") if isinstance(model, dict) else None
    if not isinstance(base, str) or not base:
        return None, None
    local = Path(base).expanduser()
    if local.is_dir():
        cached = _CACHE_SNAPSHOT.search(local.resolve().as_posix())
        if cached:
            return f"{cached.group(1)}/{cached.group(2)}", local
        named = _name_or_path(local)
        return (named or str(local.resolve())), local
    return base, None  # a Hub id, or a path not on this host (trained elsewhere): kept as the run loaded it


def _name_or_path(local: Path) -> str | None:
    """The Hub id a local pipeline directory was saved from (``_name_or_path`` in its ``model_index.json``, which
    diffusers records when a pipeline loaded from the Hub is saved), when it holds one."""
    try:
        data = json.loads(read_text_file(local / "model_index.json", "model_index.json", 1 << 20))
    except (OSError, ValueError):  # absent, unreadable or not JSON (UserFileError is a ValueError)
        return None
    name = data.get("_name_or_path") if isinstance(data, dict) else None
    return name if isinstance(name, str) and _is_hub_id(name) else None


def _stored(run_dir: Path) -> dict[str, Any]:
    """The run's stored recipe, or ``{}`` when unreadable (export_run refuses that before writing a card)."""
    try:
        return RunDirectory(run_dir).stored_recipe()
    except CheckpointError:
        return {}


def _sampling_settings(run_dir: Path) -> dict[str, Any]:
    """The pipeline-call arguments that sample as the run evaluated: ``num_inference_steps`` (``eval.num_steps``,
    else the sampler's ``num_steps``, as ``rlpost sample`` picks them), ``guidance_scale``, ``height``/``width``
    (``resolution`` for an image model), ``num_frames`` and ``max_sequence_length`` when the model sets them."""
    recipe = _stored(run_dir)

    def mapping(value: Any) -> dict[str, Any]:
        return value if isinstance(value, dict) else {}

    args = mapping(mapping(recipe.get("model")).get("init_args"))
    sampler_args = mapping(mapping(recipe.get("sampler")).get("init_args"))
    steps = mapping(recipe.get("eval")).get("num_steps") or sampler_args.get("num_steps")
    out: dict[str, Any] = {"num_inference_steps": steps} if isinstance(steps, int) else {}
    if isinstance(args.get("guidance_scale"), (int, float)):
        out["guidance_scale"] = float(args["guidance_scale"])
    if isinstance(args.get("resolution"), int):
        out["height"] = out["width"] = args["resolution"]
    for key in ("height", "width", "num_frames", "max_sequence_length"):
        if isinstance(args.get(key), int):
            out[key] = args[key]
    return out


def _base_license(base: str | None, local: Path | None) -> dict[str, str]:
    """The base model's ``license``/``license_name``/``license_link`` from its own model card, read offline.

    Looks in the base model's directory, then (for a Hub id) in the local Hugging Face cache; nothing is downloaded.
    A relative ``license_link`` (``LICENSE.md``) is made absolute on the Hub when the id is known.
    """
    readme: Path | None = local / "README.md" if local is not None else None
    if (readme is None or not readme.is_file()) and base is not None and _is_hub_id(base):
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
        if base is not None and _is_hub_id(base):
            out["license_link"] = f"https://huggingface.co/{base}/blob/main/{link.lstrip('./')}"
        else:
            out.pop("license_link")
    return out if "license" in out else {}


def _model_card(
    manifest: dict[str, Any], run_dir: Path, kind: str, license: str | None = None, base_model: str | None = None
) -> ModelCard:
    """The exported weights' model card, metadata as the Hugging Face Hub reads it.

    Follows diffusers' own LoRA training scripts (``huggingface/diffusers``
    ``examples/dreambooth/train_dreambooth_lora_sd3.py@58eb52c080``, ``save_model_card``): ``library_name:
    diffusers``, ``base_model``, ``text-to-image``/``diffusers``/``lora`` tags and ``license: other`` with a pointer
    to the base model's terms when the license is not known. Here the base model's own card supplies the license
    when it can be read offline, and ``license`` overrides both. ``base_model`` names the Hub id of a base model
    the run loaded from a local directory; the metadata's ``base_model`` is only ever a Hub id (the Hub links it),
    a local path shows in the text only.
    """
    # Family-agnostic usage: DiffusionPipeline picks the pipeline class (StableDiffusion3Pipeline, FluxPipeline, ...)
    # from the base model's model_index.json, AutoModel the transformer class from its config.json.
    comps = manifest.get("components", {})
    base, local = _base_model(manifest, run_dir)
    base = base_model or base
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
    hub_id = base if base is not None and _is_hub_id(base) else None  # the Hub reads base_model as a repo id
    data = ModelCardData(
        base_model=hub_id,
        base_model_relation=("adapter" if lora else "finetune") if hub_id else None,
        pipeline_tag=task,
        library_name="diffusers",
        tags=tags,
        license=terms.get("license", "other"),
        license_name=terms.get("license_name"),
        license_link=terms.get("license_link"),
    )
    shown = base or "<base model>"
    settings = _sampling_settings(run_dir)
    call = ", ".join(["prompt", *(f"{k}={v!r}" for k, v in settings.items())])
    output = "frames = pipe(" + call + ").frames[0]" if task == "text-to-video" else f"image = pipe({call}).images[0]"
    if lora:
        usage = (
            "```python\nfrom diffusers import DiffusionPipeline\n\n"
            f'pipe = DiffusionPipeline.from_pretrained("{shown}")\n'
            'pipe.load_lora_weights("<this directory>")\n'
        )
    else:
        usage = (
            "```python\nfrom diffusers import AutoModel, DiffusionPipeline\n\n"
            'transformer = AutoModel.from_pretrained("<this directory>/transformer")\n'
            f'pipe = DiffusionPipeline.from_pretrained("{shown}", transformer=transformer)\n'
        )
    usage += (
        f'prompt = "..."\n{output}\n```\n\nThe call uses the sampling settings of the run\'s held-out evaluation.\n'
    )
    if license:
        terms_text = f"Released under `{license}` (set at export)."
    elif terms:
        terms_text = f"`{terms['license']}`, inherited from the base model's card: the base model's terms apply."
    else:
        where = f" ([{base}](https://huggingface.co/{base}))" if base and _is_hub_id(base) else ""
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


def _new_file_mode() -> int:
    """The permissions a new file gets here: ``0666`` less the process umask (read without changing it for good)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def push_to_hub(out: Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Upload an export directory to the Hugging Face Hub model repository ``repo_id`` (created when missing) with
    ``huggingface_hub.HfApi``: ``create_repo(exist_ok=True)`` then ``upload_folder``, one commit.

    Args:
        out: The export directory (:func:`export_run`'s ``out``).
        repo_id: ``org/name``.
        private: Create the repository private (an existing one keeps its visibility).
        token: A Hub token; default: huggingface_hub's (``HF_TOKEN``, ``hf auth login``).

    Returns:
        The URL of the upload's commit.

    Raises:
        ValueError: ``repo_id`` is not a Hub id.
    """
    from huggingface_hub import HfApi

    if not _is_hub_id(repo_id):
        raise ValueError(f"--push_to_hub: {repo_id!r} is not a Hugging Face Hub id (org/name)")
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id, repo_type="model", folder_path=str(out), commit_message=f"Upload {out.name} (rlpost export)"
    )
    return str(commit)


def export_run(
    run_dir: Path,
    out: Path,
    checkpoint: str = "latest",
    license: str | None = None,
    force: bool = False,
    base_model: str | None = None,
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
    no-op. The files are written with the permissions of any new file (``0666`` less the umask: ``0644`` under the
    usual ``022``), not the checkpoint's owner-only ones: an export is for sharing. ``base_model`` sets the Hub id
    the card names when the run loaded its base model from a local directory.

    Raises:
        CheckpointError: The run directory or its ``recipe.yaml`` is missing or unreadable, no such checkpoint, a
            file fails its manifest sha256 (nothing is copied), it holds no diffusers artefact (the policy has no
            LoRA or full fine-tune form; its raw trainable weights are in ``weights.safetensors``), ``out`` lies
            inside the checkpoint, or ``out`` cannot be written.
        FileExistsError: ``out`` holds files the export would overwrite (without ``force``), or is a file.
        ValueError: ``base_model`` is not a Hub id (``org/name``).
    """
    if base_model is not None and not _is_hub_id(base_model):
        raise ValueError(f"base_model: {base_model!r} is not a Hugging Face Hub id (org/name)")
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
    card = str(_model_card(info.manifest, run_dir, kind, license, base_model)).encode("utf-8")
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
            # Contents only: checkpoint files are owner-only (written through private temporary files).
            shutil.copyfile(info.path / f, target)
            os.chmod(target, _new_file_mode())
        if readme.is_symlink():
            readme.unlink()
        readme.write_bytes(card)  # what ModelCard.save writes (utf-8, newlines as they are)
        os.chmod(readme, _new_file_mode())
    except OSError as exc:
        raise CheckpointError(f"export directory {out}: cannot write the export ({exc})") from None
    return out
