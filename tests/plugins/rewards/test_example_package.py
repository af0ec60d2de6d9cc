"""The documented third-party example package: entry point declared, reward under 30 lines, its own test passes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import tomllib
import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "rlpost-reward-example"


def test_example_package_layout_and_reward(monkeypatch) -> None:
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["rlpost"] == {"example": "rlpost_reward_example"}
    source = (EXAMPLE / "rlpost_reward_example" / "__init__.py").read_text()
    assert len(source.splitlines()) < 30
    monkeypatch.syspath_prepend(str(EXAMPLE))
    sys.modules.pop("rlpost_reward_example", None)
    module = importlib.import_module("rlpost_reward_example")
    found: list[type] = []
    module.rlpost_register_reward_sources(found.append)
    images = torch.full((2, 8, 8, 3), 51, dtype=torch.uint8)
    assert found[0].name == "brightness"
    torch.testing.assert_close(found[0]().score(images, ["x", "y"], [{}, {}]), torch.tensor([0.2, 0.2]))
