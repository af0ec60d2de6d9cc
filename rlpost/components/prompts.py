"""Prompt sources (local text/JSONL/CSV files, inline lists, Hugging Face ``datasets``) and the seeded prompt stream.

The stream shuffles the prompt list with a generator seeded from ``(seed, epoch)``, so the order of every epoch is
reproducible and independent of how many steps earlier epochs took; its state is two integers (epoch, position).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, ClassVar

import torch

from rlpost.core.api import PromptSource
from rlpost.core.contract import PromptBatch
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry

__all__ = ["HFDatasetPrompts", "PromptFile", "PromptList", "PromptStream"]


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

    def __init__(self, path: str, field: str = "prompt", limit: int | None = None) -> None:
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
        if self.limit is not None and self.limit < 1:
            return [f"prompts.init_args.limit: must be >= 1 or null, got {self.limit}"]
        try:
            self.load()
        except ValueError as e:
            return [f"prompts.init_args.path: {e}"]
        return []

    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """Read the file (UTF-8).

        Raises:
            ValueError: Naming the file (and line or record) of undecodable bytes, malformed JSON, a record without
                the prompt field, or a file with no non-blank prompt.
        """
        p = Path(self.path)
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            lineno = p.read_bytes()[: e.start].count(b"\n") + 1
            raise ValueError(f"{p}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
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


class HFDatasetPrompts(PromptSource):
    """Prompts from a Hugging Face ``datasets`` dataset: a hub id (for users with internet, e.g. the HPDv2 training
    prompts) or a local builder/data files (``parquet``, ``json``, ``csv``) when offline.

    Args:
        path: Dataset id or builder name (``parquet``, ``json``, ``csv``) or a local dataset directory.
        split: Split to read.
        column: Column holding the prompt; other columns become metadata.
        data_files: Local data files for builder names.
        limit: Keep only the first ``limit`` prompts.
    """

    name: ClassVar[str] = "hf-dataset"

    def __init__(
        self,
        path: str,
        split: str = "train",
        column: str = "prompt",
        data_files: str | list[str] | None = None,
        limit: int | None = None,
    ) -> None:
        self.path = path
        self.split = split
        self.column = column
        self.data_files = data_files
        self.limit = limit

    def _saved_dir(self) -> Path | None:
        """The directory when ``path`` is a dataset written with ``save_to_disk`` (a Dataset or DatasetDict)."""
        p = Path(self.path).expanduser()
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            return p
        return None

    def _local_files(self) -> list[Path] | None:
        """The local data files of a packaged builder (``parquet``, ``json``, ``csv``), or ``None`` for other paths."""
        if self.path not in _BUILDERS or self.data_files is None:
            return None
        patterns = [self.data_files] if isinstance(self.data_files, str) else list(self.data_files)
        files: list[Path] = []
        for pattern in patterns:
            matched = sorted(Path().glob(pattern)) if any(c in pattern for c in "*?[") else [Path(pattern)]
            files.extend(matched if matched else [Path(pattern)])
        return files

    def validate(self, recipe: Any) -> list[str]:
        """Check local datasets without loading their rows: a ``save_to_disk`` directory (memory-mapped) has the
        split and column; local builder files exist and their header/schema has the column. Hub datasets are only
        checked when loaded (validation never downloads)."""
        where = "prompts.init_args"
        if self.limit is not None and self.limit < 1:
            return [f"{where}.limit: must be >= 1 or null, got {self.limit}"]
        if self._saved_dir() is not None:
            try:
                saved_columns, rows = self._open_saved()
            except ValueError as e:
                return [f"{where}.split: {e}"]
            if self.column not in saved_columns:
                return [
                    f"{where}.column: dataset {self.path!r} has no column {self.column!r} (columns: {saved_columns})"
                ]
            return [] if rows else [f"{where}.path: dataset {self.path!r} split {self.split!r} is empty"]
        files = self._local_files()
        if files is None:
            explicit_local = self.path.startswith(("/", "./", "../", "~"))  # bare names may be hub datasets
            if explicit_local and not Path(self.path).expanduser().exists():
                return [f"{where}.path: dataset directory not found: {self.path}"]
            return []
        for f in files:
            if not f.is_file():
                return [f"{where}.data_files: file not found: {f}"]
            try:
                columns = _file_columns(f, self.path)
            except (OSError, ValueError) as e:
                return [f"{where}.data_files: {f}: cannot read its columns ({e})"]
            if columns is not None and self.column not in columns:
                return [f"{where}.column: {f} has no column {self.column!r} (columns: {columns})"]
        return []

    def _open_saved(self) -> tuple[list[str], int]:
        import datasets  # heavy import, only when used

        ds = datasets.load_from_disk(str(self._saved_dir()))
        if isinstance(ds, datasets.DatasetDict):
            if self.split not in ds:
                raise ValueError(f"dataset {self.path!r} has no split {self.split!r} (splits: {list(ds)})")
            ds = ds[self.split]
        return list(ds.column_names), len(ds)

    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """Load the split and return ``(prompt, metadata)`` pairs.

        Raises:
            ValueError: If the split or column is missing.
        """
        import datasets  # heavy import, only when used

        saved = self._saved_dir()
        if saved is not None:  # datasets.load_dataset refuses save_to_disk output
            loaded = datasets.load_from_disk(str(saved))
            if isinstance(loaded, datasets.DatasetDict):
                if self.split not in loaded:
                    raise ValueError(f"dataset {self.path!r} has no split {self.split!r} (splits: {list(loaded)})")
                loaded = loaded[self.split]
            ds = loaded
        else:
            ds = datasets.load_dataset(self.path, data_files=self.data_files, split=self.split)
        if self.column not in ds.column_names:
            raise ValueError(f"dataset {self.path!r} has no column {self.column!r} (columns: {ds.column_names})")
        n = len(ds) if self.limit is None else min(self.limit, len(ds))
        rows = []
        for record in ds.select(range(n)):
            meta = {k: v for k, v in record.items() if k != self.column}
            rows.append((str(record[self.column]), meta))
        return rows


_BUILDERS = ("parquet", "json", "csv")


def _file_columns(path: Path, builder: str) -> list[str] | None:
    """Column names of one local data file from its header, schema or first record (``None``: not determinable)."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with path.open(encoding="utf-8") as fh:
        if builder == "csv":
            header = next(csv.reader(fh), None)
            return list(header) if header is not None else []
        first = fh.readline()
    if not first.strip() or first.lstrip().startswith("["):
        return None  # a JSON array file: its records are not cheaply reachable
    record = json.loads(first)
    return list(record) if isinstance(record, dict) else None


