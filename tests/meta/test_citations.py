"""Docs and comments cite only what a reader of this repository can open.

A citation must point at a paper (arXiv id with section or equation), an upstream repository (path at a commit) or a
file in this repository. Notes kept outside the repository (the names in ``NOTE_NAMES`` below, and anything under
the shared reference folder) cannot be opened by a reader, so citing them is an error. This test scans the source,
docs, tests, recipes, benchmarks and configuration for such citations and lists every ``file:line`` that has one.
``tests/meta`` is not scanned for those: it names the forbidden files on purpose.

A path inside this repository is not a hit: ``docs/algorithms/ddpo.md`` ends in ``ddpo.md``, and a name preceded
by ``/`` (``docs/style.md`` if it ever exists) is a repository path, not a bare note name.

Numbered issues and pull requests are the same problem: a bare number names an entry of this project's own tracker,
which a reader of the repository cannot open, and "DanceGRPO" followed by a number leaves the reader to guess which
repository on GitHub is meant. A numbered reference (after "issue", "issues", "PR", "pull request", inside
parentheses, or after a known upstream project's name, and the further numbers of a list such as "#N and #M") must
therefore follow an ``owner/repo`` name: ``XueZeyue/DanceGRPO`` then the word and the number. This check scans
``tests/meta`` too.
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


# A numbered reference: "#N" after one of the words of WORD_BEFORE ("issue", "PR", "see", "fixes", ...), after "(",
# or after a known upstream project's name. Further numbers of a list ("#N and #M", "#N/#M") take the kind of
# the first. The upstream names are the projects the docs compare against or build on; owner/repo before them
# (``XueZeyue/DanceGRPO``) makes the reference openable.
UPSTREAM_NAMES = (
    "DanceGRPO", "Flow-GRPO", "flow_grpo", "MixGRPO", "TreeGRPO", "DDPO", "ddpo-pytorch", "Flow-Factory", "trl",
    "diffusers", "transformers", "peft", "accelerate", "deepspeed", "pytorch", "torch", "pluggy", "jsonargparse",
    "huggingface_hub", "safetensors",
)  # fmt: skip
NUMBER = re.compile(r"#(\d+)\b")
LIST_BEFORE = re.compile(r"(?:#\d+\s*(?:,|/|&|\band\b|\bor\b)\s*)+$")
WORD_BEFORE = re.compile(
    r"\b(?:issues?|PRs?|pull[ -]requests?|pulls?|see|cf\.|fix(?:es|ed)?|close[sd]?|resolve[sd]?)\s+$", re.IGNORECASE
)
PAREN_BEFORE = re.compile(r"\(\s*$")
UPSTREAM_BEFORE = re.compile(r"(?<![\w-])(?:" + "|".join(map(re.escape, UPSTREAM_NAMES)) + r")\s+$")
# owner/repo at the end of the text before the reference, optionally closed by ")" (``Flow-Factory
# (X-GenGroup/Flow-Factory) issue #N``). A path of this repository (``docs/speed.md``) or of more than two parts is
# not a repository name.
LOCAL_TOP = ("rlpost", "plugins", "docs", "tests", "recipes", "benchmarks", "constraints")
OWNER_REPO_BEFORE = re.compile(
    r"(?<![\w./-])(?!(?:" + "|".join(LOCAL_TOP) + r")/)[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*\)?[\s,]*$"
)


def _scanned_paths(excluded_dirs: tuple[Path, ...] = EXCLUDED_DIRS) -> list[Path]:
    paths = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for name in SCANNED_DIRS:
        base = ROOT / name
        for path in sorted(base.rglob("*")):
            rel = path.relative_to(ROOT)
            if not path.is_file() or SKIPPED_PARTS.intersection(rel.parts):
                continue
            if any(rel.is_relative_to(excluded) for excluded in excluded_dirs):
                continue
            paths.append(path)
    return paths


def _unowned_numbers(line: str) -> list[str]:
    """The numbered issue or pull-request references of ``line`` that no ``owner/repo`` name precedes."""
    found = []
    for match in NUMBER.finditer(line):
        before = line[: match.start()]
        listed = LIST_BEFORE.search(before)
        if listed:
            before = before[: listed.start()]
        if word := WORD_BEFORE.search(before):
            before = before[: word.start()]
        elif paren := PAREN_BEFORE.search(before):
            before = before[: paren.start()]
        elif not UPSTREAM_BEFORE.search(before):
            continue  # not a reference ("Zebra #7", a colour, an HTML entity)
        if not OWNER_REPO_BEFORE.search(before):
            found.append(match.group(0))
    return found


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


def test_number_pattern_catches_bare_issue_numbers_and_spares_owner_repo() -> None:
    h = "#"  # the examples are built from parts so that this file does not itself read as a citation
    bare = [
        f"Beyond the paper (issue {h}15): cheap tails",
        f"## Speed-ups (`run.accelerate`, issue {h}24)",
        f"(issue {h}24 item 3)",
        f"as the issues {h}13 and {h}19 say",
        f"DanceGRPO {h}13/{h}19",
        f"a regression (see {h}12)",
        f"fixed in PR {h}2676",
        f"upstream: DanceGRPO issue {h}87",
        f"trl {h}4841",
        f"docs/speed.md issue {h}3",
        f"a/b/c issue {h}3",
    ]
    for line in bare:
        assert _unowned_numbers(line), line
    owned = [
        f"(XueZeyue/DanceGRPO issue {h}87)",
        f"XueZeyue/DanceGRPO issues {h}13 and {h}19, huggingface/trl PR {h}2676",
        f"XueZeyue/DanceGRPO {h}87",
        f"update (Flow-Factory (X-GenGroup/Flow-Factory) issue {h}24)",
        f"huggingface/trl ({h}4841)",
        f'text = "Zebra {h}7 naïve"',
        f"color: {h}336699",
        f"step {h}3 of the run",
    ]
    for line in owned:
        assert not _unowned_numbers(line), line


def test_no_issue_number_without_its_repository() -> None:
    found: list[str] = []
    for path in _scanned_paths(excluded_dirs=()):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(text.splitlines(), start=1):
            if refs := _unowned_numbers(line):
                found.append(f"{rel}:{n}: {', '.join(refs)}: {line.strip()[:100]}")
    assert not found, (
        "a numbered issue or pull request must name its repository (owner/repo issue N); this project's own tracker "
        "cannot be opened by a reader: cite a doc section, a file of this repository or a paper instead:\n"
        + "\n".join(found)
    )
