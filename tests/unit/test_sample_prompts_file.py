"""``rlpost sample --prompts-file``: the file is read with limits before the run is opened, so a bad file (missing, a
directory, not UTF-8, too large, blank) is a one-line error naming it, exit status 2, whatever ``--run`` says."""

from __future__ import annotations

from pathlib import Path

import pytest

import rlpost.apps.sample
from rlpost.apps import cli
from rlpost.core.user_files import MAX_PROMPTS_FILE_BYTES


@pytest.fixture
def opened(monkeypatch):
    """Stands in for the run (the prompts file is read first): records what ``sample_run`` was given."""
    calls: list[dict] = []

    def sample_run(run_dir, host, prompts, out, *args):
        calls.append({"run": run_dir, "prompts": list(prompts)})
        return []

    monkeypatch.setattr(rlpost.apps.sample, "sample_run", sample_run)
    return calls


def _prompts_file(tmp_path: Path, case: str) -> Path:
    path = tmp_path / f"{case}.txt"
    if case == "latin1":
        path.write_bytes("a red apple\nun caf\xe9\n".encode("latin-1"))
    elif case == "directory":
        path.mkdir()
    elif case == "too_large":
        path.write_bytes(b"a red apple\n" * (MAX_PROMPTS_FILE_BYTES // 12 + 1))
    elif case == "blank":
        path.write_text("\n   \n\t\n")
    elif case == "empty":
        path.write_text("")
    return path


CASES = {
    "missing": "--prompts-file: prompts file not found: {path}",
    "directory": "--prompts-file: {path}: a directory, not a prompts file",
    "latin1": "--prompts-file: {path}:2: not UTF-8 text (invalid continuation byte at byte 18)",
    "too_large": f"--prompts-file: {{path}}: larger than {MAX_PROMPTS_FILE_BYTES} bytes, the limit for a prompts file",
    "blank": "--prompts-file: {path}: empty (no non-blank line), a prompts file needs at least one",
    "empty": "--prompts-file: {path}: empty (no non-blank line), a prompts file needs at least one",
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("run", ["nonexistent", "existing"])
def test_a_bad_prompts_file_is_one_line_naming_it_before_the_run_is_opened(case, run, opened, capsys, tmp_path):
    """With a run directory that does not exist, the prompts file is still the problem reported: it is checked first
    (nothing is loaded for it), the run second."""
    path = _prompts_file(tmp_path, case)
    run_dir = tmp_path / "run"
    if run == "existing":
        run_dir.mkdir()
    out = tmp_path / "out"
    argv = ["sample", "--run", str(run_dir), "--prompts-file", str(path), "--out", str(out), "--prompt", "extra"]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"rlpost sample: {CASES[case].format(path=path)}\n"
    assert captured.out == "" and opened == [] and not out.exists()


def test_prompts_file_lines_are_stripped_and_blank_lines_skipped_and_a_bom_dropped(opened, capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\ufeffa red apple\n\n   a blue car  \r\n\tun café\n")
    out = tmp_path / "out"
    argv = [
        "sample",
        "--run",
        str(tmp_path / "run"),
        "--prompt",
        "first",
        "--prompts-file",
        str(path),
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert opened == [{"run": tmp_path / "run", "prompts": ["first", "a red apple", "a blue car", "un café"]}]
