"""Test configuration shared by the whole suite.

* ``HF_HUB_OFFLINE=1`` must be set before Python starts (setting it later has no effect once huggingface_hub is
  imported); the README's test command does so, and this file refuses to run without it rather than let a hub
  lookup hang for minutes or silently return a broken tokenizer.
* Third-party plugins installed on the machine are never auto-loaded in tests (``RLPOST_DISABLE_PLUGIN_AUTOLOAD``);
  first-party plugins (distribution ``rlpost``) still load.
* Tests run on 2 CPU threads in fp32, deterministically.
* The conformance kit's pytest plugin (``rlpost.testing.pytest_plugin``) gives its tiny-model fixtures. An installed
  rlpost also declares it as a ``pytest11`` entry point under the same name, and pytest loads a plugin once.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("HF_HUB_OFFLINE") != "1":
    raise pytest.UsageError(
        "run the tests with HF_HUB_OFFLINE=1 set before Python starts (see README: 'HF_HUB_OFFLINE=1 .venv/bin/pytest')"
    )
os.environ["RLPOST_DISABLE_PLUGIN_AUTOLOAD"] = "1"

pytest_plugins = ["rlpost.testing.pytest_plugin"]

import torch  # noqa: E402

torch.set_num_threads(2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests cleanly when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from tests.models_fixtures import *  # noqa: E402,F401,F403  (tiny SD3 fixtures, e.g. tiny_sd3_dir)