class PromptStream:
    """Deterministic, epoch-aware stream of prompt groups.

    Args:
        items: ``(prompt, metadata)`` pairs.
        seed: Root seed; epoch ``e`` is shuffled with a generator seeded ``seed * 1_000_003 + e``.
        shuffle: Shuffle each epoch (otherwise file order).
    """

    def __init__(self, items: list[tuple[str, dict[str, Any]]], seed: int, shuffle: bool = True) -> None:
        if not items:
            raise ValueError("PromptStream: no prompts")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.items), generator=gen).tolist()

    def next_batch(self, num_groups: int, samples_per_group: int) -> PromptBatch:
        """The next ``num_groups`` prompts (crossing epoch boundaries as needed)."""
        prompts, metadata = [], []
        for _ in range(num_groups):
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            prompt, meta = self.items[self._order[self.position]]
            self.position += 1
            prompts.append(prompt)
            metadata.append(dict(meta))
        return PromptBatch(prompts=prompts, metadata=metadata, samples_per_group=samples_per_group)

    def state_dict(self) -> dict[str, int]:
        """Epoch and position (the permutation is recomputed from the seed)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


@hookimpl
def rlpost_register_prompt_sources(register: Registry[PromptSource]) -> None:
    """Register the built-in prompt sources."""
    register(PromptList)
    register(PromptFile)
    register(HFDatasetPrompts)
