"""Finding and checking a diffusers pipeline directory before loading it: a local directory or a hub id from the local
cache only (nothing is downloaded at training time), each missing piece named in a :class:`ModelDirError`; the
pipeline's family (``model_index.json``'s ``_class_name``) and its components' configs are read without weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlpost.core.shipped import SHIPPED_PREFIXES

__all__ = [
    "ModelDirError",
    "PipelineFamilyError",
    "cached_snapshot",
    "check_pipeline_dir",
    "is_local_path",
    "quiet_hf_progress_bars",
    "patch_grid_problems",
    "read_config",
    "resolution_problems",
    "vae_block_factor",
]


class ModelDirError(FileNotFoundError):
    """A model directory is missing or is not a loadable diffusers pipeline; the message names what is missing."""


class PipelineFamilyError(ModelDirError):
    """A pipeline directory of another family than the adapter loads (``model_index.json``'s ``_class_name``).

    Attributes:
        found: The directory's pipeline class name.
        expected: The class the adapter loads.
    """

    def __init__(self, message: str, found: str, expected: str) -> None:
        super().__init__(message)
        self.found, self.expected = found, expected


def is_local_path(name: str) -> bool:
    """Whether ``name`` denotes a local directory rather than a hub id (``owner/name``).

    A name that exists on disk is local; so is anything path-shaped (absolute, ``./``, ``../``, ``~``, a shipped
    folder ``assets/...`` or ``recipes/...``, or not exactly one ``/``), which lets a mistyped or missing local path
    fail with "directory does not exist" instead of a hub error.
    """
    if Path(name).expanduser().exists():
        return True
    if name.split("/", 1)[0] in SHIPPED_PREFIXES:
        return True
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") != 1


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def check_pipeline_dir(
    path: Path, required: Iterable[str], weighted: Iterable[str], pipeline_class: str | None = None
) -> None:
    """Check a local diffusers pipeline directory before handing it to ``from_pretrained``.

    Args:
        path: The pipeline directory.
        required: Component names that must be present in ``model_index.json`` and on disk.
        weighted: Components (among those present) that must hold a ``config.json`` and weights.
        pipeline_class: The pipeline class that will load it; a ``model_index.json`` naming another
            ``_class_name`` is refused (``None``: any).

    Raises:
        PipelineFamilyError: ``model_index.json`` names another pipeline class than ``pipeline_class``.
        ModelDirError: Naming the first missing piece (directory, ``model_index.json``, a component entry, a
            component subfolder, its config or its weights).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelDirError(
            f"model directory {str(path)!r} does not exist (a relative path in a recipe is looked up next to the "
            "recipe file, then among rlpost's shipped assets/; docs/recipes.md, 'Paths in a recipe')"
        )
    if not path.is_dir():
        raise ModelDirError(f"model path {str(path)!r} is a file, expected a diffusers pipeline directory")
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise ModelDirError(
            f"{str(path)!r} is not a diffusers pipeline directory: missing model_index.json "
            "(save a pipeline with save_pretrained or download the full repository)"
        )
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{str(index_file)!r} is not valid JSON: {e}") from e
    if not isinstance(index, dict):
        raise ModelDirError(f"{str(index_file)!r} is malformed: expected a JSON object")
    found = index.get("_class_name")
    # Pipelines of one family load each other's directories without complaint when the component names agree (an
    # SD3 pipeline takes a FLUX.1 directory) and fail later, so the family is compared first.
    if pipeline_class is not None and isinstance(found, str) and found != pipeline_class:
        raise PipelineFamilyError(
            f"{str(path)!r} holds a {found} (model_index.json _class_name), not the {pipeline_class} this adapter "
            "loads",
            found,
            pipeline_class,
        )
    present = {k for k, v in index.items() if isinstance(v, list) and len(v) == 2 and v[0] is not None}
    for comp in required:
        if comp not in present:
            raise ModelDirError(f"{str(index_file)!r} does not declare the required component {comp!r}")
    weighted = set(weighted)
    for comp in sorted(present):
        sub = path / comp
        if not sub.is_dir():
            raise ModelDirError(
                f"model directory {str(path)!r} is missing the {comp}/ subfolder (see model_index.json)"
            )
        if comp in weighted:
            if not (sub / "config.json").is_file():
                raise ModelDirError(f"{str(sub)!r} is missing config.json")
            if not any(f.name.endswith(_WEIGHT_SUFFIXES) for f in sub.iterdir()):
                raise ModelDirError(f"{str(sub)!r} holds no weights (*.safetensors or *.bin)")
        elif comp == "scheduler" and not (sub / "scheduler_config.json").is_file():
            raise ModelDirError(f"{str(sub)!r} is missing scheduler_config.json")


def cached_snapshot(repo_id: str, command: str | None = None, access: str = "") -> Path:
    """The local-cache snapshot directory of hub model ``repo_id`` (a file-system lookup; nothing is downloaded).

    ``command`` is the ``hf download`` command the error message gives (default: the whole repository); ``access``
    says how to get access to a gated repository.

    Raises:
        ModelDirError: The model is not in the local Hugging Face cache.
    """
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError, or a malformed id (HFValidationError)
        fetch = command or f"hf download {repo_id}"
        raise ModelDirError(
            f"{repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and rlpost does not "
            f"download at training time ({type(e).__name__}); download it first with `{fetch}` (or `rlpost "
            "download --recipe RECIPE` for every file of a recipe), or give a local pipeline directory"
            + (f"; {repo_id} is gated: {access}" if access else "")
        ) from None


def read_config(path: Path, component: str, name: str = "config.json") -> dict[str, Any]:
    """The JSON object in ``path/component/name`` (a component's config), read without loading anything.

    Raises:
        ModelDirError: The file is missing, unreadable, not JSON or not a JSON object (naming the file).
    """
    file = path / component / name
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelDirError(f"cannot read {str(file)!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise ModelDirError(f"{str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{str(file)!r} is malformed: expected a JSON object")
    return data


def vae_block_factor(path: Path) -> int:
    """The spatial factor of an ``AutoencoderKL`` (SD3, FLUX.1): ``2 ** (len(block_out_channels) - 1)``, as the
    pipelines' ``vae_scale_factor``.

    Raises:
        ModelDirError: ``vae/config.json`` is unreadable or has no list ``block_out_channels``.
    """
    blocks = read_config(path, "vae").get("block_out_channels")
    if not isinstance(blocks, list) or not blocks:
        raise ModelDirError(f"{str(path / 'vae' / 'config.json')!r} has no block_out_channels list")
    return int(2 ** (len(blocks) - 1))


def resolution_problems(path: Path, resolution: int) -> list[str]:
    """Why an image of ``resolution`` pixels does not fit the pipeline in ``path``, read from its ``vae`` and
    ``transformer`` ``config.json``: it must be a multiple of VAE factor x patch size, and its latent patches must fit
    the transformer's positional embedding (``pos_embed_max_size``).

    Raises:
        ModelDirError: A config is missing, unreadable or malformed (naming the file).
    """
    vae_factor = vae_block_factor(path)
    transformer = read_config(path, "transformer")
    patch, max_patches = transformer.get("patch_size", 1), transformer.get("pos_embed_max_size")
    if not isinstance(patch, int) or isinstance(patch, bool) or patch < 1:
        raise ModelDirError(
            f"{str(path / 'transformer' / 'config.json')!r}: patch_size {patch!r} is not a positive integer"
        )
    return patch_grid_problems(resolution, vae_factor, patch, max_patches if isinstance(max_patches, int) else None)


def patch_grid_problems(resolution: int, vae_factor: int, patch: int, max_patches: int | None) -> list[str]:
    """Why ``resolution`` does not fit a latent patch grid: not a multiple of ``vae_factor x patch``, or more than
    ``max_patches`` patches per side (``None``: no limit)."""
    factor = vae_factor * patch
    if resolution % factor:
        return [f"{resolution} is not a multiple of {factor} (VAE factor {vae_factor} x patch size {patch})"]
    if max_patches is not None and resolution // factor > max_patches:
        return [
            f"{resolution} is too large for this model: at most {max_patches * factor} "
            f"(pos_embed_max_size {max_patches} patches x {factor} pixels)"
        ]
    return []


def quiet_hf_progress_bars() -> None:
    """Loading bars from diffusers/transformers would interleave with rlpost's own progress display."""
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()  # type: ignore[no-untyped-call]
