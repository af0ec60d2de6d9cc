"""Files a user names (a recipe, a bench recipe, a prompts file, a results file), read with limits.

Every problem is a :class:`UserFileError` whose message names the file and says what is wrong in one line, so a
command can turn it into its own error type (exit status 2, no traceback):

* missing; a directory; not a regular file (a FIFO or a device would block or never end);
* larger than the caller's bound, refused after reading at most one byte more (the size on disk may change);
* not UTF-8, naming the line and the byte offset (``FILE:LINE: not UTF-8 text (... at byte N)``);
* YAML over the limits of :mod:`rlpost.core.yaml_limits` (size, nesting, aliases, entries, duplicate keys) or JSON
  nested too deep or repeating a key (Python's ``json`` keeps the last one silently, like PyYAML).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from rlpost.core.yaml_limits import RECIPE_LIMITS, YamlLimits, load_yaml

__all__ = [
    "MAX_MESSAGE_CHARS",
    "MAX_PROMPTS_FILE_BYTES",
    "UserFileError",
    "load_json",
    "read_json_file",
    "read_nonblank_lines",
    "read_text_file",
    "read_yaml_file",
]

MAX_PROMPTS_FILE_BYTES = 1024 * 1024
"""A prompts file (one prompt per line): 1 MiB is thousands of prompts, each an image to generate."""

MAX_MESSAGE_CHARS = 1000
"""What a message may quote of a parser's own error text (PyYAML's include a snippet of the document)."""


class UserFileError(ValueError):
    """A file a user named cannot be used; the message names the file and the problem."""


def read_text_file(path: str | os.PathLike[str], what: str, max_bytes: int) -> str:
    """The UTF-8 text of ``path`` (without a leading byte-order mark).

    Args:
        path: The file.
        what: What the file is, for messages ("recipe file", "prompts file").
        max_bytes: The largest file accepted.

    Raises:
        UserFileError: Missing, a directory or not a regular file, over ``max_bytes``, unreadable, or not UTF-8.
    """
    p = Path(path)
    try:
        if p.is_dir():
            raise UserFileError(f"{path}: a directory, not a {what}")
        if not p.exists():
            raise UserFileError(f"{what} not found: {path}")
        if not p.is_file():
            raise UserFileError(f"{path}: not a regular file (a {what} must be one)")
        with p.open("rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise UserFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise UserFileError(f"{path}: larger than {max_bytes} bytes, the limit for a {what}")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark marks the encoding, it is no text
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserFileError(f"{path}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_yaml_file(path: str | os.PathLike[str], what: str, limits: YamlLimits = RECIPE_LIMITS) -> Any:
    """One YAML document from ``path``, read with :func:`read_text_file` and parsed with ``limits``.

    Raises:
        UserFileError: See :func:`read_text_file`; invalid YAML or over a limit: ``PATH: not valid YAML: ...``.
    """
    text = read_text_file(path, what, limits.max_bytes)
    try:
        return load_yaml(text, str(path), limits)
    except yaml.YAMLError as exc:
        raise UserFileError(f"{path}: not valid YAML: {_clip(str(exc))}") from None


def load_json(text: str, source: str) -> Any:
    """Parse JSON text, refusing repeated keys and nesting deeper than Python's recursion limit.

    Raises:
        UserFileError: ``SOURCE: not valid JSON: ...``.
    """
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise UserFileError(f"{source}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise UserFileError(f"{source}: not valid JSON: nested too deeply") from None
    except _DuplicateKey as exc:
        raise UserFileError(f"{source}: not valid JSON: {exc}") from None


def read_json_file(path: str | os.PathLike[str], what: str, max_bytes: int) -> Any:
    """JSON from ``path``: :func:`read_text_file`, then :func:`load_json`.

    Raises:
        UserFileError: As those two.
    """
    return load_json(read_text_file(path, what, max_bytes), str(path))


def read_nonblank_lines(path: str | os.PathLike[str], what: str, max_bytes: int) -> list[str]:
    """The stripped non-blank lines of a text file (one prompt per line, say).

    Raises:
        UserFileError: See :func:`read_text_file`, or no non-blank line.
    """
    lines = [ln.strip() for ln in read_text_file(path, what, max_bytes).splitlines() if ln.strip()]
    if not lines:
        raise UserFileError(f"{path}: empty (no non-blank line), a {what} needs at least one")
    return lines


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate key {key[:60]!r}; JSON readers keep only the last one")
        out[key] = value
    return out


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else f"{text[: MAX_MESSAGE_CHARS - 30]}... ({len(text)} characters)"
