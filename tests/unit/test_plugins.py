"""Plugin loading: first-party plugins through entry points, a real external package installed from
tests/fixtures/plugins, a broken plugin, allow/block lists, duplicate names and tracing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.plugins import PluginHost

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plugins"
FIRST_PARTY = {"rewards", "treegrpo", "dancegrpo", "mixgrpo", "ddpo"}


def _pip_install(package: str | Path, target: Path, workdir: Path) -> None:
    """pip-install a fixture package (a name under tests/fixtures/plugins, or a path) into ``target``."""
    source = Path(package) if isinstance(package, Path) else FIXTURES / package
    src = workdir / source.name
    shutil.copytree(source, src)  # building writes into the source tree; keep the fixture clean
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory with rlpost-plugin-ok and rlpost-plugin-broken installed by pip (real dist-info, entry points)."""
    target = tmp_path_factory.mktemp("site")
    work = tmp_path_factory.mktemp("build")
    _pip_install("rlpost-plugin-ok", target, work)
    _pip_install("rlpost-plugin-broken", target, work)
    return target


@pytest.fixture(scope="module")
def dupe_site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("dupe-site")
    _pip_install("rlpost-plugin-dupe", target, tmp_path_factory.mktemp("build-dupe"))
    return target


@pytest.fixture
def third_party(monkeypatch, site):
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("RLPOST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("RLPOST_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("RLPOST_BLOCK_PLUGINS", raising=False)
    for mod in ("rlpost_plugin_ok", "rlpost_plugin_broken", "rlpost_plugin_dupe"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return site


def _by_name(host: PluginHost) -> dict:
    return {info.name: info for info in host.plugins(include_builtin=True)}


def test_first_party_plugins_load_through_entry_points():
    infos = _by_name(PluginHost())
    assert FIRST_PARTY <= set(infos)
    for name in FIRST_PARTY:
        assert infos[name].distribution == "rlpost"
        assert infos[name].status == "ok", f"{name}: {infos[name].error}"
        assert infos[name].components, f"{name} registered no component"


def test_tests_never_autoload_third_party_plugins(monkeypatch, site):
    monkeypatch.syspath_prepend(str(site))
    assert os.environ["RLPOST_DISABLE_PLUGIN_AUTOLOAD"] == "1"  # set by tests/conftest.py
    infos = _by_name(PluginHost())
    assert infos["ok"].status == "disabled"
    assert "greenness" not in PluginHost().registry("reward")


def test_installed_external_plugin_registers_its_reward(third_party):
    host = PluginHost()
    info = _by_name(host)["ok"]
    assert (info.status, info.distribution, info.version) == ("ok", "rlpost-plugin-ok", "1.2.3")
    assert info.components == ["reward:greenness"]
    assert info.hooks == ["rlpost_register_reward_sources"]
    entry = host.registry("reward").get("greenness")
    assert entry.distribution == "rlpost-plugin-ok"


def test_broken_plugin_is_reported_and_skipped(third_party):
    infos = _by_name(PluginHost())
    broken = infos["broken"]
    assert broken.status == "error"
    assert broken.error == "RuntimeError: this plugin is broken on purpose"
    assert broken.distribution == "rlpost-plugin-broken"
    assert infos["ok"].status == "ok"


def test_allowlist_empty_means_no_third_party(third_party, monkeypatch):
    monkeypatch.setenv("RLPOST_LOAD_PLUGINS", "")
    infos = _by_name(PluginHost())
    assert infos["ok"].status == "not-allowed" and infos["broken"].status == "not-allowed"
    assert infos["treegrpo"].status == "ok"  # first-party plugins are not third-party


def test_allowlist_by_plugin_or_distribution(third_party, monkeypatch):
    monkeypatch.setenv("RLPOST_LOAD_PLUGINS", "rlpost-plugin-ok")
    infos = _by_name(PluginHost())
    assert infos["ok"].status == "ok" and infos["broken"].status == "not-allowed"


def test_blocklist(third_party, monkeypatch):
    monkeypatch.setenv("RLPOST_BLOCK_PLUGINS", "ok,broken,ddpo")
    infos = _by_name(PluginHost())
    assert {infos[n].status for n in ("ok", "broken", "ddpo")} == {"blocked"}
    assert "greenness" not in PluginHost().registry("reward")


def test_duplicate_component_name_names_both_distributions(third_party, dupe_site, monkeypatch):
    monkeypatch.syspath_prepend(str(dupe_site))
    host = PluginHost()
    infos = _by_name(host)
    statuses = sorted([infos["ok"].status, infos["dupe"].status])
    assert statuses == ["error", "ok"]
    failed = infos["ok"] if infos["ok"].status == "error" else infos["dupe"]
    assert "rlpost-plugin-ok" in failed.error and "rlpost-plugin-dupe" in failed.error
    assert "'greenness' is registered twice" in failed.error


def _cli(args: list[str], site: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RLPOST_")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(site), full_env.get("PYTHONPATH", "")])
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "rlpost.cli", *args], env=full_env, capture_output=True, text=True, timeout=120
    )


def test_cli_plugins_list_json_keeps_working_with_a_broken_plugin(site):
    proc = _cli(["plugins", "list", "--json"], site)
    assert proc.returncode == 0, proc.stderr
    infos = {p["name"]: p for p in json.loads(proc.stdout)}
    assert FIRST_PARTY | {"ok", "broken"} <= set(infos)
    assert all(not p["builtin"] for p in infos.values())  # built-ins only with --all
    assert infos["broken"]["status"] == "error" and "broken on purpose" in infos["broken"]["error"]
    assert infos["ok"]["components"] == ["reward:greenness"]
    for key in ("name", "distribution", "version", "status", "error", "hooks", "components"):
        assert key in infos["ok"]


def test_cli_plugins_list_all_includes_builtins(site):
    proc = _cli(["plugins", "list", "--json", "--all"], site)
    names = {p["name"] for p in json.loads(proc.stdout)}
    assert {"rlpost.builtin", "rlpost.prompts", "rlpost.models.sd3"} <= names


def test_cli_plugins_list_table(site):
    proc = _cli(["plugins", "list"], site, COLUMNS="200")
    assert proc.returncode == 0 and "greenness" in proc.stdout and "broken on purpose" in proc.stdout


def test_trace_plugins(site):
    proc = _cli(["plugins", "list", "--json"], site, RLPOST_TRACE_PLUGINS="1")
    assert proc.returncode == 0
    assert "[rlpost trace] rlpost_register_reward_sources -> ok" in proc.stderr


def test_installing_the_documented_example_makes_its_reward_usable_by_name(tmp_path, monkeypatch):
    """docs/examples/rlpost-reward-example installed with pip, then used from a recipe as ``brightness``."""
    from rlpost.recipe import validate
    from rlpost.runner import Runner
    from tests import toy_components
    from tests.toy_components import toy_recipe

    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "rlpost-reward-example"
    target = tmp_path / "site"
    _pip_install(example, target, tmp_path)
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.setenv("RLPOST_LOAD_PLUGINS", "rlpost-reward-example")
    monkeypatch.delitem(sys.modules, "rlpost_reward_example", raising=False)
    host = PluginHost(extra_plugins=(toy_components,))
    assert host.registry("reward").get("brightness").distribution == "rlpost-reward-example"
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=1)
    cfg["rewards"] = ["brightness"]
    history = Runner(validate(cfg, host), host).run()
    assert 0.0 <= history[0]["reward/brightness"] <= 1.0
