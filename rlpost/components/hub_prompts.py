"""Prompts from a Hugging Face dataset (:class:`HFDatasetPrompts`, recipe name ``hf-dataset``): a hub dataset id, a
local prompt file, a ``save_to_disk`` directory or a packaged ``datasets`` builder over local files.

Validation never downloads (hub files are looked up in the cache); text prompt files are read by
:class:`rlpost.components.prompt_sources.PromptFile`, so a hub file and a local copy give the same prompts.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar

from rlpost.components.prompt_sources import PromptFile
from rlpost.core.api import HubFiles, PromptSource, Range

__all__ = ["HFDatasetPrompts"]


class HFDatasetPrompts(PromptSource):
    """Prompts from a Hugging Face dataset: a hub dataset id (fetched and cached on first use, e.g. the HPD v2
    prompts), a local prompt file, a local ``save_to_disk`` directory, or a packaged ``datasets`` builder
    (``parquet``, ``json``, ``csv``) over local data files.

    A hub id with ``data_files`` names files inside the dataset repository: they are fetched with
    ``huggingface_hub.hf_hub_download`` into the hub cache (``$HF_HOME/hub``; later runs, also offline, reuse them)
    and read like local prompt files (:class:`PromptFile` for txt/jsonl/json/csv, ``datasets`` for parquet). This
    also reads repositories whose loading script ``datasets`` no longer runs. A hub id without ``data_files`` is
    loaded with ``datasets.load_dataset`` as the repository describes itself (cached under ``$HF_HOME/datasets``).
    A ``path`` ending in a prompt-file suffix is that local file, so ``--prompts.path FILE`` swaps a recipe's hub
    dataset for a local copy (``data_files`` and ``revision`` then do not apply).

    Validation never downloads: hub files are looked up in the cache (offline and not cached is a problem naming
    what is missing and how to provide it); cached files have their column checked from the first record.

    Args:
        path: Hub dataset id (``owner/name``), local prompt file (``.txt``, ``.jsonl``, ``.json``, ``.csv``,
            ``.parquet``), builder name (``parquet``, ``json``, ``csv``) or local dataset directory.
        split: Split to read (hub ids without ``data_files``, ``save_to_disk`` dataset dicts).
        column: Column/field holding the prompt; other columns become metadata (a JSON list of strings or a text
            file needs none).
        data_files: Data files: local paths for builder names, file names inside the repository for hub ids.
        limit: Keep only the first ``limit`` prompts (after ``unique``).
        unique: Keep each distinct prompt once (its first record), for datasets where a prompt appears in several
            records (e.g. one per annotated image pair).
        revision: Hub revision (branch, tag or commit) of a hub id; default the main branch.
    """

    name: ClassVar[str] = "hf-dataset"

    def __init__(
        self,
        path: str,
        split: str = "train",
        column: str = "prompt",
        data_files: str | list[str] | None = None,
        limit: Annotated[int, Range(ge=1)] | None = None,
        unique: bool = False,
        revision: str | None = None,
    ) -> None:
        self.path = path
        self.split = split
        self.column = column
        self.data_files = data_files
        self.limit = limit
        self.unique = unique
        self.revision = revision

    def _saved_dir(self) -> Path | None:
        """The directory when ``path`` is a dataset written with ``save_to_disk`` (a Dataset or DatasetDict)."""
        p = Path(self.path).expanduser()
        if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
            return p
        return None

    def _prompt_file(self) -> Path | None:
        """``path`` when it names a local data file (by its suffix: txt, jsonl, json, csv, parquet), read directly;
        ``data_files`` and ``revision`` do not apply. This lets ``--prompts.path FILE`` replace a recipe's hub
        dataset with a local copy in one flag."""
        p = Path(self.path).expanduser()
        return p if p.suffix in _PROMPT_SUFFIXES else None

    def _hub_id(self) -> str | None:
        """``path`` when it names a hub dataset (``owner/name``): not an existing local path, not written as one
        (``/``, ``./``, ``../``, ``~``). Bare names stay ``datasets`` builder names (``json``, ``text``, ...)."""
        if self.path.startswith(("/", "./", "../", "~")) or Path(self.path).exists() or self._prompt_file():
            return None
        return self.path if _HUB_ID.fullmatch(self.path) else None

    def _file_names(self) -> list[str]:
        if self.data_files is None:
            return []
        return [self.data_files] if isinstance(self.data_files, str) else list(self.data_files)

    def _local_files(self) -> list[Path] | None:
        """The local data files of a packaged builder (``parquet``, ``json``, ``csv``), or ``None`` for other paths."""
        if self.path not in _BUILDERS or self.data_files is None:
            return None
        files: list[Path] = []
        for pattern in self._file_names():
            matched = sorted(Path().glob(pattern)) if any(c in pattern for c in "*?[") else [Path(pattern)]
            files.extend(matched if matched else [Path(pattern)])
        return files

    def validate(self, recipe: Any) -> list[str]:
        """Check without loading rows or downloading: a ``save_to_disk`` directory (memory-mapped) has the split
        and column; local builder files exist and their header/schema has the column; a hub dataset's files are in
        the local cache (then their columns are checked) or can be fetched (not offline). Offline and not cached,
        the problem says how to provide the prompts."""
        where = "prompts.init_args"
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
        local = self._prompt_file()
        if local is not None:
            if local.suffix != ".parquet":
                return PromptFile(self.path, field=self.column).validate(recipe)  # reads the (text) file
            if not local.is_file():
                return [f"{where}.path: prompt file not found: {self.path}"]
            problem = self._column_problem(local, "parquet")
            return [] if problem is None else [f"{where}.{problem}"]
        if self._hub_id() is not None:
            return self._validate_hub(where)
        files = self._local_files()
        if files is None:
            explicit_local = self.path.startswith(("/", "./", "../", "~"))
            if explicit_local and not Path(self.path).expanduser().exists():
                return [f"{where}.path: dataset directory not found: {self.path}"]
            return []  # another datasets builder name: datasets checks it when loading
        for f in files:
            if not f.is_file():
                return [f"{where}.data_files: file not found: {f}"]
            problem = self._column_problem(f, self.path)
            if problem is not None:
                return [f"{where}.{problem}"]
        return []

    def _column_problem(self, f: Path, builder: str | None, shown: str | None = None) -> str | None:
        """Why ``f`` cannot give the prompt column (named ``shown``, default its path), or ``None``."""
        if builder is None:
            return None
        try:
            columns = _file_columns(f, builder)
        except (OSError, ValueError) as e:
            return f"data_files: {shown or f}: cannot read its columns ({e})"
        if columns is not None and self.column not in columns:
            return f"column: {shown or f} has no column {self.column!r} (columns: {columns})"
        return None

    def _prompt_file_problem(self, f: Path, shown: str) -> str | None:
        """Why prompt file ``f`` (read like :class:`PromptFile`, parquet through ``datasets``) lacks the prompt
        column, judged from its header, schema or first record only (a large file is not parsed here)."""
        if f.suffix == ".parquet":
            return self._column_problem(f, "parquet", shown)
        try:
            columns = _prompt_file_columns(f)
        except (OSError, ValueError) as e:
            return f"data_files: {shown}: cannot read its columns ({e})"
        if columns is not None and self.column not in columns:
            return f"column: {shown} has no column {self.column!r} (columns: {columns})"
        return None

    def _validate_hub(self, where: str) -> list[str]:
        """A hub id: each named file in the hub cache (``try_to_load_from_cache``, a file-system lookup), or the
        dataset in the ``datasets`` cache when no files are named. Not cached is a problem only offline."""
        from huggingface_hub import constants, try_to_load_from_cache

        if not self._file_names():
            if not _offline() or self._datasets_cached():
                return []
            return [f"{where}.path: {self._not_cached(self.path, constants.HF_HUB_CACHE)}"]
        missing: list[str] = []
        for name in self._file_names():
            if Path(name).suffix not in _PROMPT_SUFFIXES:
                return [
                    f"{where}.data_files: {name!r}: unsupported file type for a hub dataset "
                    f"({', '.join(_PROMPT_SUFFIXES)})"
                ]
            cached = try_to_load_from_cache(self.path, name, revision=self.revision, repo_type="dataset")
            if isinstance(cached, str):
                problem = self._prompt_file_problem(Path(cached), shown=name)
                if problem is not None:
                    return [f"{where}.{problem} (dataset {self.path!r})"]
            else:
                missing.append(name)
        if missing and _offline():
            what = f"{', '.join(missing)} of dataset {self.path!r}"
            return [f"{where}.data_files: {self._not_cached(what, constants.HF_HUB_CACHE)}"]
        return []

    def _not_cached(self, what: str, cache: str) -> str:
        command = self.hub_files()[0].command()
        return (
            f"{what} is not in the local Hugging Face cache ({cache}) and offline mode is on (HF_HUB_OFFLINE=1 or "
            f"HF_DATASETS_OFFLINE=1); fetch it with `{command}` (or `rlpost download --recipe RECIPE` for every file "
            "of a recipe), or give a local copy as the path (a .txt, .jsonl, .json, .csv or .parquet file: "
            "--prompts.path FILE)"
        )

    def hub_files(self) -> list[HubFiles]:
        """The named ``data_files`` of a hub dataset id (the whole dataset repository when none are named); nothing
        for local paths and builder names."""
        if self._hub_id() is None:
            return []
        files = tuple(self._file_names())
        return [HubFiles(self.path, files, repo_type="dataset", revision=self.revision, purpose="prompt dataset")]

    def _datasets_cached(self) -> bool:
        """Whether ``datasets`` can resolve the hub id offline (its module and data cache); reads no rows."""
        import datasets  # heavy import, only when used

        try:
            datasets.load_dataset_builder(self.path, revision=self.revision)
        except Exception:  # noqa: BLE001 - ConnectionError/FileNotFoundError/DatasetNotFoundError: not cached
            return False
        return True

    def _open_saved(self) -> tuple[list[str], int]:
        import datasets  # heavy import, only when used

        ds = datasets.load_from_disk(str(self._saved_dir()))
        if isinstance(ds, datasets.DatasetDict):
            if self.split not in ds:
                raise ValueError(f"dataset {self.path!r} has no split {self.split!r} (splits: {list(ds)})")
            ds = ds[self.split]
        return list(ds.column_names), len(ds)

    def _fetch_hub_files(self) -> list[str]:
        """Local paths of the hub dataset's named files, fetching those not yet cached (a line on stderr says so:
        the CLI silences the hub's own progress bars)."""
        from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

        paths = []
        for name in self._file_names():
            cached = try_to_load_from_cache(self.path, name, revision=self.revision, repo_type="dataset")
            if isinstance(cached, str):
                paths.append(cached)
                continue
            if _offline():
                raise ValueError(self._not_cached(f"{name} of dataset {self.path!r}", constants.HF_HUB_CACHE))
            print(
                f"rlpost: fetching prompts {self.path}/{name} (first use, cached in {constants.HF_HUB_CACHE})",
                file=sys.stderr,
                flush=True,
            )
            try:
                paths.append(hf_hub_download(self.path, name, repo_type="dataset", revision=self.revision))
            except Exception as e:  # noqa: BLE001 - network, offline, missing repo/file: one clear message
                raise ValueError(
                    f"could not fetch {name!r} of hub dataset {self.path!r} ({type(e).__name__}: {e}); check the id "
                    "and network access, or point the recipe at a local prompt file"
                ) from None
        return paths

    def load(self) -> list[tuple[str, dict[str, Any]]]:
        """Load the split and return ``(prompt, metadata)`` pairs.

        Raises:
            ValueError: If the split or column is missing, or a hub dataset cannot be fetched.
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
        elif (local := self._prompt_file()) is not None:
            return self._select(self._file_rows(local, self.path))
        elif self._hub_id() is not None and self.data_files is not None:
            files = zip(self._fetch_hub_files(), self._file_names(), strict=True)
            return self._select(row for path, name in files for row in self._file_rows(Path(path), name))
        else:
            if self._hub_id() is not None and not _offline():
                print(
                    f"rlpost: loading prompts {self.path} with datasets (fetched on first use, then cached in "
                    "$HF_HOME/datasets)",
                    file=sys.stderr,
                    flush=True,
                )
            ds = datasets.load_dataset(self.path, data_files=self.data_files, split=self.split, revision=self.revision)
        if self.column not in ds.column_names:
            raise ValueError(f"dataset {self.path!r} has no column {self.column!r} (columns: {ds.column_names})")
        return self._select(
            (str(record[self.column]), {k: v for k, v in record.items() if k != self.column}) for record in ds
        )

    def _file_rows(self, path: Path, shown: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Rows of one prompt file: text formats read like :class:`PromptFile` (the same reader whatever the
        ``datasets`` version; a JSON list of strings is a list of prompts), parquet through ``datasets``."""
        if path.suffix != ".parquet":
            yield from PromptFile(str(path), field=self.column).load()
            return
        import datasets  # heavy import, only when used

        ds = datasets.load_dataset("parquet", data_files=[str(path)], split="train")
        if self.column not in ds.column_names:
            raise ValueError(f"{shown}: no column {self.column!r} (columns: {ds.column_names})")
        for record in ds:
            yield str(record[self.column]), {k: v for k, v in record.items() if k != self.column}

    def _select(self, rows: Iterable[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
        """Apply ``unique`` (first record of each prompt) then ``limit``, reading no further than needed."""
        kept: list[tuple[str, dict[str, Any]]] = []
        seen: set[str] = set()
        for prompt, meta in rows:
            if self.unique:
                if prompt in seen:
                    continue
                seen.add(prompt)
            kept.append((prompt, meta))
            if self.limit is not None and len(kept) == self.limit:
                break
        return kept


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A hub dataset id ``owner/name`` (huggingface_hub's validator is stricter; this only tells a hub id from a local
path or a builder name)."""
_PROMPT_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
"""Prompt files ``hf-dataset`` reads itself (a local ``path`` or a hub dataset's ``data_files``)."""


def _offline() -> bool:
    """Offline mode of the hub or ``datasets``, read from the environment now (the libraries read it on import)."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("HF_DATASETS_OFFLINE", ""))
    return constants.HF_HUB_OFFLINE or any(v.upper() in ("1", "ON", "YES", "TRUE") for v in flags)


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
        first = fh.readline(_ARRAY_PEEK)  # bounded: one line may be the whole file
        if first.lstrip().startswith("["):  # a JSON array: decode its first element from the file's head only
            fh.seek(0)
            return _first_array_columns(fh.read(_ARRAY_PEEK))
    if not first.strip() or (len(first) == _ARRAY_PEEK and not first.endswith("\n")):
        return None  # blank, or a first record longer than what validation reads
    record = _loads(first)
    return list(record) if isinstance(record, dict) else None


def _loads(text: str) -> Any:
    """``json.loads``, with the decoder's ``RecursionError`` on deep nesting as the ``ValueError`` callers report."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


_ARRAY_PEEK = 1 << 16
"""Characters read from the head of a JSON array file to find its first element's fields (large arrays, e.g.
HPD v2's 116 MB train.json, are not parsed whole during validation)."""


def _first_array_columns(head: str) -> list[str] | None:
    """Fields of the first element of the JSON array that ``head`` begins: an object's keys; ``["text"]`` for a
    string (``datasets`` reads a list of strings as a ``text`` column); ``None`` if not decodable from ``head``."""
    first = _first_array_element(head)
    if isinstance(first, dict):
        return list(first)
    return ["text"] if isinstance(first, str) else None


def _first_array_element(head: str) -> Any:
    """The first element of the JSON array that ``head`` begins (``None``: empty, or longer than ``head``)."""
    body = head.lstrip()[1:].lstrip()
    try:
        first, _ = json.JSONDecoder().raw_decode(body)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except json.JSONDecodeError:
        return None  # empty, or the first element is longer than the head read
    return first


def _prompt_file_columns(path: Path) -> list[str] | None:
    """Fields a :class:`PromptFile` record of ``path`` offers, from the header or first record (``None``: any field
    works, as for a text file or a JSON list of strings, or not determinable cheaply)."""
    if path.suffix == ".txt":
        return None
    if path.suffix == ".csv":
        return _file_columns(path, "csv")
    with path.open(encoding="utf-8") as fh:
        head = fh.read(_ARRAY_PEEK)
    if path.suffix == ".json" and head.lstrip().startswith("["):
        first = _first_array_element(head)
    else:
        line = head.lstrip().split("\n", 1)[0]
        try:
            first = _loads(line) if line else None
        except json.JSONDecodeError:
            return None  # PromptFile names the malformed line when loading
    return list(first) if isinstance(first, dict) else None
