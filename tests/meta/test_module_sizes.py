"""Modules stay small enough to read in one sitting: one idea per module (docs/design.md).

No module in ``rlpost/`` is over 450 lines, none in ``plugins/`` over 400 (a plugin holds one algorithm; its
modules are smaller still). A module over the limit is split by responsibility, not trimmed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMITS = {"rlpost": 450, "plugins": 400}


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _over(top: Path, limit: int, base: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(base)}: {n} lines" for p in sorted(top.rglob("*.py")) if (n := _lines(p)) > limit]


@pytest.mark.parametrize("top", sorted(LIMITS))
def test_no_module_over_the_limit(top: str) -> None:
    modules = sorted((ROOT / top).rglob("*.py"))
    assert len(modules) > 10, f"no modules found under {top}/"  # an empty glob would pass vacuously
    over = _over(ROOT / top, LIMITS[top])
    assert not over, f"modules in {top}/ over {LIMITS[top]} lines (split them by responsibility):\n" + "\n".join(over)


def test_the_check_sees_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "short.py").write_text("x = 1\n" * 5)
    (tmp_path / "long.py").write_text("x = 1\n" * 6)
    assert _over(tmp_path, 5, base=tmp_path) == ["long.py: 6 lines"]
