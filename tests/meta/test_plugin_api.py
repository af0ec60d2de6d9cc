"""The declared plugin API: every name the ``rlpost`` facade exports resolves and is documented (with its stability)
in docs/writing_plugins.md, and the document lists no name the facade does not export."""

from __future__ import annotations

import re
from pathlib import Path

import rlpost

DOC = Path(__file__).resolve().parents[2] / "docs" / "writing_plugins.md"


def _table_names() -> set[str]:
    """Backticked names in the first column of the plugin-API table rows (``| `a`, `b` | what | stability |``)."""
    names: set[str] = set()
    for line in DOC.read_text().splitlines():
        cells = line.split("|")
        if len(cells) >= 4 and cells[-2].strip() in ("stable", "provisional", "experimental"):
            names |= set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[1]))
    return names


def test_every_export_resolves() -> None:
    missing = [name for name in rlpost.__all__ if not hasattr(rlpost, name)]
    assert not missing, f"rlpost.__all__ names that do not resolve: {missing}"


def test_every_export_is_documented_and_nothing_else() -> None:
    exported = set(rlpost.__all__) - {"__version__"}
    documented = _table_names()
    assert exported - documented == set(), (
        f"exported but not in docs/writing_plugins.md: {sorted(exported - documented)}"
    )
    assert documented - exported == set(), f"documented but not exported: {sorted(documented - exported)}"
