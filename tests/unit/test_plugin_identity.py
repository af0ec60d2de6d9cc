"""Plugins that lie about who they are or talk while loading.

A distribution whose METADATA says ``Name: rlpost`` is not rlpost: only the entry points rlpost itself declares
(``rlpost.apps.host.FIRST_PARTY_PLUGINS``, equal to pyproject.toml's) load as first-party, and any other entry point
of a distribution calling itself so is refused before it is imported and listed with the reason. A plugin that
prints while it is imported or registered never breaks ``rlpost plugins list --json``: its output goes to stderr.

The fake distributions are written as an installer leaves them: a ``*.dist-info`` directory (METADATA,
entry_points.txt) beside the module, in a directory on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.apps.host import FIRST_PARTY_PLUGINS, build_host
from rlpost.engine.recipe.names import resolve_component

ROOT = Path(__file__).resolve().parents[2]
BUILTIN_JPEG = "rlpost_rewards.jpeg.JpegCompressibility"

SELF_NAMED = '''"""Claims to be rlpost: replaces the built-in jpeg-compressibility with a reward scoring 1000."""
from rlpost import RewardSource, hookimpl


class FakeJpeg(RewardSource):
    name = "jpeg-compressibility"

    def score(self, images, prompts, metadata):
        return images.new_full((images.shape[0],), 1000.0).float()


class Extra(RewardSource):
    name = "selfnamed-extra"

    def score(self, images, prompts, metadata):
        return images.float().mean(dim=(1, 2, 3))


@hookimpl
def rlpost_register_reward_sources(register):
    register(FakeJpeg)
    register(Extra)
'''

NOISY = '''"""Writes to stdout every way it can while it is imported and registered."""
import os
import sys

from rlpost import RewardSource, hookimpl

print("noisy: print at import")
sys.stdout.write("noisy: sys.stdout.write at import\\n")
sys.stdout.buffer.write(b"noisy: sys.stdout.buffer at import\\n")
sys.stdout.flush()
os.write(1, b"noisy: os.write to fd 1 at import\\n")


class Loud(RewardSource):
    name = "loud"

    def score(self, images, prompts, metadata):
        return images.float().mean(dim=(1, 2, 3))


@hookimpl
def rlpost_register_reward_sources(register):
    print("noisy: print while registering")
    register(Loud)
'''
NOISY_LINES = (
    "noisy: print at import",
    "noisy: sys.stdout.write at import",
    "noisy: sys.stdout.buffer at import",
    "noisy: print while registering",
)


def write_dist(site: Path, name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> Path:
    """Install a distribution by hand into ``site``: ``<name>-<version>.dist-info`` with METADATA and the ``rlpost``
    entry points, plus each module as ``<module>.py``. Returns ``site``."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[rlpost]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for module, source in modules.items():
        (site / f"{module}.py").write_text(source)
    return site


@pytest.fixture
def self_named_site(tmp_path: Path) -> Path:
    """A distribution named ``rlpost`` (version 99.0) taking the first-party entry-point name ``rewards`` and adding
    ``extra``, both pointing at its own module."""
    entry_points = {"rewards": "rlpost_selfnamed", "extra": "rlpost_selfnamed"}
    return write_dist(tmp_path / "site", "rlpost", "99.0", entry_points, {"rlpost_selfnamed": SELF_NAMED})


@pytest.fixture
def noisy_site(tmp_path: Path) -> Path:
    return write_dist(
        tmp_path / "noisy",
        "rlpost-plugin-noisy",
        "1.0",
        {"noisy": "rlpost_plugin_noisy"},
        {"rlpost_plugin_noisy": NOISY},
    )


def test_first_party_plugins_are_the_ones_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["rlpost"]
    assert declared == FIRST_PARTY_PLUGINS


@pytest.mark.parametrize("autoload", [False, True], ids=["autoload-disabled", "autoload-enabled"])
@pytest.mark.parametrize("first", [True, False], ids=["first-on-path", "last-on-path"])
def test_a_distribution_calling_itself_rlpost_replaces_no_builtin(self_named_site, monkeypatch, first, autoload):
    monkeypatch.setattr(sys, "path", [str(self_named_site), *sys.path] if first else [*sys.path, str(self_named_site)])
    monkeypatch.delitem(sys.modules, "rlpost_selfnamed", raising=False)
    monkeypatch.delenv("RLPOST_BLOCK_PLUGINS", raising=False)
    monkeypatch.delenv("RLPOST_LOAD_PLUGINS", raising=False)
    if autoload:
        monkeypatch.delenv("RLPOST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    host = build_host()
    rewards = host.registry("reward")
    for name in ("jpeg-compressibility", "rlpost:jpeg-compressibility"):
        assert rewards.get(name).class_path == BUILTIN_JPEG
    problems: list[str] = []
    resolved = resolve_component("jpeg-compressibility", "rewards[0]", "reward", host, problems)
    assert problems == [] and resolved == {"class_path": BUILTIN_JPEG}
    assert "selfnamed-extra" not in rewards and rewards.contested() == {}
    assert "rlpost_selfnamed" not in sys.modules  # refused before import: its code never ran

    infos = {info.name: info for info in host.plugins()}
    genuine = infos["rewards"]
    assert (genuine.status, genuine.distribution, genuine.source) == ("ok", "rlpost", "rlpost_rewards")
    assert "reward:jpeg-compressibility" in genuine.components
    impostor = infos["rlpost:rewards"]
    assert impostor.status == "error" and impostor.error is not None and impostor.error.startswith("refused: ")
    for needle in (str(self_named_site), "'rewards = rlpost_selfnamed'", "rlpost's own 'rewards' is 'rlpost_rewards'"):
        assert needle in impostor.error, impostor.error
    extra = infos["extra"]
    assert extra.status == "error" and extra.error is not None and "rlpost has no plugin 'extra'" in extra.error


def test_plugin_prints_go_to_stderr_in_the_library(noisy_site, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(noisy_site))
    monkeypatch.delitem(sys.modules, "rlpost_plugin_noisy", raising=False)
    monkeypatch.setenv("RLPOST_LOAD_PLUGINS", "rlpost-plugin-noisy")
    host = build_host()
    assert "loud" in host.registry("reward")
    out, err = capsys.readouterr()
    for line in NOISY_LINES:
        assert line not in out and line in err, (out, err)


def _cli(args: list[str], *sites: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPOST_")}  # third-party plugins load
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "rlpost.apps.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_plugins_list_json_stays_json_and_lists_the_refused_impostor(noisy_site, self_named_site):
    proc = _cli(["plugins", "list", "--json"], noisy_site, self_named_site)
    assert proc.returncode == 0, proc.stderr
    infos = {p["name"]: p for p in json.loads(proc.stdout)}  # nothing the plugin wrote is mixed into it
    assert infos["noisy"]["status"] == "ok" and infos["noisy"]["components"] == ["reward:loud"]
    for line in (*NOISY_LINES, "noisy: os.write to fd 1 at import"):
        assert line in proc.stderr, proc.stderr
    assert infos["rewards"]["status"] == "ok" and infos["rewards"]["source"] == "rlpost_rewards"
    assert infos["rlpost:rewards"]["status"] == "error"
    assert infos["rlpost:rewards"]["error"].startswith("refused: a distribution named 'rlpost'")
    table = _cli(["plugins", "list"], noisy_site, self_named_site)
    assert table.returncode == 0 and "noisy:" not in table.stdout and "refused: a distribution" in table.stdout
