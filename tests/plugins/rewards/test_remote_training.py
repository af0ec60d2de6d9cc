"""A training run whose reward server is not listening ends with one line naming the URL and exit status 4 (a plugin
failure, ``PluginRuntimeError``: the reward's ``setup`` error is named with its plugin by
``rlpost.engine.scoring.set_up_rewards``), not a traceback; the run directory it leaves does not block the rerun."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from rlpost.apps.cli import main

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_unreachable_reward_server_ends_the_run_with_one_line_naming_the_url(tmp_path, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    recipe = yaml.safe_load((ROOT / "recipes" / "tiny" / "ddpo.yaml").read_text())
    recipe["run"].update(max_steps=1, output_dir=str(tmp_path / "run"))
    recipe["rewards"] = [
        {"class_path": "remote", "init_args": {"url": url, "retries": 1, "backoff_s": 0.01, "timeout_s": 5}}
    ]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["train", "--recipe", str(path)])
    err = capsys.readouterr().err
    assert code == 4, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("rlpost train: reward 'remote'") and f"{url}/health" in last, err
    assert "Traceback" not in err
    assert main(["train", "--recipe", str(path)]) == 4, "the identical rerun must fail the same way, not be refused"
