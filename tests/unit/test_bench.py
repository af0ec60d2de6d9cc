"""``rlpost bench``: the tiny bench runs every algorithm once, counts match the cost model, outputs are written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlpost import bench
from rlpost.models.sd3 import SD3Policy
from rlpost.plugins import PluginHost
from rlpost.recipe import RecipeError, merge_sources, validate

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted((ROOT / "recipes" / "bench").glob("*.yaml"))
ALGOS = {"treegrpo", "dancegrpo", "mixgrpo", "ddpo"}


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Run ``rlpost bench --recipe recipes/bench/tiny.yaml --out DIR`` once for the module (from the repo root, where
    the bench recipes' relative paths resolve)."""
    from rlpost.cli import main

    out = tmp_path_factory.mktemp("bench") / "tiny"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert main(["bench", "--recipe", "recipes/bench/tiny.yaml", "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)
    return out, json.loads((out / "bench.json").read_text())


@pytest.mark.slow
def test_tiny_bench_writes_table_json_and_plot(tiny_result: tuple[Path, dict]) -> None:
    out, result = tiny_result
    assert set(result["algorithms"]) == ALGOS
    md = (out / "bench.md").read_text()
    assert "| TreeGRPO |" in md and "| DanceGRPO |" in md and "s/iter" in md
    assert (out / "reward_vs_wallclock.png").stat().st_size > 1000
    for name, algo in result["algorithms"].items():
        assert algo["iterations"] == 1
        assert algo["s_per_iter"]["median"] > 0
        assert algo["predicted_s_per_iter"]["total_s"] > 0
        assert [e["iteration"] for e in algo["evals"]] == [0, 1]
        assert (out / name / "metrics.jsonl").is_file() and (out / name / "report" / "reward_vs_step.png").is_file()
    assert "speed_ratio" in result["comparisons"] and "time_to_reference_final" in result["comparisons"]


@pytest.mark.slow
def test_counted_forwards_equal_the_cost_model(tiny_result: tuple[Path, dict]) -> None:
    _, result = tiny_result
    for name, algo in result["algorithms"].items():
        it = algo["iters"][0]
        assert it["rollout_forwards"] == it["predicted"]["rollout_forwards"], name
        assert it["train_forwards"] == it["predicted"]["train_forwards"], name
        assert it["images"] == it["predicted"]["images"], name
        assert it["trainable_edges"] == it["predicted"]["trainable_edges"], name
        assert algo["rollout_forwards"]["all_equal"] and algo["train_forwards"]["all_equal"], name


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.name)
def test_bench_recipes_validate(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every algorithm of every bench recipe validates (no model loads), all share NFE, LR and eval settings."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(SD3Policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))
    spec = bench.load_bench(str(path))
    assert {a.name for a in spec.algorithms} == ALGOS
    host = PluginHost()
    configs = []
    for algo in spec.algorithms:
        pairs = [(k, json.dumps(v)) for k, v in {**spec.overrides, **algo.overrides}.items()]
        configs.append(validate(merge_sources([*spec.base, *algo.recipes], pairs), host).config)
    for key in ("model", "torch_optimizer", "eval", "rewards", "prompts"):
        assert all(c[key] == configs[0][key] for c in configs), key
    if path.name == "digits.yaml":
        assert {c["sampler"]["init_args"]["num_steps"] for c in configs} == {10}
        tree = next(c for c in configs if c["sampler"]["class_path"].endswith("TreeSampler"))["sampler"]["init_args"]
        assert (tree["k"], tree["depth"], tree["ratio"]) == (3, 3, 0.5)


def test_load_bench_reports_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("bench: {colour: red, reference: nope, schedule: random}\nalgorithms: [{name: a}, {name: a}]\n")
    with pytest.raises(RecipeError) as info:
        bench.load_bench(str(path))
    text = str(info.value)
    for needle in ("bench.colour", "bench.reference", "bench.schedule", "unique"):
        assert needle in text


def test_calibration_interpolates_in_log_batch() -> None:
    calib = bench.Calibration([1, 4, 16], [4.0, 2.0, 1.0], [12.0, 6.0, 3.0], 0.5)
    assert calib.per_row("forward", 1) == 4.0
    assert calib.per_row("forward", 2) == pytest.approx(3.0)
    assert calib.per_row("fwd_bwd", 8) == pytest.approx(4.5)
    assert calib.per_row("forward", 100) == 1.0


def test_comparisons_equal_iterations_and_wall_time() -> None:
    def algo(times: list[float], values: list[float], s_iter: float, pred: float) -> dict:
        evals = [
            {"iteration": 2 * i, "train_time_s": t, "eval/r": v}
            for i, (t, v) in enumerate(zip(times, values, strict=True))
        ]
        return {
            "evals": evals,
            "train_time_s": times[-1],
            "s_per_iter": {"median": s_iter},
            "predicted_s_per_iter": {"total_s": pred},
            "rollout_forwards": {"counted_mean": 10.0},
            "train_forwards": {"counted_mean": 2.0},
        }

    result = {
        "algorithms": {
            "fast": algo([0, 2, 4, 6], [0.5, 0.7, 0.8, 0.9], 1.0, 1.0),
            "ref": algo([0, 4, 8], [0.5, 0.6, 0.75], 2.0, 2.2),
        }
    }
    comp = bench.comparisons(result, "fast", "ref")
    assert comp["equal_iterations"] == {"iteration": 4, "heldout": {"fast": 0.8, "ref": 0.75}}
    assert comp["equal_wall_time"]["train_time_s"] == 6
    assert comp["equal_wall_time"]["heldout"]["ref"]["value"] == 0.6
    assert comp["speed_ratio"]["measured"] == 2.0 and comp["speed_ratio"]["predicted"] == pytest.approx(2.2)
    reach = comp["time_to_reference_final"]
    assert reach["fast_reached_at_s"] == 4 and reach["fraction_of_reference_time"] == 0.5


@pytest.mark.slow
def test_report_only_rerenders_from_json(tiny_result: tuple[Path, dict]) -> None:
    out, _ = tiny_result
    (out / "bench.md").unlink()
    assert bench.main(["--report-only", str(out)]) == 0
    assert "## Targets" in (out / "bench.md").read_text()
