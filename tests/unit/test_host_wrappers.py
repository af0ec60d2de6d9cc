"""The engine calls lifecycle hooks only through the plugin host's typed wrappers (tox's plugin-manager model)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from rlpost.apps.host import build_host
from rlpost.core import hookspecs
from rlpost.core.context import RunContext
from rlpost.core.hookspecs import hookimpl
from rlpost.core.plugin_errors import PluginRuntimeError
from rlpost.core.plugins import REGISTRATION_HOOKS, PluginHost

ROOT = Path(__file__).resolve().parents[2]
LIFECYCLE = sorted(n for n in hookspecs.__all__ if n.startswith("rlpost_") and n not in REGISTRATION_HOOKS)


def test_every_lifecycle_hook_has_a_typed_wrapper() -> None:
    assert "rlpost_after_step" in LIFECYCLE and "rlpost_save_state" in LIFECYCLE
    for hook in LIFECYCLE:
        wrapper = getattr(PluginHost, hook.removeprefix("rlpost_"), None)
        assert callable(wrapper), f"PluginHost has no wrapper for {hook}"
        spec = [p for p in inspect.signature(getattr(hookspecs, hook)).parameters]
        mine = [p for p in inspect.signature(wrapper).parameters if p != "self"]
        expected = [p for p in spec if not (hook == "rlpost_save_state" and p == "state")]
        assert mine == expected, f"{hook}: wrapper takes {mine}, spec {spec}"


def test_engine_and_apps_call_no_hook_by_name() -> None:
    pattern = re.compile(r"\.hook\.rlpost_|call_hook\(|collect_state\(")
    offenders = []
    for package in ("engine", "apps", "components", "ops", "models"):
        for path in sorted((ROOT / "rlpost" / package).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "call lifecycle hooks through PluginHost's wrappers:\n" + "\n".join(offenders)


def test_wrapper_names_the_failing_plugin(tmp_path: Path) -> None:
    class Boom:
        @hookimpl
        def rlpost_after_step(self, run: RunContext, metrics: dict[str, float]) -> None:
            raise ValueError("nope")

    host = build_host(load_entrypoints=False)
    host.register_plugin(Boom(), name="boom")
    ctx = RunContext(recipe=None, output_dir=tmp_path)  # type: ignore[arg-type]  # hooks here read no recipe
    with pytest.raises(PluginRuntimeError, match="hook rlpost_after_step of plugin 'boom'.*ValueError: nope"):
        host.after_step(ctx, {"x": 1.0})
    assert host.save_state(ctx) == {}
