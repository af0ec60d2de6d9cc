"""The ``rlpost`` command line itself: version, help, component help, plugin listing."""

from __future__ import annotations

import importlib.metadata

from rlpost import cli


def test_version_prints_the_installed_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlpost {importlib.metadata.version('rlpost')}"
