"""Docs and comments cite only what a reader of this repository can open (issue #11, item 6).

A citation must point at a paper (arXiv id with section or equation), an upstream repository (path at a commit) or a
file in this repository. Notes kept outside the repository (the names in ``NOTE_NAMES`` below, and anything under
the shared reference folder) cannot be opened by a reader, so citing them is an error. This test scans the source,
docs, tests, recipes, benchmarks and configuration for such citations and lists every ``file:line`` that has one.
``tests/meta`` is not scanned: it names the forbidden files on purpose.

A path inside this repository is not a hit: ``docs/algorithms/ddpo.md`` ends in ``ddpo.md``, and a name preceded
by ``/`` (``docs/style.md`` if it ever exists) is a repository path, not a bare note name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Directories scanned recursively, and single files, relative to the repository root.
SCANNED_DIRS = ("rlpost", "plugins", "docs", "tests", "recipes", "benchmarks", "constraints", ".ci")
SCANNED_FILES = ("README.md", "pyproject.toml", "tox.ini")
EXCLUDED_DIRS = (Path("tests") / "meta",)
SKIPPED_PARTS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}

# Assembled from parts so that this file does not itself read as a citation to a plain text search.
NOTE_NAMES = ("algorithms", "feasibility", "style", "ecosystem", "peers")
PRIVATE_NOTE = re.compile(
    r"(^|[^/a-z_])(" + "|".join(NOTE_NAMES) + r")\.md" + "|shared/" + "reference|treegrpo-paper-" + "summary"
)


def _scanned_paths() -> list[Path]:
    paths = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for name in SCANNED_DIRS:
        base = ROOT / name
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(ROOT)
            if not path.is_file() or SKIPPED_PARTS.intersection(rel.parts):
                continue
            if any(rel.is_relative_to(excluded) for excluded in EXCLUDED_DIRS):
                continue
            paths.append(path)
    return paths


def _hits(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), start=1) if PRIVATE_NOTE.search(line)]


def test_pattern_catches_private_notes_and_spares_repository_paths() -> None:
    md, ref = ".md", "shared/" + "reference"  # built from parts, as PRIVATE_NOTE is
    cited = [
        f"(algorithms{md} §2.3)",
        f"see feasibility{md} section 6",
        f"style{md} 7.1 proposed",
        f"ecosystem{md} 3.4",
        f"peers{md} §1",
        f"`../{ref}/style{md}`",
        "treegrpo-paper-" + "summary.txt",
    ]
    for line in cited:
        assert PRIVATE_NOTE.search(line), line
    for line in ("docs/algorithms/treegrpo.md", "`docs/design.md`", "docs/style.md", "my_algorithms.md"):
        assert not PRIVATE_NOTE.search(line), line


def test_scan_covers_the_tree() -> None:
    for name in SCANNED_DIRS[:-1]:  # .ci may be absent from an sdist; the others are the project
        assert (ROOT / name).is_dir(), name
    scanned = {p.relative_to(ROOT).as_posix() for p in _scanned_paths()}
    musts = ("README.md", "pyproject.toml", "rlpost/engine/runner.py", "docs/design.md", "docs/algorithms/treegrpo.md")
    for must in musts:
        assert must in scanned, must
    assert not any(p.startswith("tests/meta/") for p in scanned)


def test_no_citation_of_files_outside_the_repository() -> None:
    found: list[str] = []
    for path in _scanned_paths():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary assets (images, safetensors) carry no citations
            continue
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{n}: {text.splitlines()[n - 1].strip()[:100]}" for n in _hits(text)]
    assert not found, (
        "cite a paper (arXiv id + section/equation), an upstream repository (path@commit) or a file in this "
        "repository instead of notes a reader cannot open:\n" + "\n".join(found)
    )
