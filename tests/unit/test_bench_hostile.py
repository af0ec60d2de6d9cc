"""Hostile bench recipes and result files: ``rlpost bench`` reads them within the limits of a training recipe.

Every case ends like a bad training recipe (tests/unit/test_recipe_hostile.py): exit status 2, a message naming the
file (or field) and the problem, no traceback, a bounded message, quickly, nothing written, and no bench begun (the
refusal comes before any runner or model is built).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import rlpost.bench
from rlpost.apps import cli
from rlpost.apps.host import reset_host
from rlpost.core.yaml_limits import MAX_BYTES, MAX_DEPTH, MAX_ITEMS, MAX_NODES
from rlpost.engine.recipe import MAX_PROBLEM_CHARS
from rlpost.models.sd3 import SD3Policy

HOSTILE = Path(__file__).resolve().parents[1] / "fixtures" / "recipes" / "hostile"
SECONDS = 30.0  # as tests/unit/test_recipe_hostile.py: a generous bound on a loaded 2-core machine
ALGOS = "algorithms: [{name: a, recipes: [a.yaml]}]\n"


@pytest.fixture(autouse=True)
def no_bench_work(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a hostile bench recipe must be refused before the bench begins")

    monkeypatch.setattr(rlpost.bench, "Bench", forbidden)
    monkeypatch.setattr(SD3Policy, "setup", forbidden)
    reset_host(None)
    yield
    reset_host(None)


def _refused(capsys, recipe: Path, out: Path, *extra: str) -> str:
    start = time.monotonic()
    rc = cli.main(["bench", "--recipe", str(recipe), "--out", str(out), *extra])
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert rc == 2, captured.err[:2000]
    assert elapsed < SECONDS, f"{recipe.name}: {elapsed:.1f}s"
    assert len(captured.err) < 4 * MAX_PROBLEM_CHARS, f"{len(captured.err)} characters of error"
    assert captured.out == "" and "Traceback" not in captured.err
    assert not out.exists(), "a refused bench recipe must write nothing"
    return " ".join(captured.err.split())


def _bomb(levels: int) -> str:
    return "".join(
        f"  l{i}: &a{i} [" + ", ".join([f"*a{i - 1}" if i else "lol"] * 9) + "]\n" for i in range(levels + 1)
    )


CASES = {
    "latin1": (
        "# a comment\nbench: {output_dir: caf\xe9}\n" + ALGOS,
        "latin1.yaml:2: not UTF-8 text (invalid continuation byte at byte 35)",
    ),
    "deep_nesting": ("bench: {overrides: " + "[" * 5000 + "\n" + ALGOS, f"nesting deeper than {MAX_DEPTH} levels"),
    "alias_bomb": (  # nine levels of nine: the ~600-byte document took 77 s and 5.9 GB before the limits
        "paper:\n  notes:\n" + _bomb(9) + ALGOS,
        f"alias_bomb.yaml: not valid YAML: aliases expand to more than {MAX_NODES} values",
    ),
    "duplicate_key": (
        "bench: {max_iterations: 1}\n" + ALGOS + "bench: {max_iterations: 2}\n",
        "not valid YAML: duplicate key 'bench' (lines 1 and 3)",
    ),
    "long_list": (
        "bench: {seeds: [" + ", ".join(str(i) for i in range(10 * MAX_ITEMS)) + "]}\n" + ALGOS,
        f"a list with more than {MAX_ITEMS} entries (line 1)",
    ),
    "not_a_mapping": ("[1, 2]\n", "a bench recipe must be a YAML mapping, got list"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_bench_recipe_is_refused_like_a_training_recipe(case, capsys, tmp_path):
    text, message = CASES[case]
    recipe = tmp_path / f"{case}.yaml"
    recipe.write_bytes(text.encode("latin-1"))
    assert message in _refused(capsys, recipe, tmp_path / "out")


def test_the_bench_fixtures_of_the_training_recipes_are_refused_too(capsys, tmp_path):
    """The training recipes' own hostile fixtures, read as bench recipes: refused by the same loader."""
    for name, message in (
        ("alias_bomb_mappings", f"aliases expand to more than {MAX_NODES} values"),
        ("deep_nesting_through_aliases", f"nesting deeper than {MAX_DEPTH} levels once aliases are expanded"),
        ("recursive_alias", "recursive alias"),
        ("python_object_tag", "could not determine a constructor"),
    ):
        assert message in _refused(capsys, HOSTILE / f"{name}.yaml", tmp_path / "out"), name


