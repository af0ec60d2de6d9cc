"""Plugin loading: first-party plugins through entry points, a real external package installed from
tests/fixtures/plugins, a broken plugin, allow/block lists, duplicate names, hostile plugins that try to take a
built-in's name (whatever the load order or hook ordering), and tracing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.apps.host import build_host
from rlpost.core.plugins import PluginHost
from rlpost.core.registry import ContestedComponentError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plugins"
FIRST_PARTY = {"rewards", "treegrpo", "dancegrpo", "mixgrpo", "ddpo", "digits", "qwenimage"}
HOSTILE_MODULES = (
    "rlpost_plugin_ok",
    "rlpost_plugin_broken",
    "rlpost_plugin_dupe",
    "rlpost_plugin_impostor",
    "rlpost_plugin_shadow",
    "rlpost_plugin_twin",
)


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
    for mod in HOSTILE_MODULES:
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return site


def _by_name(host: PluginHost) -> dict:
    return {info.name: info for info in host.plugins(include_builtin=True)}


def test_first_party_plugins_load_through_entry_points():
    infos = _by_name(build_host())
    assert FIRST_PARTY <= set(infos)
    for name in FIRST_PARTY:
        assert infos[name].distribution == "rlpost"
        assert infos[name].status == "ok", f"{name}: {infos[name].error}"
        assert infos[name].components, f"{name} registered no component"
    # A model family as a plugin (plugins/rlpost_qwenimage): exactly its adapter, credited to it.
    assert infos["qwenimage"].components == ["model:qwen-image"]


def test_tests_never_autoload_third_party_plugins(monkeypatch, site):
    monkeypatch.syspath_prepend(str(site))
    assert os.environ["RLPOST_DISABLE_PLUGIN_AUTOLOAD"] == "1"  # set by tests/conftest.py
    infos = _by_name(build_host())
    assert infos["ok"].status == "disabled"
    assert "greenness" not in build_host().registry("reward")


def test_installed_external_plugin_registers_its_reward(third_party):
    host = build_host()
    info = _by_name(host)["ok"]
    assert (info.status, info.distribution, info.version) == ("ok", "rlpost-plugin-ok", "1.2.3")
    assert info.components == ["reward:greenness"]
    assert info.hooks == ["rlpost_register_reward_sources"]
    entry = host.registry("reward").get("greenness")
    assert entry.distribution == "rlpost-plugin-ok"


def test_broken_plugin_is_reported_and_skipped(third_party):
    infos = _by_name(build_host())
    broken = infos["broken"]
    assert broken.status == "error"
    assert broken.error == "RuntimeError: this plugin is broken on purpose"
    assert broken.distribution == "rlpost-plugin-broken"
    assert infos["ok"].status == "ok"


def test_allowlist_empty_means_no_third_party(third_party, monkeypatch):
    monkeypatch.setenv("RLPOST_LOAD_PLUGINS", "")
    infos = _by_name(build_host())
    assert infos["ok"].status == "not-allowed" and infos["broken"].status == "not-allowed"
    assert infos["treegrpo"].status == "ok"  # first-party plugins are not third-party


def test_allowlist_by_plugin_or_distribution(third_party, monkeypatch):
    monkeypatch.setenv("RLPOST_LOAD_PLUGINS", "rlpost-plugin-ok")
    infos = _by_name(build_host())
    assert infos["ok"].status == "ok" and infos["broken"].status == "not-allowed"


def test_blocklist(third_party, monkeypatch):
    monkeypatch.setenv("RLPOST_BLOCK_PLUGINS", "ok,broken,ddpo")
    infos = _by_name(build_host())
    assert {infos[n].status for n in ("ok", "broken", "ddpo")} == {"blocked"}
    assert "greenness" not in build_host().registry("reward")


def test_duplicate_component_name_names_both_distributions(third_party, dupe_site, monkeypatch):
    monkeypatch.syspath_prepend(str(dupe_site))
    host = build_host()
    infos = _by_name(host)
    statuses = sorted([infos["ok"].status, infos["dupe"].status])
    assert statuses == ["error", "ok"]
    failed = infos["ok"] if infos["ok"].status == "error" else infos["dupe"]
    assert "rlpost-plugin-ok" in failed.error and "rlpost-plugin-dupe" in failed.error
    assert "'greenness' is registered twice" in failed.error


def test_duplicate_component_name_is_refused_in_a_recipe_until_qualified(third_party, dupe_site, monkeypatch):
    """Neither third-party 'greenness' is picked silently: the recipe must say which (or block one)."""
    monkeypatch.syspath_prepend(str(dupe_site))
    host = build_host()
    with pytest.raises(
        ContestedComponentError, match=r"'greenness' is contested.*rlpost-plugin-dupe.*rlpost-plugin-ok"
    ):
        host.registry("reward").get("greenness")
    assert host.registry("reward").get("rlpost-plugin-dupe:greenness").distribution == "rlpost-plugin-dupe"
    monkeypatch.setenv("RLPOST_BLOCK_PLUGINS", "rlpost-plugin-dupe")
    assert build_host().registry("reward").get("greenness").distribution == "rlpost-plugin-ok"


# ------------------------------------------------------------------------------------------- hostile plugins


@pytest.fixture(scope="module")
def hostile_site(tmp_path_factory) -> Path:
    """rlpost-plugin-impostor (claims 'jpeg-compressibility' with trylast) and rlpost-plugin-shadow (entry point
    named 'rewards', like the first-party one, with a tryfirst hook)."""
    target = tmp_path_factory.mktemp("hostile-site")
    work = tmp_path_factory.mktemp("build-hostile")
    _pip_install("rlpost-plugin-impostor", target, work)
    _pip_install("rlpost-plugin-shadow", target, work)
    return target


@pytest.fixture(scope="module")
def twin_site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("twin-site")
    _pip_install("rlpost-plugin-twin", target, tmp_path_factory.mktemp("build-twin"))
    return target


def _on_path(monkeypatch, site: Path, first: bool) -> None:
    """Put ``site`` first or last on sys.path: importlib.metadata lists distributions in sys.path order."""
    monkeypatch.setattr(sys, "path", [str(site), *sys.path] if first else [*sys.path, str(site)])


@pytest.mark.parametrize("hostile_first", [True, False], ids=["hostile-first-on-path", "hostile-last-on-path"])
def test_impostor_never_replaces_a_builtin_reward(third_party, hostile_site, monkeypatch, hostile_first):
    _on_path(monkeypatch, hostile_site, hostile_first)
    host = build_host()
    infos = _by_name(host)
    rewards = infos["rewards"]
    assert (rewards.status, rewards.distribution) == ("ok", "rlpost"), rewards.error
    assert "reward:jpeg-compressibility" in rewards.components
    impostor = infos["impostor"]
    assert impostor.status == "error"
    assert "'jpeg-compressibility' is registered twice" in impostor.error
    assert "distribution 'rlpost')" in impostor.error and "rlpost-plugin-impostor" in impostor.error
    # The refused plugin is inert: none of its components, none of its hooks.
    assert impostor.components == []
    assert "impostor-harmless" not in host.registry("reward")
    assert host.pm.get_plugin("impostor") is None
    assert all(i.plugin_name != "impostor" for i in host.hook.rlpost_after_step.get_hookimpls())
    entry = host.registry("reward").get("rlpost:jpeg-compressibility")
    assert (entry.distribution, entry.class_path) == ("rlpost", "rlpost_rewards.jpeg.JpegCompressibility")


@pytest.mark.parametrize("hostile_first", [True, False], ids=["hostile-first-on-path", "hostile-last-on-path"])
def test_entry_point_named_like_a_first_party_one_does_not_disable_it(
    third_party, hostile_site, monkeypatch, hostile_first
):
    _on_path(monkeypatch, hostile_site, hostile_first)
    host = build_host()
    infos = _by_name(host)
    assert infos["rewards"].status == "ok" and infos["rewards"].distribution == "rlpost"
    assert len(infos["rewards"].components) >= 8
    shadow = infos["rlpost-plugin-shadow:rewards"]
    assert shadow.status == "error"
    assert "'rewards'" in shadow.error and "'rlpost-plugin-shadow'" in shadow.error and "'rlpost'" in shadow.error
    assert "rlpost_plugin_shadow" not in sys.modules  # refused before import: its code never ran
    assert "shadow-reward" not in host.registry("reward")


def test_blocking_a_first_party_plugin_does_not_hand_its_name_over(third_party, hostile_site, monkeypatch):
    monkeypatch.syspath_prepend(str(hostile_site))
    monkeypatch.setenv("RLPOST_BLOCK_PLUGINS", "rlpost:rewards")  # plain "rewards" would block both
    host = build_host()
    infos = _by_name(host)
    assert infos["rewards"].status == "blocked"
    assert infos["rlpost-plugin-shadow:rewards"].status == "error"
    assert "shadow-reward" not in host.registry("reward")


@pytest.mark.parametrize("twin_first", [True, False], ids=["twin-first-on-path", "twin-last-on-path"])
def test_two_third_party_entry_points_with_one_name_are_both_refused(third_party, twin_site, monkeypatch, twin_first):
    _on_path(monkeypatch, twin_site, twin_first)
    host = build_host()
    infos = _by_name(host)
    assert "ok" not in infos
    for key in ("rlpost-plugin-ok:ok", "rlpost-plugin-twin:ok"):
        assert infos[key].status == "error"
        assert "'rlpost-plugin-ok' and 'rlpost-plugin-twin'" in infos[key].error
    assert "greenness" not in host.registry("reward") and "twin-reward" not in host.registry("reward")
    # Blocking one (by qualified name) lets the other load under its plain name.
    monkeypatch.setenv("RLPOST_BLOCK_PLUGINS", "rlpost-plugin-twin:ok")
    infos = _by_name(build_host())
    assert infos["ok"].status == "ok" and infos["ok"].distribution == "rlpost-plugin-ok"


def test_recipe_naming_a_contested_reward_is_refused_before_anything_loads(
    third_party, hostile_site, tmp_path, monkeypatch
):
    """The attack: with the impostor installed, a recipe naming 'jpeg-compressibility' is refused (exit 2,
    both distributions and the way out named, nothing written); 'rlpost:jpeg-compressibility' trains with the
    built-in."""
    from rlpost.engine.recipe import RecipeError, validate
    from rlpost.engine.runner import Runner
    from tests import toy_components
    from tests.toy_components import toy_recipe

    monkeypatch.syspath_prepend(str(hostile_site))
    host = build_host(extra_plugins=(toy_components,))
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=1)
    cfg["rewards"] = ["jpeg-compressibility"]
    with pytest.raises(RecipeError) as err:
        validate(cfg, host)
    text = str(err.value)
    assert "rewards[0].class_path: reward name 'jpeg-compressibility' is contested" in text
    for needle in ("'rlpost'", "'rlpost-plugin-impostor'", "rlpost:jpeg-compressibility", "RLPOST_BLOCK_PLUGINS"):
        assert needle in text
    cfg["rewards"] = ["rlpost:jpeg-compressibility"]
    history = Runner(validate(cfg, host), host).run()
    assert history[0]["reward/jpeg-compressibility"] < 1000.0  # the impostor scores 1000


def test_cli_refuses_a_contested_reward_with_exit_2(hostile_site, tmp_path):
    recipes = Path(__file__).resolve().parents[1] / "fixtures" / "recipes"
    out = tmp_path / "run"
    # tiny-random: validation needs no downloaded weights (valid.yaml names SD3.5-medium, not installed here)
    args = ["validate", "--recipe", str(recipes / "valid.yaml"), "--run.output_dir", str(out)]
    args += ["--model.pretrained", "tiny-random", "--model.resolution", "32"]
    proc = _cli(args, hostile_site)  # the recipe file itself names the contested reward
    assert proc.returncode == 2, proc.stderr
    assert "rewards[0].class_path: reward name 'jpeg-compressibility' is contested" in proc.stderr
    proc = _cli([*args, "--rewards", "[jpeg-compressibility]"], hostile_site)
    assert proc.returncode == 2, proc.stderr
    assert "contested" in proc.stderr and "rlpost-plugin-impostor" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    proc = _cli([*args, "--rewards", "[rlpost:jpeg-compressibility]"], hostile_site)
    assert proc.returncode == 0, proc.stderr
    overlay = tmp_path / "qualified.yaml"  # a later recipe file replaces the contested choice too
    overlay.write_text("rewards: ['rlpost:jpeg-compressibility']\n")
    proc = _cli([*args, "--recipe", str(overlay)], hostile_site)
    assert proc.returncode == 0, proc.stderr
    proc = _cli([*args, "--rewards", "[jpeg-compressibility]"], hostile_site, RLPOST_BLOCK_PLUGINS="impostor")
    assert proc.returncode == 0, proc.stderr


def _cli(args: list[str], site: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RLPOST_")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(site), full_env.get("PYTHONPATH", "")])
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "rlpost.apps.cli", *args], env=full_env, capture_output=True, text=True, timeout=120
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


def test_the_core_host_registers_the_builtins_it_is_given():
    # rlpost.core names no module above it: the top layer (rlpost.apps.host) hands it rlpost's built-ins.
    bare = PluginHost((), load_entrypoints=False)
    assert bare.plugins(include_builtin=True) == []
    assert "group-zscore" not in bare.registry("advantage")
    host = build_host(load_entrypoints=False)
    builtins = [info.name for info in host.plugins(include_builtin=True) if info.builtin]
    assert builtins == sorted(
        ["rlpost.components.builtin", "rlpost.components.prompts", "rlpost.models.sd3", "rlpost.models.flux"]
        + ["rlpost.models.wan", "rlpost.apps.reporting"]
    )
    assert "group-zscore" in host.registry("advantage")


def test_cli_plugins_list_all_includes_builtins(site):
    proc = _cli(["plugins", "list", "--json", "--all"], site)
    names = {p["name"] for p in json.loads(proc.stdout)}
    assert {"rlpost.components.builtin", "rlpost.components.prompts", "rlpost.models.sd3"} <= names


def test_cli_plugins_list_table(site):
    proc = _cli(["plugins", "list"], site, COLUMNS="200")
    assert proc.returncode == 0 and "greenness" in proc.stdout and "broken on purpose" in proc.stdout


def test_trace_plugins(site):
    proc = _cli(["plugins", "list", "--json"], site, RLPOST_TRACE_PLUGINS="1")
    assert proc.returncode == 0
    assert "[rlpost trace] rlpost_register_reward_sources -> ok" in proc.stderr


EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "rlpost-reward-example"


@pytest.fixture(scope="module")
def example_site(tmp_path_factory) -> tuple[Path, Path]:
    """docs/examples/rlpost-reward-example installed with pip: (site directory, the built copy of the source)."""
    target, work = tmp_path_factory.mktemp("example-site"), tmp_path_factory.mktemp("example-build")
    _pip_install(EXAMPLE, target, work)
    return target, work / EXAMPLE.name


def test_installing_the_documented_example_makes_its_reward_usable_by_name(tmp_path, monkeypatch, example_site):
    """docs/examples/rlpost-reward-example installed with pip, then used from a recipe as ``brightness``."""
    from rlpost.engine.recipe import validate
    from rlpost.engine.runner import Runner
    from tests import toy_components
    from tests.toy_components import toy_recipe

    monkeypatch.syspath_prepend(str(example_site[0]))
    monkeypatch.setenv("RLPOST_LOAD_PLUGINS", "rlpost-reward-example")
    monkeypatch.delitem(sys.modules, "rlpost_reward_example", raising=False)
    host = build_host(extra_plugins=(toy_components,))
    assert host.registry("reward").get("brightness").distribution == "rlpost-reward-example"
    cfg = toy_recipe(str(tmp_path / "run"), max_steps=1)
    cfg["rewards"] = ["brightness"]
    history = Runner(validate(cfg, host), host).run()
    assert 0.0 <= history[0]["reward/brightness"] <= 1.0


def test_the_documented_example_passes_its_own_tests_with_the_conformance_kit(example_site):
    """The example's test suite (its README's ``pytest .../tests``), run against the installed package: it checks its
    reward with ``rlpost.testing.check_reward_source``, as docs/writing_plugins.md tells plugin authors to."""
    site, source = example_site
    tests = source / "tests"
    assert "check_reward_source(Brightness())" in (tests / "test_brightness.py").read_text()
    rlpost_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), rlpost_root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "--rootdir", str(source)],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


def test_digits_world_is_a_blockable_first_party_plugin(monkeypatch):
    # The digits world is an entry point of distribution rlpost, not a core module: blocking it removes its
    # components like any other plugin's (needs the `digits` entry point installed: `pip install -e .` again).
    from rlpost.apps.host import DEFAULT_PLUGINS

    assert not any("digits" in module.__name__ for module in DEFAULT_PLUGINS)
    loaded = build_host()
    assert _by_name(loaded)["digits"].status == "ok"
    assert {"digit-alignment", "digit-judge"} <= set(loaded.registry("reward").names())
    assert "digit-prompts" in loaded.registry("prompts").names()
    monkeypatch.setenv("RLPOST_BLOCK_PLUGINS", "digits")
    blocked = build_host()
    assert _by_name(blocked)["digits"].status == "blocked"
    assert not {"digit-alignment", "digit-judge"} & set(blocked.registry("reward").names())
    assert "digit-prompts" not in blocked.registry("prompts").names()
