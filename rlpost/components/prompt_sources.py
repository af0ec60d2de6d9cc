"""Prompt sources from this machine: an inline list (:class:`PromptList`) and a local text, JSONL, JSON or CSV file
(:class:`PromptFile`). Hugging Face datasets are :mod:`rlpost.components.hub_prompts`; the seeded stream that serves
the prompts to the runner is :mod:`rlpost.components.prompts`.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Annotated, Any, ClassVar

from rlpost.core.api import PromptSource, Range
from rlpost.core.user_files import read_text_file

__all__ = ["MAX_PROMPT_FILE_BYTES", "PromptFile", "PromptList"]

MAX_PROMPT_FILE_BYTES = 256 * 1024 * 1024
"""The largest prompt file read (HPD v2's training prompts, a 116 MB JSON list, fit)."""


class PromptList(PromptSource):
    """Prompts given inline in the recipe.

    Args:
        prompts: The prompts.
        metadata: Optional metadata dict per prompt (same length as ``prompts``).
    """

    name: ClassVar[str] = "prompt-list"

    def __init__(self, prompts: list[str], metadata: list[dict[str, Any]] | None = None) -> None:
        self.prompts = list(prompts)
        self.metadata = metadata

    def validate(self, recipe: Any) -> list[str]:
        """Check the list is non-empty and metadata aligns."""
        problems = []
        if not self.prompts:
            problems.append("prompts.init_args.prompts: the prompt list is empty")
        if self.metadata is not None and len(self.metadata) != len(self.prompts):
            problems.append(f"prompts.init_args.metadata: {len(self.metadata)} entries for {len(self.prompts)} prompts")
        return problems

    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """Return the inline prompts with their metadata."""
        meta = self.metadata or [{} for _ in self.prompts]
        return [(p, dict(m)) for p, m in zip(self.prompts, meta, strict=True)]


class PromptFile(PromptSource):
    """Prompts from a local file: ``.txt`` (one per line), ``.jsonl`` (objects with a prompt field; the other fields
    become metadata), ``.json`` (a list of strings or objects) or ``.csv`` (a header row with a prompt column).

    Args:
        path: The file.
        field: Name of the prompt field/column for JSONL, JSON objects and CSV.
        limit: Keep only the first ``limit`` prompts (after reading, before shuffling).
    """

    name: ClassVar[str] = "prompt-file"

    def __init__(self, path: str, field: str = "prompt", limit: Annotated[int, Range(ge=1)] | None = None) -> None:
        self.path = path
        self.field = field
        self.limit = limit

    def validate(self, recipe: Any) -> list[str]:
        """Check the file exists, has a supported suffix and reads as prompts (UTF-8, well-formed, not empty).

        Prompt files are small text; reading one here costs little and turns a malformed line into a recipe problem
        instead of a crash after the model has loaded.
        """
        p = Path(self.path)
        if not p.is_file():
            return [f"prompts.init_args.path: prompt file not found: {self.path}"]
        if p.suffix not in (".txt", ".jsonl", ".json", ".csv"):
            return [f"prompts.init_args.path: unsupported prompt file type {p.suffix!r} (txt, jsonl, json, csv)"]
        try:
            self.load()
        except ValueError as e:
            return [f"prompts.init_args.path: {e}"]
        return []

    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """Read the file (UTF-8).

        Raises:
            ValueError: Naming the file (and line or record) of undecodable bytes, malformed or too deeply nested
                JSON, a record without the prompt field, a file with no non-blank prompt, or a file that is missing,
                not a regular file or over :data:`MAX_PROMPT_FILE_BYTES`.
        """
        p = Path(self.path)
        text = read_text_file(p, "prompt file", MAX_PROMPT_FILE_BYTES)  # a UserFileError is a ValueError
        rows: list[tuple[str, dict[str, Any]]] = []
        if p.suffix == ".txt":
            rows = [(line.strip(), {}) for line in text.splitlines() if line.strip()]
        elif p.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    rows.append(self._record(_json(line, f"{p}:{n}"), f"{p}:{n}"))
        elif p.suffix == ".json":
            data = _json(text, str(p))
            if not isinstance(data, list):
                raise ValueError(f"{p}: expected a JSON list of prompts")
            rows = [self._record(item, f"{p}[{i}]") for i, item in enumerate(data)]
        else:
            reader = csv.DictReader(io.StringIO(text, newline=""))
            if reader.fieldnames is not None and self.field not in reader.fieldnames:
                raise ValueError(f"{p}: no column {self.field!r} in the header (columns: {reader.fieldnames})")
            rows = [self._record(dict(r), f"{p}:{i + 2}") for i, r in enumerate(reader)]
        if self.limit is not None:
            rows = rows[: self.limit]
        if not rows:
            raise ValueError(f"{p}: no prompts found (the file is empty or blank)")
        return rows

    def _record(self, item: Any, where: str) -> tuple[str, dict[str, Any]]:
        if isinstance(item, str):
            if not item.strip():
                raise ValueError(f"{where}: blank prompt")
            return item, {}
        if not isinstance(item, dict) or not isinstance(item.get(self.field), str):
            raise ValueError(f"{where}: expected an object with a string field {self.field!r}")
        if not item[self.field].strip():
            raise ValueError(f"{where}: blank prompt in field {self.field!r}")
        meta = {k: v for k, v in item.items() if k != self.field}
        return item[self.field], meta


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:  # Python's decoder recurses per level: ``[[[[...`` would end in a traceback
        raise ValueError(f"{where}: malformed JSON (nested too deeply)") from None
