"""Hostile recipes: alias bombs, deep nesting, duplicate keys, Python tags, huge values, oversize or non-text files.

Every case must end like any other bad recipe: exit code 2, a message naming the file (or field) and the limit,
no traceback, a bounded message, quickly, and nothing written (``train`` included). The fixtures in
tests/fixtures/recipes/hostile are overlays on valid.yaml, each with ``# expect:`` lines; cases that would make the
repository heavy or binary are generated here.
"""

from __future__ import annotations

import re
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from rlpost.apps import cli
from rlpost.apps.host import get_host, reset_host
from rlpost.core.yaml_limits import (
    MAX_BYTES,
    MAX_CHARS,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_NODES,
    YamlLimitError,
    load_yaml,
    short_repr,
)
from rlpost.engine.recipe import MAX_PROBLEM_CHARS, RecipeError, merge_sources, parse_recipe
from rlpost.models.sd3 import SD3Policy

RECIPES = Path(__file__).resolve().parents[1] / "fixtures" / "recipes"
HOSTILE = sorted((RECIPES / "hostile").glob("*.yaml"))
# Wall-clock bound per case on a loaded 2-core machine; before the limits, the bombs ran for minutes.
SECONDS = 30.0


def _expectations(path: Path) -> list[str]:
    text = path.read_text(errors="replace")
    return [ln.split("expect:", 1)[1].strip() for ln in text.splitlines() if ln.startswith("# expect:")]


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    def forbidden(self, device):
        raise AssertionError("a hostile recipe must be refused before any model loads")

    monkeypatch.setattr(SD3Policy, "setup", forbidden)
    reset_host(None)
    yield
    reset_host(None)


def _refused(capsys, recipe: Path, out: Path, command: str = "validate") -> str:
    """Run the CLI on valid.yaml + ``recipe``; check exit 2, bounded output, speed, nothing written."""
    start = time.monotonic()
    rc = cli.main(
        [command, "--recipe", str(RECIPES / "valid.yaml"), "--recipe", str(recipe), "--run.output_dir", str(out)]
    )
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert rc == 2, captured.err[:2000]
    assert elapsed < SECONDS, f"{recipe.name}: {elapsed:.1f}s"
    assert len(captured.err) < 4 * MAX_PROBLEM_CHARS, f"{recipe.name}: {len(captured.err)} characters of error"
    assert captured.out == "" and "Traceback" not in captured.err
    assert not out.exists(), "a refused recipe must write nothing"
    return " ".join(captured.err.split())


def test_hostile_fixtures_cover_every_yaml_family():
    names = {p.stem for p in HOSTILE}
    for family in ("alias_bomb", "deep_nesting", "duplicate", "python_object", "huge", "recursive_alias"):
        assert any(n.startswith(family) for n in names), family
    assert len(HOSTILE) >= 15


@pytest.mark.parametrize("recipe", HOSTILE, ids=lambda p: p.stem)
def test_hostile_fixture_is_refused_naming_the_problem(recipe, capsys, tmp_path):
    err = _refused(capsys, recipe, tmp_path / "run")
    expected = _expectations(recipe)
    assert expected, f"{recipe.name} has no '# expect:' line"
    for text in expected:
        assert " ".join(text.split()) in err, f"{recipe.name}: {text!r} not in:\n{err}"


@pytest.mark.parametrize("name", ["alias_bomb_billion_laughs", "deep_nesting_flow", "duplicate_top_level_key"])
def test_train_refuses_hostile_recipes_before_writing_anything(name, capsys, tmp_path):
    _refused(capsys, RECIPES / "hostile" / f"{name}.yaml", tmp_path / "run", command="train")


def test_alias_bomb_is_refused_before_it_is_built():
    """The refusal happens on the composed node graph: memory stays that of the text, not of the expansion."""
    tracemalloc.start()
    try:
        with pytest.raises(RecipeError, match="aliases expand to more than"):
            merge_sources([str(RECIPES / "hostile" / "alias_bomb_billion_laughs.yaml")])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"


