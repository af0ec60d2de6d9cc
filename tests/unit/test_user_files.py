"""rlpost.core.user_files: a file a user names is read with limits, and every problem is one line naming the file."""

from __future__ import annotations

import os
import threading

import pytest

from rlpost.core.user_files import (
    UserFileError,
    load_json,
    read_json_file,
    read_nonblank_lines,
    read_text_file,
    read_yaml_file,
)
from rlpost.core.yaml_limits import MAX_NODES, RECIPE_LIMITS, SAVED_LIMITS


def test_text_within_the_bound_is_read_and_one_byte_more_is_refused(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"x" * 100)
    assert read_text_file(path, "thing", 100) == "x" * 100
    with pytest.raises(UserFileError, match=r"f.txt: larger than 99 bytes, the limit for a thing$"):
        read_text_file(path, "thing", 99)


def test_undecodable_bytes_are_named_by_offset_and_line(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"one\ntwo\nthr\xe9e\n")
    with pytest.raises(UserFileError, match=r"f.txt:3: not UTF-8 text \(invalid continuation byte at byte 11\)"):
        read_text_file(path, "thing", 1000)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    """Reading a FIFO nobody writes to would block forever; it is refused as not a regular file instead."""
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    result: list[BaseException] = []
    reader = threading.Thread(target=lambda: result.append(_error(read_text_file, fifo, "recipe file", 10)))
    reader.daemon = True  # if it blocked, it must not hold the test process
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "read_text_file blocked on a FIFO"
    assert "pipe.yaml: not a regular file (a recipe file must be one)" in str(result[0])


def _error(fn, *args):
    try:
        fn(*args)
    except UserFileError as exc:
        return exc
    raise AssertionError("no UserFileError")


def test_missing_and_directory(tmp_path):
    with pytest.raises(UserFileError, match="^thing not found: "):
        read_text_file(tmp_path / "nope", "thing", 10)
    with pytest.raises(UserFileError, match=r": a directory, not a thing$"):
        read_nonblank_lines(tmp_path, "thing", 10)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": 1, "a": 2}', "x.json: not valid JSON: duplicate key 'a'"),
        ("[" * 100_000 + "]" * 100_000, "x.json: not valid JSON: nested too deeply"),
        ('{"a": 1,\n "b": }', "x.json: not valid JSON: Expecting value (line 2, column 7)"),
    ],
    ids=["duplicate", "deep", "syntax"],
)
def test_json_problems_are_one_line(text, message):
    with pytest.raises(UserFileError) as info:
        load_json(text, "x.json")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_json_file_keeps_plain_json(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{"runs": {"a": [1, 2.5, null, true]}, "nan": NaN}')
    data = read_json_file(path, "bench result", 1000)
    assert data["runs"] == {"a": [1, 2.5, None, True]} and data["nan"] != data["nan"]


def test_a_saved_recipe_may_hold_more_than_a_written_one(tmp_path):
    """A run's recipe.yaml lists every default a recipe left out, so it is read with SAVED_LIMITS."""
    path = tmp_path / "recipe.yaml"
    path.write_text("".join(f"k{i}: [" + ", ".join(["1"] * 100) + "]\n" for i in range(MAX_NODES // 100 + 1)))
    with pytest.raises(UserFileError, match=f"the document holds more than {MAX_NODES} values"):
        read_yaml_file(path, "recipe file", RECIPE_LIMITS)
    assert len(read_yaml_file(path, "run recipe", SAVED_LIMITS)) == MAX_NODES // 100 + 1


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"[" * 100_000, "ds.json: not valid JSON: nested too deeply"),
        (b'{"bf16": {}, "bf16": {}}', "ds.json: not valid JSON: duplicate key 'bf16'"),
        (b'{"note": "caf\xe9"}', "ds.json:1: not UTF-8 text (invalid continuation byte at byte 13)"),
    ],
    ids=["deep", "duplicate", "latin1"],
)
def test_a_deepspeed_config_is_read_as_a_user_file(content, problem, tmp_path):
    """``distributed.deepspeed_config`` names a user's JSON file: a problem of the section, never a traceback."""
    from rlpost.engine.distributed_config import DistributedConfig

    path = tmp_path / "ds.json"
    path.write_bytes(content)
    problems = DistributedConfig(deepspeed_config=str(path)).problems()
    assert len(problems) == 1 and problems[0].startswith(f"deepspeed_config: {tmp_path}/{problem}")
