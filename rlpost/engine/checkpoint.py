"""Atomic, pickle-free checkpoints.

Layout of one checkpoint (``<run>/checkpoints/step_000004/``)::

    weights.safetensors          trainable parameters by position (``trainable.0000`` ...), restored bitwise
    ema.safetensors              EMA shadow of the trainable parameters (when ``ema`` is configured)
    state.json + state.safetensors
                                 everything else (step, prompt stream, RNG streams, torch optimizer and LR
                                 scheduler, component and plugin state): a JSON tree in which every tensor is
                                 replaced by ``{"__tensor__": key}`` pointing into ``state.safetensors``
    lora/pytorch_lora_weights.safetensors
                                 diffusers-loadable LoRA (policies with ``save_lora``), EMA weights when enabled
    transformer/                 diffusers ``save_pretrained`` of a fully fine-tuned transformer
    manifest.json                written LAST: step, file list with sha256, reason, recipe hash

A checkpoint is written into a hidden temporary directory and renamed into place only after its manifest is on disk,
so a save killed midway never replaces the last good checkpoint, and :func:`list_checkpoints` ignores any directory
without a manifest (torchtune's ``get_largest_iter_folder`` picks by name alone: ``pytorch/torchtune``
``torchtune/training/checkpointing/_utils.py``@67287e2).

No pickle anywhere: metadata is JSON, tensors are safetensors; :func:`load_tensor_file` reads legacy ``.pt``/``.bin``
files with ``torch.load(weights_only=True)`` only: plain ``torch.load``
unpickles arbitrary objects, which can run code (``docs/checkpoints.md``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from rlpost.core.tensor_tree import join_tensors, split_tensors
from rlpost.core.user_files import UserFileError, load_json

__all__ = [
    "CHECKPOINT_DIR",
    "MANIFEST",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointInfo",
    "RunFinishedError",
    "find_checkpoint",
    "list_checkpoints",
    "load_tensor_file",
    "read_checkpoint",
    "sha256_file",
    "rotate",
    "split_tensors",
    "join_tensors",
    "verify_checkpoint",
    "write_checkpoint",
]

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


@dataclass
class CheckpointConfig:
    """Recipe section ``checkpoint``.

    Attributes:
        every: Save every N completed steps (0 = only at the end).
        keep_last: Keep the newest N complete checkpoints (0 = keep all).
        at_end: Save when the run completes.
    """

    every: int = 0
    keep_last: int = 2
    at_end: bool = True

    def problems(self) -> list[str]:
        """Range problems, each naming its field relative to the section (the recipe prefixes ``checkpoint.``)."""
        return [f"{n}: must be >= 0, got {getattr(self, n)}" for n in ("every", "keep_last") if getattr(self, n) < 0]


class CheckpointError(Exception):
    """A checkpoint or a run directory's file cannot be written, found, read or honoured; the message names the file
    and says why."""


class RunFinishedError(CheckpointError):
    """A resume from a checkpoint that already reached ``run.max_steps``: there is nothing left to train. Raised before
    any weights load; the message says how to extend the run (``rlpost train`` exits with status 5 for it).

    Args:
        path: The checkpoint directory.
        step: The checkpoint's completed steps.
        max_steps: The recipe's ``run.max_steps``.
    """

    def __init__(self, path: Path, step: int, max_steps: int) -> None:
        self.path, self.step, self.max_steps = path, step, max_steps
        super().__init__(
            f"nothing left to do: {path} is at step {step} and run.max_steps is {max_steps}; to train this run "
            f"further, resume it with more steps: --resume latest --run.max_steps N (N > {step})"
        )


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk.

    Attributes:
        path: The checkpoint directory.
        step: Completed training steps when it was written.
        manifest: The parsed ``manifest.json``.
    """

    path: Path
    step: int
    manifest: dict[str, Any]


# ------------------------------------------------------------------------------------------ state <-> JSON


