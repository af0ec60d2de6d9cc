"""What a component needs from the Hugging Face Hub (:class:`HubFiles`), declared by its ``hub_files()``
(:meth:`rlpost.core.api.Component.hub_files`; ``docs/writing_plugins.md``, "Declaring Hub files").

``rlpost download --recipe R`` fetches every declared file into the Hugging Face cache (``HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``) through ``huggingface_hub.snapshot_download``, exactly as ``hf download`` does, so that
the recipe then validates and trains with ``HF_HUB_OFFLINE=1``; components find the files there with
:meth:`HubFiles.local_path` (a cache lookup: nothing is downloaded at training time).

Part of :mod:`rlpost.core.api` (the package re-exports every name)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["GATED_HINT", "HubFiles"]

GATED_HINT = (
    "accept its licence at https://huggingface.co/{repo_id} while logged in, then log in here with `hf auth login` "
    "(or set HF_TOKEN)"
)
"""How to get access to a gated repository (formatted with ``repo_id``)."""

_GLOB = frozenset("*?[")


@dataclass(frozen=True)
class HubFiles:
    """Files of one Hub repository a component needs.

    Attributes:
        repo_id: ``owner/name``.
        patterns: File names or glob patterns (``model_index.json``, ``transformer/*``) as
            ``snapshot_download(allow_patterns=...)`` and ``hf download --include`` take them; empty: the whole
            repository.
        repo_type: ``model`` or ``dataset``.
        revision: A branch, tag or commit; ``None``: the default branch.
        gated: The repository asks users to accept a licence before downloading (:data:`GATED_HINT`).
        purpose: What the files are for, shown by ``rlpost download`` (``base model``, ``HPS-v2.1 checkpoint``).
    """

    repo_id: str
    patterns: tuple[str, ...] = ()
    repo_type: Literal["model", "dataset"] = "model"
    revision: str | None = None
    gated: bool = False
    purpose: str = ""

    def command(self, cache_dir: str | Path | None = None) -> str:
        """The ``hf download`` command that fetches these files into the cache (``--cache-dir`` when not the
        default): plain file names as arguments, glob patterns as ``--include``."""
        parts = ["hf", "download", self.repo_id]
        if self.patterns and not any(_GLOB & set(p) for p in self.patterns):
            parts += list(self.patterns)
        else:
            for pattern in self.patterns:
                parts += ["--include", pattern]
        if self.repo_type != "model":
            parts += ["--repo-type", self.repo_type]
        if self.revision is not None:
            parts += ["--revision", self.revision]
        if cache_dir is not None:
            parts += ["--cache-dir", str(cache_dir)]
        return shlex.join(parts)

    def access_hint(self) -> str:
        """How to get access when :attr:`gated` (empty otherwise)."""
        return GATED_HINT.format(repo_id=self.repo_id) if self.gated else ""

    def fetch(self, cache_dir: str | Path | None = None) -> Path:
        """Download the files into the cache (``huggingface_hub.snapshot_download``) and return the snapshot folder.

        Raises:
            huggingface_hub.errors.GatedRepoError: The repository is gated and the user has no access.
            Exception: Whatever ``snapshot_download`` raises (network, unknown repository or revision).
        """
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                self.repo_id,
                repo_type=self.repo_type,
                revision=self.revision,
                allow_patterns=list(self.patterns) or None,
                cache_dir=None if cache_dir is None else str(cache_dir),
            )
        )

    def local_path(self, file: str | None = None, cache_dir: str | Path | None = None) -> Path | None:
        """The cached copy of ``file`` (a path inside the repository), or of the snapshot folder when ``file`` is
        ``None``; ``None`` when it is not in the cache. A file-system lookup only: nothing is downloaded."""
        from huggingface_hub import snapshot_download

        try:
            folder = Path(
                snapshot_download(
                    self.repo_id,
                    repo_type=self.repo_type,
                    revision=self.revision,
                    cache_dir=None if cache_dir is None else str(cache_dir),
                    local_files_only=True,
                )
            )
        except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, or a malformed id (HFValidationError)
            return None
        path = folder if file is None else folder / file
        return path if path.exists() else None
