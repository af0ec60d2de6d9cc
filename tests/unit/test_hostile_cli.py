"""The hostile-input collection over every entry point: ``validate``, ``train``, ``bench``, ``sample``, ``export``,
``plugins`` and ``recipes``, each run in-process through :func:`rlpost.apps.cli.main` on a bad input.

Every case must end the same way: exit status 2, a message on stderr that names the problem (the field, file or
option), bounded in length, and no Python traceback (an exception escaping ``main`` fails the case outright). The
families' own tests check the details (docs/robustness.md lists them); this file is the one place that holds every
command to the contract, so a new command or a new refusal adds a case here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlpost.apps import cli
from rlpost.apps.host import reset_host
from rlpost.engine.recipe import MAX_PROBLEM_CHARS

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny"


@dataclass(frozen=True)
class Case:
    """One hostile input: ``argv(tmp, run)`` builds the command line (``run`` is a trained tiny run directory)."""

    name: str
    argv: Callable[[Path, Path], list[str]]
    says: str  # a fragment the message must contain (compared with whitespace collapsed)


def _overlay(tmp: Path, text: str, name: str = "overlay.yaml") -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def _tiny(recipe: str, tmp: Path, *extra: str) -> list[str]:
    return ["--recipe", str(TINY / recipe), "--run.output_dir", str(tmp / "out"), *extra]


def _a_file(tmp: Path) -> Path:
    path = tmp / "a_file"
    path.write_text("not a directory\n")
    return path


def _latin1(tmp: Path, text: str, name: str) -> str:
    path = tmp / name
    path.write_bytes(text.encode("latin-1"))
    return str(path)


def _resume_with_corrupt_state(tmp: Path, run: Path) -> list[str]:
    copy = tmp / "copy"
    shutil.copytree(run, copy)
    checkpoint = copy / "checkpoints" / "step_000001"
    text = "not json {"
    (checkpoint / "state.json").write_text(text)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.json"] = hashlib.sha256(text.encode()).hexdigest()  # the integrity check passes
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    # one more step than the run has: a finished run resumed as it was has nothing to do (exit 5, state unread)
    args = ["--run.output_dir", str(copy), "--run.max_steps", "2", "--resume", "latest"]
    return ["train", "--recipe", str(copy / "recipe.yaml"), *args]


def _export_into_checkpoint(tmp: Path, run: Path) -> list[str]:
    return ["export", "--run", str(run), "--out", str(run / "checkpoints" / "step_000001" / "lora")]


def _export_over_a_readme(tmp: Path, run: Path) -> list[str]:
    (tmp / "exported").mkdir()
    (tmp / "exported" / "README.md").write_text("my notes\n")
    return ["export", "--run", str(run), "--out", str(tmp / "exported")]


def _run_without_recipe(tmp: Path, run: Path) -> list[str]:
    copy = tmp / "copy"
    shutil.copytree(run, copy)
    (copy / "recipe.yaml").unlink()
    return ["sample", "--run", str(copy), "--prompt", "a cat", "--out", str(tmp / "samples")]


CASES = [
    # validate / train: recipes
    Case(
        "validate-unknown-component",
        lambda t, r: ["validate", *_tiny("ddpo.yaml", t, "--sampler", "nope")],
        "sampler.class_path: unknown sampler 'nope'",
    ),
    Case(
        "validate-ratio-nan",
        lambda t, r: ["validate", *_tiny("treegrpo.yaml", t, "--sampler.init_args.ratio", ".nan")],
        "sampler.init_args.ratio",
    ),
    Case(
        "train-section-a-scalar",
        lambda t, r: ["train", *_tiny("treegrpo.yaml", t, "--recipe", _overlay(t, "run: 5\n"))],
        "run:",
    ),
    Case(
        "train-resolution-off-the-grid",
        lambda t, r: ["train", *_tiny("treegrpo.yaml", t, "--model.init_args.resolution", "30")],
        "model.init_args.resolution",
    ),
    Case(
        "train-output-dir-under-a-file",
        lambda t, r: ["train", "--recipe", str(TINY / "ddpo.yaml"), "--run.output_dir", str(_a_file(t) / "run")],
        "a_file",
    ),
    # bench
    Case("bench-missing-recipe", lambda t, r: ["bench", "--recipe", str(t / "nowhere.yaml")], "nowhere.yaml"),
    Case("bench-section-a-scalar", lambda t, r: ["bench", "--recipe", _overlay(t, "bench: 5\n")], "bench"),
    Case(
        "bench-latin-1",
        lambda t, r: ["bench", "--recipe", _latin1(t, "# caf\u00e9\nbench: {}\n", "b.yaml")],
        "not UTF-8",
    ),
    Case(
        "bench-alias-bomb",
        lambda t, r: [
            "bench",
            "--recipe",
            _overlay(
                t,
                "a: &a [x, x, x, x, x, x, x, x, x]\n"
                + "".join(
                    f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                    for p, c in zip("abcdefgh", "bcdefghi", strict=True)
                ),
            ),
        ],
        "aliases expand",
    ),
    # sample
    Case(
        "sample-prompts-file-latin-1",
        lambda t, r: [
            "sample",
            "--run",
            str(r),
            "--prompts-file",
            _latin1(t, "caf\u00e9\n", "p.txt"),
            "--out",
            str(t / "s"),
        ],
        "not UTF-8",
    ),
    Case(
        "sample-prompts-file-a-directory",
        lambda t, r: ["sample", "--run", str(r), "--prompts-file", str(t), "--out", str(t / "s")],
        "--prompts-file",
    ),
    Case(
        "sample-missing-run",
        lambda t, r: ["sample", "--run", str(t / "nowhere"), "--prompt", "a cat", "--out", str(t / "s")],
        "nowhere",
    ),
    Case("sample-run-without-recipe", _run_without_recipe, "recipe.yaml"),
    Case("sample-no-prompt", lambda t, r: ["sample", "--run", str(r), "--out", str(t / "s")], "--prompt"),
    Case("train-resume-corrupt-state", _resume_with_corrupt_state, "state.json: not valid JSON"),
    # export
    Case("export-missing-run", lambda t, r: ["export", "--run", str(t / "nowhere"), "--out", str(t / "e")], "nowhere"),
    Case("export-into-the-checkpoint", _export_into_checkpoint, "checkpoint"),
    Case("export-over-a-users-readme", _export_over_a_readme, "README.md"),
    # plugins / recipes / top level
    Case("plugins-unknown-action", lambda t, r: ["plugins", "frobnicate"], "invalid choice"),
    Case(
        "recipes-copy-unknown", lambda t, r: ["recipes", "copy", "no/such_recipe", str(t / "x.yaml")], "no/such_recipe"
    ),
    Case("unknown-command", lambda t, r: ["trian"], "unknown command 'trian'"),
    Case("download-missing-recipe", lambda t, r: ["download", "--dry-run", "--recipe", str(t / "no.yaml")], "no.yaml"),
    Case(
        "download-bad-recipe",
        lambda t, r: ["download", "--dry-run", *_tiny("treegrpo.yaml", t, "--sampler.k", "1")],
        "sampler.init_args.k",
    ),
]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step of the tiny DDPO recipe, checkpointed: the run directory ``sample`` and ``export`` are pointed at."""
    out = tmp_path_factory.mktemp("hostile") / "run"
    reset_host(None)
    assert (
        cli.main(["train", "--recipe", str(TINY / "ddpo.yaml"), "--run.max_steps", "1", "--run.output_dir", str(out)])
        == 0
    )
    assert (out / "checkpoints" / "step_000001").is_dir()
    return out


@pytest.fixture(autouse=True)
def fresh_host():
    reset_host(None)
    yield
    reset_host(None)


def _main(argv: list[str]) -> int:
    """``cli.main`` as the console script ends: argparse's usage errors exit through ``SystemExit``."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_entry_point_refuses_a_bad_input_with_exit_2_and_no_traceback(
    case: Case, tmp_path: Path, trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(p.relative_to(trained_run) for p in trained_run.rglob("*"))
    code = _main(case.argv(tmp_path, trained_run))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    assert 0 < len(err) < 4 * MAX_PROBLEM_CHARS, len(err)
    assert case.says in " ".join(err.split()), err[-2000:]
    assert sorted(p.relative_to(trained_run) for p in trained_run.rglob("*")) == before, "the run was changed"
    assert not (tmp_path / "out").exists(), "a refused recipe must write nothing"


def test_the_collection_covers_every_command(tmp_path: Path, trained_run: Path) -> None:
    commands = set()
    for case in CASES:
        (tmp_path / case.name).mkdir()
        commands.add(case.argv(tmp_path / case.name, trained_run)[0])
    missing = set(cli.COMMANDS) - commands
    assert not missing, f"no hostile-input case for: {sorted(missing)}"