def _save_tensors(tensors: Mapping[str, Tensor], path: Path) -> None:
    # safetensors refuses tensors sharing storage and non-contiguous ones; copy only where needed.
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        if ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[key] = t
    save_file(out, str(path))


def load_tensor_file(path: str | Path) -> dict[str, Tensor]:
    """Load tensors from ``.safetensors``, or from ``.pt``/``.pth``/``.bin`` with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: The file is missing, not a valid tensor file, or would need unrestricted unpickling
            (a pickle carrying code is rejected, never executed).
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"tensor file not found: {p}")
    try:
        if p.suffix == ".safetensors":
            return load_file(str(p))
        if p.suffix in (".pt", ".pth", ".bin"):
            obj = torch.load(p, map_location="cpu", weights_only=True)
            if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
                raise CheckpointError(f"{p}: expected a flat mapping of name -> tensor")
            return {str(k): v for k, v in obj.items()}
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors/torch raise many types for corrupt or unsafe files
        raise CheckpointError(f"{p}: not a safe tensor file ({type(exc).__name__}: {str(exc)[:300]})") from None
    raise CheckpointError(f"{p}: unsupported tensor file type {p.suffix!r} (use .safetensors)")


def sha256_file(path: Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB chunks (checkpoint files can be gigabytes)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------- writing


def write_checkpoint(
    run_dir: Path,
    step: int,
    weights: Mapping[str, Tensor],
    state: Mapping[str, Any],
    extra: Callable[[Path], None] | None = None,
    ema: Mapping[str, Tensor] | None = None,
    manifest_extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint atomically and return its directory.

    Args:
        run_dir: The run directory (checkpoints go to ``run_dir/checkpoints/step_NNNNNN``).
        step: Completed training steps.
        weights: Trainable weights (already checked finite by the caller).
        state: Everything else; tensors anywhere in the tree go to ``state.safetensors``.
        extra: Writes additional artefacts (diffusers LoRA, ``transformer/``) into the temporary directory.
        ema: Optional EMA shadow weights.
        manifest_extra: Extra manifest fields (e.g. ``reason``, ``recipe_sha256``).

    Raises:
        CheckpointError: Non-finite weights (never written) or state that cannot be serialised without pickle.
    """
    for name, group in (("weights", weights), ("ema", ema or {})):
        bad = [k for k, t in group.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            raise CheckpointError(f"refusing to write a checkpoint with non-finite {name}: {bad[:5]}")
    root = run_dir / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        tensors: dict[str, Tensor] = {}
        try:
            tree = split_tensors(dict(state), tensors)
        except TypeError as exc:
            raise CheckpointError(str(exc)) from None
        _save_tensors(weights, tmp / "weights.safetensors")
        if ema is not None:
            _save_tensors(ema, tmp / "ema.safetensors")
        _save_tensors(tensors, tmp / "state.safetensors")
        (tmp / "state.json").write_text(json.dumps(tree))
        if extra is not None:
            extra(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "files": {f: sha256_file(tmp / f) for f in files},
            **(manifest_extra or {}),
        }
        # The manifest is written last and fsynced: its presence is what makes the checkpoint complete.
        with (tmp / MANIFEST).open("w") as fh:
            fh.write(json.dumps(manifest, indent=2))
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            # Re-saving the same step (e.g. a guard stop right after a periodic save): move the old one aside first
            # so there is never a moment without a complete checkpoint for this step.
            old = root / f".step_{step:06d}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints of a run (a readable ``manifest.json``), oldest first."""
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found: list[CheckpointInfo] = []
    for d in root.iterdir():
        if not d.is_dir() or d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        try:
            manifest = load_json((d / MANIFEST).read_text(encoding="utf-8"), str(d / MANIFEST))
            found.append(CheckpointInfo(d, int(manifest["step"]), manifest))
        except (ValueError, KeyError, TypeError):
            continue  # a corrupt manifest is an incomplete checkpoint
    return sorted(found, key=lambda c: c.step)


def rotate(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints (and stale temporary dirs); returns deleted.

    ``keep_last <= 0`` keeps everything. The newest complete checkpoint is never deleted.
    """
    removed: list[Path] = []
    root = run_dir / CHECKPOINT_DIR
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".step_") and f"-{os.getpid()}" not in d.name:
                shutil.rmtree(d, ignore_errors=True)  # left by a killed save of an earlier process
    if keep_last <= 0:
        return removed
    for info in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    return removed


def find_checkpoint(spec: str, run_dir: Path) -> CheckpointInfo:
    """Resolve ``latest`` (in ``run_dir``), a run directory (its latest) or a checkpoint directory.

    Raises:
        CheckpointError: The path does not exist, or holds no complete checkpoint.
    """
    if spec == "latest":
        found = list_checkpoints(run_dir)
        if not found:
            # Callers say what this means for them (the runner restarts such a run from step 0).
            raise CheckpointError(
                f"no complete checkpoint in {run_dir / CHECKPOINT_DIR}: the run has not saved one "
                "(checkpoint.every, checkpoint.at_end)"
            )
        return found[-1]
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint path not found: {path}")
    if (path / MANIFEST).is_file():
        try:
            manifest = load_json((path / MANIFEST).read_text(encoding="utf-8"), str(path / MANIFEST))
            return CheckpointInfo(path, int(manifest["step"]), manifest)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path / MANIFEST}: unreadable manifest ({exc})") from None
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST}) and no checkpoints under it")


def verify_checkpoint(info: CheckpointInfo) -> None:
    """Check every file the manifest lists exists and matches its sha256.

    A manifest without a file list cannot vouch for anything, so it is corrupt rather than "unchecked".

    Raises:
        CheckpointError: The file list is missing or malformed, a listed file is missing, or a hash differs.
    """
    files = info.manifest.get("files")
    if (
        not isinstance(files, dict)
        or not files
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise CheckpointError(
            f"{info.path / MANIFEST}: corrupt manifest: no file list with sha256 digests (cannot verify the checkpoint)"
        )
    root = info.path.resolve()
    for name, digest in files.items():
        f = (info.path / name).resolve()
        if root not in f.parents:
            raise CheckpointError(
                f"{info.path / MANIFEST}: corrupt manifest: file {name!r} lies outside the checkpoint"
            )
        if not f.is_file():
            raise CheckpointError(f"{info.path}: file {name} listed in the manifest is missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{info.path}: {name} does not match its sha256 in the manifest (corrupt)")


def read_checkpoint(info: CheckpointInfo) -> tuple[dict[str, Tensor], dict[str, Any], dict[str, Tensor] | None]:
    """Load ``(weights, state, ema)`` of a checkpoint (safetensors + JSON only), verifying file hashes first.

    Raises:
        CheckpointError: The manifest has no file list, a listed file is missing or its sha256 does not match, or
            ``state.json`` is not a JSON object whose tensor references resolve (a file re-hashed after an edit
            passes the sha256 check): each names the file.
    """
    verify_checkpoint(info)
    weights = load_tensor_file(info.path / "weights.safetensors")
    tensors = load_tensor_file(info.path / "state.safetensors")
    state_file = info.path / "state.json"
    try:
        tree = load_json(state_file.read_text(encoding="utf-8"), str(state_file))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{state_file}: not valid JSON ({exc})") from None
    except UserFileError as exc:  # names the file: not JSON, a repeated key, nested too deeply
        raise CheckpointError(str(exc)) from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{state_file}: expected a JSON object, got {type(tree).__name__}")
    try:
        state = join_tensors(tree, tensors)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{state_file}: malformed state tree ({type(exc).__name__}: {exc})") from None
    ema_file = info.path / "ema.safetensors"
    ema = load_tensor_file(ema_file) if ema_file.is_file() else None
    return weights, state, ema
