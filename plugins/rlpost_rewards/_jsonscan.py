"""JSON from the network, parsed only after its size as Python objects is known to be bounded.

``json.loads`` turns 4 MB of ``[{},{},...]`` into 1.3 million dicts (about 100 MB), and a few kB of ``[[[[...`` into a
``RecursionError``. :func:`loads_bounded` first counts the values and the nesting depth with one regular-expression
pass over the bytes (strings are skipped whole, so a multi-megabyte base64 image costs one match, and nothing is
built), and only parses text within both limits; the depth limit also keeps ``json``'s recursive decoder far from
the interpreter's recursion limit.

The scan is exact for UTF-8, where no byte of a multi-byte character is an ASCII byte: outside strings it sees what
``json`` sees. Where the two could disagree the text is not JSON (an unterminated string, a bad escape), and ``json``
stops with an error at that point, having built only values the scan already counted.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

__all__ = ["JSONLimitError", "count_values", "loads_bounded"]

# One match = everything up to the next structural character outside strings, which is group 1. Possessive
# quantifiers (Python 3.11) never backtrack, so a match costs time linear in what it consumes; the caller anchors
# each match where the last one ended, so text after an unterminated string is never rescanned.
_UP_TO_STRUCTURE = re.compile(rb'(?:[^"\[\]{},:]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+([\[\]{},:])', re.DOTALL)
_OPEN, _CLOSE = frozenset(b"[{"), frozenset(b"]}")


class JSONLimitError(ValueError):
    """A JSON text holds more values, or nests deeper, than allowed.

    Args:
        message: What was over which limit.
        limit: Which limit: ``"values"`` or ``"depth"``.
    """

    def __init__(self, message: str, limit: Literal["values", "depth"]) -> None:
        super().__init__(message)
        self.limit = limit


def count_values(data: bytes | bytearray, max_values: int, max_depth: int, what: str = "body") -> int:
    """Count the values of the JSON text ``data`` (keys included) without parsing it, within limits.

    The count is ``1 +`` the ``[``, ``{``, ``,`` and ``:`` outside strings: every value or key after the first follows
    one of them, so for valid JSON it is an upper bound on the Python objects ``json.loads`` would create (exact
    unless there are empty containers). Text that is not JSON is counted the same way; ``json`` rejects it later.

    Args:
        data: UTF-8 JSON text.
        max_values: Most values allowed.
        max_depth: Deepest nesting of arrays and objects allowed (``[]`` is depth 1).
        what: What ``data`` is, for the error message.

    Returns:
        The count (at most ``max_values``).

    Raises:
        JSONLimitError: Over either limit; the scan stops there.
    """
    values, depth, pos = 1, 0, 0
    match = _UP_TO_STRUCTURE.match
    while (found := match(data, pos)) is not None:
        pos = found.end()
        char = data[pos - 1]
        if char in _CLOSE:
            depth -= 1
            continue
        values += 1
        if values > max_values:
            raise JSONLimitError(f"{what} holds more than {max_values} JSON values", "values")
        if char in _OPEN:
            depth += 1
            if depth > max_depth:
                raise JSONLimitError(f"{what} nests JSON arrays/objects deeper than {max_depth} levels", "depth")
    return values


def loads_bounded(data: bytes | bytearray, max_values: int, max_depth: int, what: str = "body") -> Any:
    """``json.loads`` of UTF-8 ``data`` once :func:`count_values` has checked its size.

    Raises:
        JSONLimitError: More than ``max_values`` values, or nested deeper than ``max_depth``; nothing was parsed.
        ValueError: Not UTF-8 or not JSON (``UnicodeDecodeError`` and ``json.JSONDecodeError`` are both
            ``ValueError``; so is an integer of more digits than Python converts).
    """
    count_values(data, max_values, max_depth, what)
    return json.loads(data.decode("utf-8"))
