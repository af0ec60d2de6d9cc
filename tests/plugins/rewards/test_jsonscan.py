"""The JSON pre-scan of the reward server and client (rlpost_rewards._jsonscan): it sees structure only outside
strings, counts what json.loads would build, and refuses before anything is built."""

from __future__ import annotations

import json

import pytest

from rlpost_rewards._jsonscan import JSONLimitError, count_values, loads_bounded


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("1", 1),
        ('"a, b: [c] {d}"', 1),  # structure inside a string is text
        ('["x\\"],[", 2]', 3),  # an escaped quote does not end the string
        ('{"a": [1, 2, {"b": null}], "c": "\\\\"}', 10),  # 2 dicts, a list, 3 keys, 4 values
        ('{"\u00e9\U0001f600": "[,]"}', 3),  # multi-byte UTF-8 holds no ASCII byte
    ],
)
def test_counts_values_outside_strings(text, values):
    data = text.encode("utf-8")
    assert count_values(data, 100, 10) == values
    assert loads_bounded(data, values, 10) == json.loads(text)


def test_limits_are_checked_before_parsing():
    with pytest.raises(JSONLimitError, match="holds more than 3 JSON values") as err:
        loads_bounded(b"[1, 2, 3, 4]", 3, 10)
    assert err.value.limit == "values"
    with pytest.raises(JSONLimitError, match="nests JSON arrays/objects deeper than 2 levels") as err:
        loads_bounded(b"[[[1]]]", 100, 2)
    assert err.value.limit == "depth"
    assert loads_bounded(b"[[1]]", 100, 2) == [[1]]


def test_an_unterminated_string_ends_the_scan_and_json_rejects_it():
    """Everything after an unterminated string is string text to json too; the scan stops there in linear time."""
    data = b"[" + b"{}," * 10 + b'"' + b"{}," * 1_000_000
    assert count_values(data, 100, 10) == 22  # 1 + the "[" + 10 x ("{" and ",")
    with pytest.raises(ValueError, match="Unterminated string"):
        loads_bounded(data, 100, 10)


def test_not_utf8_is_a_value_error():
    with pytest.raises(ValueError):
        loads_bounded(b'"\xff"', 10, 10)
