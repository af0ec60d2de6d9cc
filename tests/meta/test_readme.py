"""The README's commands stay true: .ci/run runs exactly the README's set-up and test commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _block_after(heading: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {heading}", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"README section {heading!r} has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_setup_is_two_commands_and_ci_runs_them():
    setup = _block_after("Set up (fresh machine, CPU)")
    assert len(setup) == 2
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in setup:
        assert command in ci


def test_ci_runs_exactly_the_readme_test_command():
    (test_command,) = _block_after("Test")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci


def test_main_job_recipe_exists():
    (command,) = _block_after("Run")
    recipe = command.split("--recipe", 1)[1].split()[0]
    assert (ROOT / recipe).is_file()
