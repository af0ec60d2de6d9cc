"""The wheel carries the shipped recipes and assets: built here with hatchling, installed without dependencies into a
scratch target (torch and the rest come from this environment), and run from a directory outside the checkout, the
README's main job, a copied recipe and the tiny bench recipe find their files inside the installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from pathlib import Path
import rlpost
from rlpost.apps import cli
from rlpost.bench import load_bench

site = Path(sys.argv[1]).resolve()
package = Path(rlpost.__file__).resolve().parent
assert package.parent == site, f"imported {package}, not the installed wheel in {site}"  # not the editable checkout
cheap = json.loads(sys.argv[2])
assert cli.main(["validate", "--recipe", "recipes/treegrpo_digits.yaml"]) == 0
assert cli.main(["recipes", "copy", "treegrpo_digits", "copied.yaml"]) == 0
assert cli.main(["train", "--recipe", "copied.yaml", "--run.output_dir", "run", *cheap]) == 0
assert Path("run/checkpoints/step_000002").is_dir()
spec = load_bench("recipes/bench/tiny.yaml")
files = [*spec.base, *(r for a in spec.algorithms for r in a.recipes)]
assert files and all(Path(f).is_file() and Path(f).resolve().is_relative_to(package) for f in files), files
assert cli.main(["bench", "--recipe", "recipes/bench/tiny.yaml", "--out", "bench", "--bench.seeds", "[0]"]) == 0
assert Path("bench/bench.json").is_file()
print("WHEEL-OK", package)
"""


@pytest.mark.slow
def test_installed_wheel_runs_the_main_job_a_copy_and_a_bench_from_anywhere(tmp_path):
    from tests.unit.test_download_and_paths import CHEAP

    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(dist)], cwd=ROOT, check=True)
    [wheel] = dist.glob("rlpost-*.whl")
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)]
    subprocess.run(pip, check=True)
    assert (site / "rlpost" / "_assets" / "digits-sd3" / "model_index.json").is_file()
    assert (site / "rlpost" / "_recipes" / "treegrpo_digits.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "RLPOST_VERBOSE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(site), json.dumps(CHEAP)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0 and "WHEEL-OK" in done.stdout, done.stdout[-3000:] + done.stderr[-5000:]
