"""Checkpoint resolution for the built-in reward sources: explicit path, else ``$RLPOST_MODELS/<default name>``, else
the Hugging Face cache (the file's Hub source, where ``rlpost download --recipe R`` puts it).

Rewards never download weights while training (offline, a hub lookup can hang for minutes or return a broken
tokenizer): ``rlpost download`` fetches them beforehand, each reward declaring its sources in ``hub_files()``.
A missing file raises :class:`CheckpointNotFoundError` naming the file, every place it
was looked for, and where to obtain it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from rlpost import HubFiles

__all__ = [
    "ENV_VAR",
    "CheckpointNotFoundError",
    "HubSource",
    "PathSpec",
    "hub_files_of",
    "path_problems",
    "resolve_path",
]

ENV_VAR = "RLPOST_MODELS"
"""Environment variable naming a directory that holds reward checkpoints under their default names."""


class CheckpointNotFoundError(FileNotFoundError):
    """A reward checkpoint (file or directory) could not be found locally."""


class HubSource(NamedTuple):
    """Where a checkpoint comes from on the Hub: the repository files to fetch, and the checkpoint's path inside the
    repository (``None``: the snapshot folder itself, for a model or tokenizer directory)."""

    files: HubFiles
    file: str | None = None


def resolve_path(
    explicit: str | os.PathLike[str] | None,
    default_name: str,
    *,
    reward: str,
    what: str,
    obtain: str,
    is_dir: bool = False,
    hub: HubSource | None = None,
) -> Path:
    """Find a local checkpoint file or directory.

    Args:
        explicit: Path given in the recipe (constructor argument); wins when set.
        default_name: File or directory name looked up under ``$RLPOST_MODELS`` when ``explicit`` is ``None``.
        reward: Recipe name of the reward (for the error message).
        what: What the path holds, e.g. ``"HPS-v2.1 checkpoint"``.
        obtain: Where the user can get it (repository and file name).
        is_dir: Whether a directory rather than a file is expected.
        hub: The checkpoint's Hub source, looked up in the Hugging Face cache when ``explicit`` is ``None`` and
            ``$RLPOST_MODELS`` does not hold it (a file-system lookup; nothing is downloaded).

    Returns:
        The existing path.

    Raises:
        CheckpointNotFoundError: When the file or directory does not exist; nothing is downloaded.
    """
    kind = "directory" if is_dir else "file"
    looked: list[str] = []
    if explicit is not None:
        candidate = Path(explicit).expanduser()
        looked.append(f"{candidate} (constructor argument)")
    else:
        root = os.environ.get(ENV_VAR)
        if root:
            candidate = Path(root).expanduser() / default_name
            looked.append(f"{candidate} (${ENV_VAR}/{default_name})")
        else:
            candidate = None
            looked.append(f"no constructor argument given and ${ENV_VAR} is not set")
    if candidate is not None and (candidate.is_dir() if is_dir else candidate.is_file()):
        return candidate
    fetch = ""
    if explicit is None and hub is not None:
        cached = hub.files.local_path(hub.file)
        if cached is not None and (cached.is_dir() if is_dir else cached.is_file()):
            return cached
        looked.append(f"the Hugging Face cache ({hub.files.repo_id})")
        fetch = f"Download it with `{hub.files.command()}` (`rlpost download --recipe RECIPE` fetches every file of a "
        fetch += "recipe), or obtain it from "
    raise CheckpointNotFoundError(
        f"{reward}: {what} {kind} {default_name!r} not found. Looked at: {'; '.join(looked)}. "
        f"{fetch or 'Obtain it from '}{obtain}, then pass its path to the reward's constructor or place it at "
        f"${ENV_VAR}/{default_name}. Rewards never download weights while training."
    )


class PathSpec(NamedTuple):
    """One checkpoint a reward needs, as :func:`resolve_path` takes it, plus the constructor argument naming it."""

    argument: str
    explicit: str | os.PathLike[str] | None
    default_name: str
    what: str
    obtain: str
    is_dir: bool = False
    hub: HubSource | None = None


def resolve_spec(reward: str, spec: PathSpec) -> Path:
    """:func:`resolve_path` of one :class:`PathSpec` of the reward named ``reward``."""
    return resolve_path(
        spec.explicit, spec.default_name, reward=reward, what=spec.what, obtain=spec.obtain, is_dir=spec.is_dir,
        hub=spec.hub,
    )  # fmt: skip


def resolve_specs(reward: str, specs: Sequence[PathSpec]) -> dict[str, Path]:
    """Every checkpoint of ``specs`` resolved in order (a reward's ``setup``), by constructor argument.

    Raises:
        CheckpointNotFoundError: At the first one that is not installed.
    """
    return {spec.argument: resolve_spec(reward, spec) for spec in specs}


def path_problems(reward: Any, recipe: Any, specs: Sequence[PathSpec]) -> list[str]:
    """Recipe problems for the checkpoints of ``reward`` that are not installed (validation: file checks only).

    Each names the field (``rewards[i].init_args.<argument>`` when ``reward`` is one of ``recipe.rewards``).
    """
    rewards = list(getattr(recipe, "rewards", None) or [])
    index = next((i for i, r in enumerate(rewards) if r is reward), None)
    where = f"rewards[{index}]" if index is not None else f"reward {reward.name!r}"
    problems = []
    for spec in specs:
        try:
            resolve_spec(reward.name, spec)
        except CheckpointNotFoundError as e:
            problems.append(f"{where}.init_args.{spec.argument}: {e}")
    return problems


def hub_files_of(specs: Sequence[PathSpec]) -> list[HubFiles]:
    """The Hub files of the checkpoints in ``specs`` that the recipe does not give by path (a reward's
    ``hub_files()``), each repository once."""
    found: dict[HubFiles, None] = {}
    for spec in specs:
        if spec.explicit is None and spec.hub is not None:
            found[spec.hub.files] = None
    return list(found)