def test_oversize_missing_and_directory_bench_recipes(capsys, tmp_path):
    big, missing, directory, out = tmp_path / "big.yaml", tmp_path / "nope.yaml", tmp_path / "dir.yaml", tmp_path / "o"
    big.write_text("# padding\n" * (MAX_BYTES // 10 + 1))
    directory.mkdir()
    assert f"big.yaml: larger than {MAX_BYTES} bytes, the limit for a bench recipe" in _refused(capsys, big, out)
    assert f"bench recipe not found: {missing}" in _refused(capsys, missing, out)
    assert "dir.yaml: a directory, not a bench recipe" in _refused(capsys, directory, out)


def test_values_of_the_wrong_type_are_problems_not_tracebacks(capsys, tmp_path):
    recipe = tmp_path / "types.yaml"
    recipe.write_text(
        "bench: {max_iterations: lots, time_budget_s: {a: 1}, base: 3, calibration: [1], bootstrap: {confidence: x},"
        " schedule: [round-robin], fast: {a: 1}}\n"
        "algorithms: [{name: a, recipes: 7, overrides: [1]}, {name: [b]}]\n"
        "paper: {notes: [x]}\n"
    )
    err = _refused(capsys, recipe, tmp_path / "out")
    for needle in (
        "bench.max_iterations: expected an integer, got 'lots'",
        "bench.time_budget_s: expected a number of seconds or null, got {'a': 1}",
        "bench.base: expected a recipe path or a list of them, got 3",
        "bench.calibration: expected a mapping, got [1]",
        "bench.bootstrap.confidence: expected a number, got 'x'",
        "bench.schedule: expected a string, got ['round-robin']",
        "bench.fast: a name or a list of names, got {'a': 1}",
        "algorithms[0].recipes: expected a recipe path or a list of them, got 7",
        "algorithms[0].overrides: expected a mapping, got [1]",
        "algorithms[1]: needs a name",
        "paper.notes: expected a mapping {algorithm: text}, got ['x']",
    ):
        assert needle in err, needle


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("&a [*a]", "--bench.max_iterations: not valid YAML: recursive alias"),
        ("[" * 200, f"--bench.max_iterations: not valid YAML: nesting deeper than {MAX_DEPTH} levels"),
        ("{a: 1, a: 2}", "--bench.max_iterations: not valid YAML: duplicate key 'a'"),
    ],
    ids=["recursive", "deep", "duplicate"],
)
def test_bench_overrides_have_the_same_limits(value, message, capsys, tmp_path):
    recipe = tmp_path / "b.yaml"
    recipe.write_text("bench: {max_iterations: 1}\n" + ALGOS)
    assert message in _refused(capsys, recipe, tmp_path / "out", "--bench.max_iterations", value)


def test_a_bench_override_alias_bomb_is_refused(capsys, tmp_path):
    recipe = tmp_path / "b.yaml"
    recipe.write_text("bench: {max_iterations: 1}\n" + ALGOS)
    bomb = "[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else "1"] * 9) + "]" for i in range(9)) + "]"
    err = _refused(capsys, recipe, tmp_path / "out", "--bench.max_iterations", bomb)
    assert f"--bench.max_iterations: not valid YAML: aliases expand to more than {MAX_NODES} values" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "bench result not found"),
        (b"{not json", "bench.json: not valid JSON: Expecting property name enclosed in double quotes (line 1"),
        (b"[" * 100_000, "bench.json: not valid JSON: nested too deeply"),
        (b'{"runs": {}, "runs": {}}', "bench.json: not valid JSON: duplicate key 'runs'"),
        (b"[1, 2]", "not a bench result (a JSON object) of rlpost bench"),
        (b'{"spec": "caf\xe9"}', "bench.json:1: not UTF-8 text (invalid continuation byte at byte 13)"),
        ("dir", "bench.json: a directory, not a bench result"),
    ],
    ids=["missing", "not-json", "deep", "duplicate", "list", "latin1", "directory"],
)
def test_report_only_refuses_a_bad_bench_json(content, message, capsys, tmp_path):
    if content == "dir":
        (tmp_path / "bench.json").mkdir()
    elif content is not None:
        (tmp_path / "bench.json").write_bytes(content)
    with pytest.raises(SystemExit) as info:  # argparse's error: exit status 2 after a one-line message
        cli.main(["bench", "--report-only", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err and len(err) < 4 * MAX_PROBLEM_CHARS
    assert "rlpost bench: error: --report-only: " in err and message in " ".join(err.split())
    assert not (tmp_path / "bench.md").exists()