def test_generated_oversize_file_is_refused_without_reading_it(capsys, tmp_path):
    big = tmp_path / "big.yaml"
    with big.open("w") as fh:
        fh.write("# padding\n" * (MAX_BYTES // 10 + 1))
    err = _refused(capsys, big, tmp_path / "run")
    assert f"larger than {MAX_BYTES} bytes" in err


def test_generated_non_utf8_file_is_refused(capsys, tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"run: {seed: 1}\n\xff\xfe\x00garbage\n")
    err = _refused(capsys, binary, tmp_path / "run")
    assert "binary.yaml:2: not UTF-8 text (invalid start byte at byte 15)" in err


def test_generated_very_deep_nesting_stops_early(capsys, tmp_path):
    """A million '[' (1 MB minus a bit): refused at level MAX_DEPTH + 1 without reading to the end."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("run: " + "[" * (MAX_BYTES - 100))
    err = _refused(capsys, deep, tmp_path / "run")
    assert f"nesting deeper than {MAX_DEPTH} levels" in err


def test_directory_instead_of_a_file(capsys, tmp_path):
    assert cli.main(["validate", "--recipe", str(tmp_path)]) == 2
    assert f"{tmp_path}: a directory, not a recipe file" in capsys.readouterr().err


def _bomb(levels: int) -> str:
    return "- &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"- &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, levels + 1)
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("&a [*a]", "recursive alias"),
        ("[" * 200 + "]" * 200, f"nesting deeper than {MAX_DEPTH} levels"),
        (_bomb(6), f"aliases expand to more than {MAX_NODES} values"),
    ],
    ids=["recursive", "deep", "bomb"],
)
def test_override_values_have_the_same_limits(value, message):
    with pytest.raises(RecipeError, match=f"--run.seed: not valid YAML: {message}"):
        parse_recipe([str(RECIPES / "valid.yaml")], [("run.seed", value)], get_host())


def test_ordinary_aliases_still_work():
    """Aliases below the limits load, in a document and in an override (parsed as ``rlpost train`` parses it)."""
    loaded = load_yaml(_bomb(2))
    assert len(loaded) == 3 and loaded[2][0][0] == ["lol"] * 10
    override = ("prompts.init_args.prompts", "[&p a red apple, *p, *p]")
    cfg = parse_recipe([str(RECIPES / "valid.yaml")], [override], get_host())
    assert cfg["prompts"]["init_args"]["prompts"] == ["a red apple"] * 3


def test_limits_keep_safe_load_semantics():
    text = "base: &b {lr: 1.0, betas: [0.9, 0.99]}\nopt:\n  <<: *b\n  lr: 2.0\nwhen: 2024-01-01\nn: ~\n"
    assert load_yaml(text) == yaml.safe_load(text)
    assert load_yaml("") is None
    assert load_yaml("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None  # exactly the limit is fine
    with pytest.raises(YamlLimitError):
        load_yaml("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))


def test_short_repr_never_builds_the_whole_repr():
    shared: list[object] = ["lol"] * 10
    for _ in range(8):  # 10**9 leaves if repr'd in full
        shared = [shared] * 10
    start = time.monotonic()
    text = short_repr(shared)
    assert len(text) <= 200 and time.monotonic() - start < 1.0
    assert short_repr("x" * 10_000).count("x") < 100


def test_recipe_error_message_is_bounded():
    err = RecipeError([f"field{i}: " + "y" * 50_000 for i in range(500)])
    assert len(err.problems) == 500  # every problem kept for programs
    text = str(err)
    assert len(text) < 60 * MAX_PROBLEM_CHARS and "... and 450 more problem(s)" in text


def test_a_quoted_alias_bomb_in_a_field_is_refused_naming_the_field(capsys, tmp_path):
    """jsonargparse parses a string given for a number field as YAML again, with its own loader: a bomb quoted as a
    string is refused before that, naming the file and the field."""
    overlay = tmp_path / "quoted.yaml"
    overlay.write_text(yaml.safe_dump({"run": {"seed": _bomb(6)}}))
    err = _refused(capsys, overlay, tmp_path / "run")
    assert f"quoted.yaml: run.seed: not valid YAML inside a string: aliases expand to more than {MAX_NODES}" in err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--run.seed", _bomb(6), "--run.seed: not valid YAML: aliases expand"),
        ("--run", yaml.safe_dump({"seed": _bomb(6)}), "--run: seed: not valid YAML inside a string: aliases expand"),
        ("--run.seed", "[" * 200 + "]" * 200, f"--run.seed: not valid YAML: nesting deeper than {MAX_DEPTH}"),
    ],
    ids=["bomb", "quoted-bomb", "deep"],
)
def test_command_line_values_are_refused_before_jsonargparse_reads_them(option, value, message, capsys, tmp_path):
    rc = cli.main(["validate", "--recipe", str(RECIPES / "valid.yaml"), option, value])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and message in err and len(err) < 4 * MAX_PROBLEM_CHARS


def _flat(items: int, item: str = "a") -> str:
    return "[" + ", ".join([item] * items) + "]"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_flat(MAX_ITEMS + 1), f"a list with more than {MAX_ITEMS} entries (line 1); longer ones are slow to check"),
        ("{" + ", ".join(f"k{i}: 1" for i in range(MAX_ITEMS + 1)) + "}", f"a mapping with more than {MAX_ITEMS}"),
        (
            "".join(f"k{i}: {_flat(100)}\n" for i in range(MAX_NODES // 100 + 1)),
            f"the document holds more than {MAX_NODES} values (line 41); read the values from a file",
        ),
        (
            "s: &s " + "x" * (MAX_CHARS // 2) + "\nt: [*s, *s]\n",
            f"aliases expand to more than {MAX_CHARS} characters of text (line 2); write the values out",
        ),
    ],
    ids=["list", "mapping", "values", "characters"],
)
def test_entries_values_and_characters_are_limited(text, message):
    with pytest.raises(YamlLimitError, match=re.escape(message)):
        load_yaml(text)


def test_exactly_at_the_entry_and_character_limits_still_loads():
    assert len(load_yaml(_flat(MAX_ITEMS))) == MAX_ITEMS
    assert len(load_yaml("s: &s " + "x" * (MAX_CHARS // 2 - 10) + "\nt: [*s]\n")["t"][0]) == MAX_CHARS // 2 - 10


def _prompts(items: str) -> str:
    return f"prompts:\n  class_path: prompt-list\n  init_args:\n    prompts: {items}\n"


# Alias bombs scaled to the size limits rather than to the count of aliases. Before the limits on entries and
# characters, on a loaded 2-core machine: 2000 prompts took 15 s to check (jsonargparse copies a list once per
# entry, on each of its ~15 passes), so 5000 aliases of one prompt ran for minutes; 90 000 aliases of a 500 kB
# string ran for minutes and grew to 20 GB.
SCALED_BOMBS = {
    "prompt_aliases": ("p: &p a red apple\n" + _prompts(_flat(5000, "*p")), f"a list with more than {MAX_ITEMS}"),
    "long_string": ("s: &s " + "x" * 600_000 + "\n" + _prompts("[*s, *s]"), f"more than {MAX_CHARS} characters"),
    "lists_of_long_strings": (
        "s: &s " + "x" * 4000 + "\nl: &l " + _flat(100, "*s") + "\n" + _prompts(_flat(100, "*l")),
        f"aliases expand to more than {MAX_CHARS} characters of text (line 6)",
    ),
    "under_the_old_value_limit": (  # ~75 000 values (x4 holds 9**5 strings): under the 100 000 the limit used to be
        "eval:\n  sets:\n" + "".join(f"    x{i}: &a{i} {_flat(9, f'*a{i - 1}' if i else 'lol')}\n" for i in range(5)),
        f"aliases expand to more than {MAX_NODES} values",
    ),
}


@pytest.mark.parametrize("name", sorted(SCALED_BOMBS))
def test_scaled_alias_bombs_in_a_train_recipe_are_refused_quickly(name, capsys, tmp_path):
    """Refused by ``train`` well within the suite's bound (measured: under 0.5 s each in this test process on a loaded
    2-core machine), before anything is written or any model loads."""
    text, message = SCALED_BOMBS[name]
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(text)
    assert message in _refused(capsys, recipe, tmp_path / "run", command="train")
