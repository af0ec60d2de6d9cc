"""``rlpost bench``: the tiny bench runs every algorithm for every seed, counts match the cost model, per-seed results
are saved and aggregated with intervals, and the report never states a difference the intervals do not support."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost import bench
from rlpost.apps.host import build_host
from rlpost.engine.recipe import RecipeError, command_line_value, parse_recipe, validate
from rlpost.models.sd3 import SD3Policy

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted((ROOT / "recipes" / "bench").glob("*.yaml"))
SUB_BENCHES = sorted(p for p in (ROOT / "recipes" / "bench" / "digits").glob("*_bench.yaml") if "field" not in p.name)
FIELD = ROOT / "recipes" / "bench" / "digits" / "field_bench.yaml"
FIELD_TUNING = ROOT / "recipes" / "bench" / "digits" / "field_tuning_bench.yaml"
FIELD_MIX_WINDOW = ROOT / "recipes" / "bench" / "digits" / "field_mixgrpo_window_bench.yaml"
FIELD_TREENFT_BUDGET = ROOT / "recipes" / "bench" / "digits" / "field_treenft_budget_bench.yaml"
TINY_ALGOS = {"treegrpo-paper", "treegrpo-code", "dancegrpo", "mixgrpo", "ddpo"}
TINY_SEEDS = [0, 1]


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Run ``rlpost bench --recipe recipes/bench/tiny.yaml --out DIR`` once for the module, from a directory outside
    the checkout (the recipe and its ``base:`` and ``recipes:`` paths name the shipped files: docs/recipes.md)."""
    from rlpost.apps.cli import main

    out = tmp_path_factory.mktemp("bench") / "tiny"
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    try:
        assert main(["bench", "--recipe", "recipes/bench/tiny.yaml", "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)
    return out, json.loads((out / "bench.json").read_text())


@pytest.mark.slow
def test_tiny_bench_writes_table_json_and_plot(tiny_result: tuple[Path, dict]) -> None:
    out, result = tiny_result
    assert set(result["algorithms"]) == TINY_ALGOS
    assert set(result["runs"]) == {f"{a}/seed{s}" for a in TINY_ALGOS for s in TINY_SEEDS}
    md = (out / "bench.md").read_text()
    assert "| TreeGRPO | treegrpo-paper (k=2, d=2 at NFE 4) |" in md and "| DanceGRPO | dancegrpo |" in md
    assert "s/iter" in md and "## Conclusions" in md and "72.0" in md
    assert (out / "reward_vs_wallclock.png").stat().st_size > 1000
    for key, run in result["runs"].items():
        assert run["iterations"] == 1
        assert run["s_per_iter"]["median"] > 0
        assert run["predicted_s_per_iter"]["total_s"] > 0
        assert [e["iteration"] for e in run["evals"]] == [0, 1]
        assert (out / key / "metrics.jsonl").is_file() and (out / key / "report" / "reward_vs_step.png").is_file()
        assert json.loads((out / key / "bench_run.json").read_text())["seed"] == run["seed"]
        assert run["seed"] == int(key.rsplit("seed", 1)[1])
    for name, algo in result["algorithms"].items():
        assert algo["seeds"] == TINY_SEEDS and algo["s_per_iter"]["n"] == 2, name
        assert algo["s_per_iter"]["min"] <= algo["s_per_iter"]["mean"] <= algo["s_per_iter"]["max"], name
    ratio = result["comparisons"]["ratios"]["treegrpo-paper"]
    assert ratio["paper_s_per_iter"] == pytest.approx(173.5 / 72.0)
    assert ratio["s_per_iter"]["n_num"] == 2 and ratio["s_per_iter"]["n_den"] == 2


@pytest.mark.slow
def test_seeds_train_differently_from_the_same_start(tiny_result: tuple[Path, dict]) -> None:
    """Each seed is its own run: same step-0 evaluation (fixed eval seeds, identity LoRA), different training."""
    _, result = tiny_result
    for name in TINY_ALGOS:
        runs = [result["runs"][f"{name}/seed{s}"] for s in TINY_SEEDS]
        key = result["comparisons"]["metric"]
        assert runs[0]["evals"][0][key] == runs[1]["evals"][0][key], name
        assert runs[0]["iters"][0]["reward"] != runs[1]["iters"][0]["reward"], name


@pytest.mark.slow
def test_counted_forwards_equal_the_cost_model(tiny_result: tuple[Path, dict]) -> None:
    _, result = tiny_result
    for key, run in result["runs"].items():
        it = run["iters"][0]
        assert it["rollout_forwards"] == it["predicted"]["rollout_forwards"], key
        assert it["train_forwards"] == it["predicted"]["train_forwards"], key
        assert it["reference_forwards"] == it["predicted"]["reference_forwards"], key
        # the tiny bench's treegrpo-code arm has a KL term: one reference forward per training forward
        assert it["reference_forwards"] == (it["train_forwards"] if key.startswith("treegrpo-code/") else 0), key
        assert it["images"] == it["predicted"]["images"], key
        assert it["trainable_edges"] == it["predicted"]["trainable_edges"], key
        assert run["rollout_forwards"]["all_equal"] and run["train_forwards"]["all_equal"], key
        assert run["reference_forwards"]["all_equal"], key
    for name, algo in result["algorithms"].items():
        assert algo["rollout_forwards"]["all_equal"] and algo["train_forwards"]["all_equal"], name
        assert algo["reference_forwards"]["all_equal"], name
    kl = result["algorithms"]["treegrpo-code"]
    assert kl["reference_forwards"]["counted_mean"] == kl["train_forwards"]["counted_mean"] > 0
    assert kl["predicted_s_per_iter"]["reference_forward_s"] > 0


def _validated_algorithms(spec: bench.BenchSpec) -> dict[str, dict[str, Any]]:
    """Each algorithm's resolved config; asserts they share model, evaluation, rewards, prompts and LR."""
    host = build_host()
    configs: dict[str, dict[str, Any]] = {}
    for algo in spec.algorithms:
        pairs = [(k, command_line_value(v)) for k, v in {**spec.overrides, **algo.overrides}.items()]
        configs[algo.name] = validate(parse_recipe([*spec.base, *algo.recipes], pairs, host), host).config
    first = next(iter(configs.values()))
    for key in ("model", "eval", "rewards", "prompts"):
        assert all(c[key] == first[key] for c in configs.values()), key
    assert {c["torch_optimizer"]["init_args"]["lr"] for c in configs.values()} == {2.0e-3}
    return configs


@pytest.mark.parametrize("path", SUB_BENCHES, ids=lambda p: p.name)
def test_digits_sub_benches_validate(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The focused digits benches (recipes/bench/digits/*_bench.yaml) validate like the main one; an arm that adds
    prompt selection, a std floor, an LR decay, a KL term, torch.compile or overlap differs from its plain arm only
    there."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(SD3Policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))
    spec = bench.load_bench(str(path))
    assert spec.seeds is not None and spec.reference == "dancegrpo"
    assert any(name.startswith("treegrpo") for name in spec.fast_names)
    configs = _validated_algorithms(spec)
    for name, config in configs.items():
        if name.endswith("-skip"):
            static = configs[name.removesuffix("-skip")]
            assert config["run"]["min_group_spread"] == 0.05 and static["run"]["min_group_spread"] is None
            assert {k: v for k, v in config.items() if k != "run"} == {k: v for k, v in static.items() if k != "run"}
        if name.endswith("-decay"):
            constant = configs[name.removesuffix("-decay")]
            assert constant.get("lr_scheduler") is None
            assert config["lr_scheduler"]["class_path"] == "torch.optim.lr_scheduler.PolynomialLR"
            assert {k: v for k, v in config.items() if k != "lr_scheduler"} == {
                k: v for k, v in constant.items() if k != "lr_scheduler"
            }
        if name.endswith("-kl"):
            plain = configs[name.removesuffix("-kl")]
            assert (
                config["optimizer"]["init_args"]["kl_coef"] == 0.1 and plain["optimizer"]["init_args"]["kl_coef"] == 0
            )
            without_kl = [
                {**c, "optimizer": {**c["optimizer"], "init_args": {**c["optimizer"]["init_args"], "kl_coef": 0}}}
                for c in (config, plain)
            ]
            assert without_kl[0] == without_kl[1]
        if name.endswith("-compile"):
            plain = configs[name.removesuffix("-compile")]
            assert config["run"]["speedups"]["compile"] == "both" and plain["run"]["speedups"]["compile"] == "off"
            assert {k: v for k, v in config.items() if k != "run"} == {k: v for k, v in plain.items() if k != "run"}
            assert {**config["run"], "speedups": None} == {**plain["run"], "speedups": None}
        if name.endswith("-overlap"):
            plain = configs[name.removesuffix("-overlap")]
            assert config["run"]["speedups"]["overlap_groups"] == 1 and plain["run"]["speedups"]["overlap_groups"] == 0
            assert {k: v for k, v in config.items() if k != "run"} == {k: v for k, v in plain.items() if k != "run"}
            assert {**config["run"], "speedups": None} == {**plain["run"], "speedups": None}
        if name.endswith("-floor"):
            plain = configs[name.removesuffix("-floor")]
            assert config["advantage"]["init_args"]["eps"] == 0.05 and plain["advantage"]["init_args"]["eps"] == 1e-8
            assert {k: v for k, v in config.items() if k != "advantage"} == {
                k: v for k, v in plain.items() if k != "advantage"
            }


def _arm_configs(spec: bench.BenchSpec) -> dict[str, dict[str, Any]]:
    host = build_host()
    configs: dict[str, dict[str, Any]] = {}
    for algo in spec.algorithms:
        pairs = [(k, command_line_value(v)) for k, v in {**spec.overrides, **algo.overrides}.items()]
        configs[algo.name] = validate(parse_recipe([*spec.base, *algo.recipes], pairs, host), host).config
    return configs


def test_field_benches_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The field bench holds every first-party algorithm (TreeGRPO as its main job) on one model, grid, reward and
    held-out evaluation; its tuning bench gives every method the same search (0.5x, 1x, 2x its learning rate) on a
    seed the field never uses, scored on the rl prompts only, and each field arm runs exactly one of its trials'
    settings (the chosen one) apart from evaluation and seed."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(SD3Policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))
    field, tuning = bench.load_bench(str(FIELD)), bench.load_bench(str(FIELD_TUNING))
    configs = _arm_configs(field)
    optimizers = {c["optimizer"]["class_path"].rsplit(".", 1)[-1] for c in configs.values()}
    assert len(configs) == 13 and optimizers == {
        "ClippedSurrogate", "FlowGRPOUpdate", "BranchSurrogate", "TempFlowUpdate", "NFTUpdate", "AWMUpdate",
        "DGPOUpdate", "TreeNFTUpdate",
    }, optimizers  # fmt: skip
    for key in ("model", "eval", "rewards", "prompts"):
        assert all(c[key] == configs["dancegrpo"][key] for c in configs.values()), key
    assert list(configs["nft"]["eval"]["sets"]) == ["heldout"] and field.seeds == [0, 1, 2]
    assert {c["sampler"]["init_args"]["num_steps"] for c in configs.values()} == {10}  # one time grid
    trials = _arm_configs(tuning)
    assert tuning.seeds is not None and not set(tuning.seeds) & set(field.seeds)
    assert tuning.time_budget_s == field.time_budget_s
    for name, config in configs.items():
        recipe_lr = trials[f"{name}-lr1"]["torch_optimizer"]["init_args"]["lr"]
        tried = {f: trials[f"{name}-lr{f}"]["torch_optimizer"]["init_args"]["lr"] for f in ("0.5", "1", "2")}
        assert sorted(tried.values()) == pytest.approx([0.5 * recipe_lr, recipe_lr, 2 * recipe_lr], rel=1e-2), name
        chosen = [f for f, lr in tried.items() if lr == pytest.approx(config["torch_optimizer"]["init_args"]["lr"])]
        assert len(chosen) == 1, f"{name}: the field's learning rate is not one of its tuning trials"
        assert list(trials[f"{name}-lr1"]["eval"]["sets"]) == ["rl"]
        assert {k: v for k, v in trials[f"{name}-lr{chosen[0]}"].items() if k not in ("eval", "run")} == {
            k: v for k, v in config.items() if k not in ("eval", "run")
        }, name
    assert len(trials) == 3 * len(configs)
    # The MixGRPO window ablation: the field's MixGRPO arm, and the same with the window swept over the budget.
    window = bench.load_bench(str(FIELD_MIX_WINDOW))
    driver = bench.Bench(window, host=build_host(), log=lambda msg: None)
    arms = {a.name: driver._recipe(a, 0).config for a in window.algorithms}  # binds the budget as a bench run does
    assert window.seeds == field.seeds and window.time_budget_s == field.time_budget_s
    assert {k: v for k, v in arms["mixgrpo"].items() if k != "run"} == {
        k: v for k, v in configs["mixgrpo"].items() if k != "run"
    }
    over = arms["mixgrpo-over-budget"]
    assert over["sampler"]["init_args"]["shift_over"] == "time" and over["sampler"]["init_args"]["budget_s"] == 60
    schedule = ("shift_over", "budget_s")
    over_args = {k: v for k, v in over["sampler"]["init_args"].items() if k not in schedule}
    assert over_args == {k: v for k, v in arms["mixgrpo"]["sampler"]["init_args"].items() if k not in schedule}
    # TreeNFT with its learning rate decaying to 0 over the budget: the field's TreeNFT arm plus the schedule.
    budget = bench.load_bench(str(FIELD_TREENFT_BUDGET))
    driver = bench.Bench(budget, host=build_host(), log=lambda msg: None)
    arms = {a.name: driver._recipe(a, 0).config for a in budget.algorithms}
    assert {k: v for k, v in arms["treenft"].items() if k != "run"} == {
        k: v for k, v in configs["treenft"].items() if k != "run"
    }
    decay = arms["treenft-decay"]
    assert decay["lr_scheduler"]["init_args"] == {
        "shape": "linear",
        "warmup": 0.0,
        "final": 0.0,
        "over": "time",
        "budget_s": 60,
    }
    assert {k: v for k, v in decay.items() if k not in ("run", "lr_scheduler")} == {
        k: v for k, v in arms["treenft"].items() if k not in ("run", "lr_scheduler")
    }


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.name)
def test_bench_recipes_validate(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every algorithm of every bench recipe validates (no model loads); all share NFE, LR and eval settings."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(SD3Policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))
    spec = bench.load_bench(str(path))
    assert {"treegrpo-paper", "dancegrpo", "mixgrpo", "ddpo"} <= {a.name for a in spec.algorithms}
    assert spec.seeds is not None and len(spec.seeds) >= 2
    configs = _validated_algorithms(spec)
    if path.name == "digits.yaml":
        assert spec.seeds == [0, 1, 2] and spec.reference == "dancegrpo"
        assert spec.fast_names == ["treegrpo-paper", "treegrpo-code"]
        # 5 algorithms x 3 seeds within ~30 minutes on 2 cores: the per-run training budget stays short.
        assert spec.time_budget_s is not None and len(spec.algorithms) * len(spec.seeds) * spec.time_budget_s <= 1500
        assert {c["sampler"]["init_args"]["num_steps"] for c in configs.values()} == {10}
        tree = configs["treegrpo-paper"]["sampler"]["init_args"]
        assert (tree["k"], tree["depth"], tree["window"], tree["ratio"]) == (3, 3, "geometric", 0.5)
        assert spec.paper["s_per_iter"]["values"] == {
            "treegrpo-paper": 72.0,
            "dancegrpo": 173.5,
            "mixgrpo": 145.4,
            "ddpo": 166.1,
            "treegrpo-code": 59.6,
        }
        code = configs["treegrpo-code"]
        s = code["sampler"]["init_args"]
        assert (s["k"], s["depth"], s["window"], s["shift_interval"], s["stride"]) == (2, 4, "progressive", 50, 1)
        assert code["advantage"]["init_args"]["weights"] == "uniform"
        assert code["advantage"]["init_args"]["std"] == "population"
        assert code["optimizer"]["init_args"]["optimizer_steps"] == 2
        assert code["torch_optimizer"]["init_args"]["weight_decay"] == 1.0e-4


def test_load_bench_reports_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text(
        "bench: {colour: red, reference: nope, schedule: random, seeds: [0, 0], fast: [a, zz], metric: reward}\n"
        "algorithms: [{name: a, colour: blue}, {name: a}]\n"
        "paper: {s_per_iter: {values: {zz: 1.0, a: -3}}, colour: 1}\n"
        "extra: 1\n"
    )
    with pytest.raises(RecipeError) as info:
        bench.load_bench(str(path))
    text = str(info.value)
    for needle in (
        "bench.colour",
        "bench.reference",
        "bench.schedule",
        "unique",
        "bench.seeds",
        "bench.fast: 'zz'",
        "bench.metric",
        "algorithms[0]: unknown keys ['colour']",
        "paper.s_per_iter.values.zz",
        "paper.s_per_iter.values.a: expected a positive number",
        "paper.colour",
        "extra: unknown top-level key",
    ):
        assert needle in text, needle


def test_load_bench_seeds(tmp_path: Path) -> None:
    path = tmp_path / "b.yaml"
    path.write_text("bench: {num_seeds: 3}\nalgorithms: [{name: a}]\n")
    assert bench.load_bench(str(path)).seeds == [0, 1, 2]
    assert bench.load_bench(str(path), [("bench.seeds", "[4, 7]"), ("bench.num_seeds", "null")]).seeds == [4, 7]
    path.write_text("bench: {}\nalgorithms: [{name: a}]\n")
    assert bench.load_bench(str(path)).seeds is None
    path.write_text("bench: {seeds: [1], num_seeds: 2}\nalgorithms: [{name: a}]\n")
    with pytest.raises(RecipeError, match="not both"):
        bench.load_bench(str(path))
    path.write_text("bench: {num_seeds: 0}\nalgorithms: [{name: a}]\n")
    with pytest.raises(RecipeError, match="bench.num_seeds"):
        bench.load_bench(str(path))


def test_calibration_interpolates_in_log_batch() -> None:
    calib = bench.Calibration([1, 4, 16], [4.0, 2.0, 1.0], [12.0, 6.0, 3.0], 0.5)
    assert calib.per_row("forward", 1) == 4.0
    assert calib.per_row("forward", 2) == pytest.approx(3.0)
    assert calib.per_row("fwd_bwd", 8) == pytest.approx(4.5)
    assert calib.per_row("forward", 100) == 1.0


# ------------------------------------------------------------------------------ aggregation (synthetic runs)


def _run(name: str, seed: int, times: list[float], values: dict[str, list[float]], s_iter: float) -> dict[str, Any]:
    evals = [
        {"iteration": 5 * i, "train_time_s": t, **{k: v[i] for k, v in values.items()}} for i, t in enumerate(times)
    ]
    phases = dict.fromkeys(bench.PHASES, 0.1)
    return {
        "algorithm": name,
        "seed": seed,
        "label": name.upper(),
        "preset": f"{name}-preset",
        "train_rewards": ["r"],
        "iterations": 5 * (len(times) - 1),
        "train_time_s": times[-1],
        "s_per_iter": {"median": s_iter},
        "images_per_iter": 8.0,
        "trainable_edges_per_iter": 10.0,
        "rollout_forwards": {
            "counted_mean": 10.0,
            "predicted_mean": 10.0,
            "predicted_expected": 10.0,
            "all_equal": True,
        },
        "train_forwards": {"counted_mean": 2.0, "predicted_mean": 2.0, "all_equal": True},
        "reference_forwards": {"counted_mean": 0.0, "predicted_mean": 0.0, "all_equal": True},
        "phases_mean_s": phases,
        "overhead_s": 0.05,
        "overhead_fraction": 0.05,
        "predicted_s_per_iter": {
            "total_s": s_iter,
            "rollout_forward_s": s_iter,
            "train_fwd_bwd_s": 0.0,
            "reference_forward_s": 0.0,
            "decode_reward_s": 0.0,
            "rollout_batch": 8.0,
            "train_batch": 2.0,
        },
        "peak_mem_gb": None,
        "evals": evals,
        "iters": [{"wall_s": s_iter}],
    }


def _result(runs: list[dict[str, Any]], fast: list[str], reference: str, paper: dict | None = None) -> dict[str, Any]:
    names = list(dict.fromkeys(r["algorithm"] for r in runs))
    result: dict[str, Any] = {
        "spec": {
            "seeds": sorted({r["seed"] for r in runs}),
            "schedule": "least-time",
            "time_budget_s": 6.0,
            "max_iterations": 400,
            "fast": fast,
            "reference": reference,
            "metric": None,
            "eval_every": 5,
            "bootstrap": {"resamples": 2000, "confidence": 0.95, "seed": 0},
            "algorithms": [{"name": n} for n in names],
            "paper": paper or {},
        },
        "runs": {f"{r['algorithm']}/seed{r['seed']}": r for r in runs},
    }
    result["algorithms"] = bench.aggregate(result)
    result["comparisons"] = bench.comparisons(result)
    return result


def test_aggregate_over_seeds_equal_iterations_wall_time_levels_and_ratios() -> None:
    # Two evaluation keys (a training-reward metric and a judge): both are reported, levels use eval/r.
    runs = []
    for seed, (jit, jit_t) in enumerate([(0.00, 0.0), (0.01, 0.1), (-0.01, -0.1)]):
        runs.append(
            _run(
                "fast",
                seed,
                [0, 2 + jit_t, 4, 6],
                {"eval/r": [0.5, 0.7 + jit, 0.8 + jit, 0.9], "eval/judge": [0.1, 0.2, 0.3, 0.4]},
                1.0 + jit,
            )
        )
        runs.append(
            _run(
                "ref",
                seed,
                [0, 4, 8, 12],
                {"eval/r": [0.5, 0.6, 0.75 + jit, 0.7], "eval/judge": [0.1, 0.1, 0.1, 0.1]},
                2.0 + jit,
            )
        )
    paper = {"s_per_iter": {"values": {"fast": 72.0, "ref": 173.5}, "notes": {}, "source": "T1"}}
    result = _result(runs, ["fast"], "ref", paper)
    comp, algos = result["comparisons"], result["algorithms"]
    assert comp["eval_keys"] == ["eval/judge", "eval/r"] and comp["metric"] == "eval/r"
    assert algos["fast"]["seeds"] == [0, 1, 2] and algos["fast"]["s_per_iter"]["mean"] == pytest.approx(1.0)
    assert algos["fast"]["paper_s_per_iter"] == 72.0
    # Equal iterations: the largest iteration every run evaluated (15); equal wall time: the shortest run (6 s).
    assert comp["equal_iterations"]["iteration"] == 15
    assert comp["equal_iterations"]["heldout"]["eval/r"]["fast"]["mean"] == pytest.approx(0.9)
    assert comp["equal_wall_time"]["train_time_s"] == 6
    assert comp["equal_wall_time"]["heldout"]["eval/r"]["ref"]["mean"] == pytest.approx(0.6)
    assert comp["equal_wall_time"]["iterations"]["ref"] == [5, 5, 5]
    assert comp["equal_wall_time"]["heldout"]["eval/judge"]["fast"]["mean"] == pytest.approx(0.4)
    # Levels: ref's per-seed bests 0.75, 0.76, 0.74 -> 0.74; finals all 0.7.
    best = comp["levels"]["best"]
    assert best["level"] == pytest.approx(0.74)
    assert best["by_algorithm"]["ref"]["times_s"] == [8, 8, 8]
    assert best["by_algorithm"]["fast"]["times_s"] == [4, 4, 4]
    assert comp["levels"]["final"]["level"] == pytest.approx(0.7)
    ratio = comp["ratios"]["fast"]
    assert ratio["s_per_iter"]["mean"] == pytest.approx(2.0)
    assert ratio["s_per_iter_vs_1"] == "separated"
    assert ratio["paper_s_per_iter"] == pytest.approx(173.5 / 72.0)
    assert ratio["s_per_iter_vs_paper"] == "separated"
    assert ratio["time_to_level"]["best"]["mean"] == pytest.approx(2.0)
    # Stricter reading: ref's mean best 0.75; ref reached its own best at 8 s in every seed; fast reaches 0.75 at
    # 4 s (seeds 0, 1: 0.8, 0.81) and 4 s (seed 2: 0.79), so the ratio is 8 / 4.
    own = comp["own_best"]
    assert own["level"] == pytest.approx(0.75) and own["reference_times_s"] == [8, 8, 8]
    assert own["by_algorithm"]["fast"]["times_s"] == [4, 4, 4] and own["ratios"]["fast"]["mean"] == pytest.approx(2.0)
    assert "ref" not in own["by_algorithm"]
    assert "FAST [fast-preset] faster than REF [ref-preset] (separated)" in " ".join(comp["conclusions"])
    md = _markdown(result)
    assert "### `eval/judge`" in md and "### `eval/r`" in md
    assert "| FAST | fast-preset |" in md and "2.41x" in md and "excludes 2.41 (below)" in md
    assert "mean best level, against its own time to its best" in md and "| 3/3 | 4.0 (n=3, all equal) |" in md


def test_report_gives_each_arms_speedups_and_guard_error() -> None:
    """Per arm: the speed-ups that were on and the ratio guard's max |ratio - 1| over seeds (plain arms: none; an
    overlap-only arm: named, its guard not run)."""
    runs = []
    for seed, error in enumerate([2e-9, 5e-9, 3e-9]):
        fast = _run("fast", seed, [0, 5], {"eval/r": [0.5, 0.6]}, 1.0 + 0.01 * seed)
        guard = {"speedups": ["compile=both"], "max_error": error, "mean_error": error, "edges": 39}
        guard |= {"tolerance": 1e-3, "seconds": 20.0, "passed": True}
        runs.append({**fast, "speedups": ["compile=both"], "ratio_guard": guard})
        runs.append({**_run("ref", seed, [0, 5], {"eval/r": [0.5, 0.6]}, 2.0), "speedups": [], "ratio_guard": None})
        overlap = _run("ovl", seed, [0, 5], {"eval/r": [0.5, 0.6]}, 3.0)  # changes no ratio: no guard
        runs.append({**overlap, "speedups": ["overlap_groups=1"], "ratio_guard": None})
    result = _result(runs, ["fast", "ovl"], "ref")
    guard = result["algorithms"]["fast"]["ratio_guard"]
    assert guard["max_error"] == 5e-9 and guard["per_seed"] == [2e-9, 5e-9, 3e-9] and guard["tolerance"] == 1e-3
    assert result["algorithms"]["ref"]["ratio_guard"] is None
    md = _markdown(result)
    assert "## Speed-ups and the ratio guard" in md
    assert "| FAST | fast-preset | compile=both | 5e-09 | 2e-09, 5e-09, 3e-09 | 0.001 | 20.0 |" in md
    assert "| REF | ref-preset | none | – | – | – | – |" in md
    assert "| OVL | ovl-preset | overlap_groups=1 | not run (changes no ratio) | – | – | – |" in md
    plain = _result([r for r in runs if r["algorithm"] == "ref"], [], "ref")  # no arm with a speed-up: no section
    md = _markdown(plain)
    assert "ratio guard" not in md


def test_overlapping_seeds_are_reported_not_separated_and_unreached_levels_honestly() -> None:
    runs = []
    for seed, (a, b) in enumerate([(1.0, 1.3), (1.2, 1.5), (1.4, 1.7)]):
        # "slow" never reaches ref's best in seed 2.
        runs.append(_run("slow", seed, [0, 5, 10], {"eval/r": [0.5, 0.6, 0.8 if seed < 2 else 0.65]}, a))
        runs.append(_run("ref", seed, [0, 5, 10], {"eval/r": [0.5, 0.7, 0.75]}, b))
    result = _result(runs, ["slow"], "ref")
    comp = result["comparisons"]
    text = "\n".join(comp["conclusions"])
    assert "s/iter: SLOW [slow-preset] vs REF [ref-preset] not separated" in text
    assert "faster" not in text and "slower" not in text
    assert "not reached in 1 of 3 seeds" in text
    lv = comp["levels"]["best"]["by_algorithm"]["slow"]
    assert lv["reached"] == 2 and lv["times_s"][2] is None and lv["iterations"][2] is None
    assert "not_reached" in comp["ratios"]["slow"]["time_to_level"]["best"]
    assert comp["own_best"]["ratios"]["slow"] == {"not_reached": "slow 2/3 seeds"}
    md = _markdown(result)
    assert "not reached" in md and "not separated" in md
    assert "| 2/3 (**not reached** by all) |" in md and "| not computed | – |" in md
    # The ratio's own interval may exclude 1 while the two intervals overlap: shown, but not stated as a difference.
    assert "excludes 1.00 (above)" in md


def test_report_only_reads_a_single_seed_bench_json(tmp_path: Path) -> None:
    """A bench.json from before seeds (no ``runs``; ``algorithms`` are single runs) and before reference forwards
    were counted apart re-renders as n=1 per algorithm."""
    legacy = {}
    for name, s_iter in (("a", 1.0), ("b", 2.0)):
        run = _run(name, 0, [0, 1, 2], {"eval/r": [0.1, 0.2, 0.3]}, s_iter)
        old_keys = ("algorithm", "seed", "preset", "train_rewards", "reference_forwards")
        legacy[name] = {k: v for k, v in run.items() if k not in old_keys}
        del legacy[name]["predicted_s_per_iter"]["reference_forward_s"]
    old = {
        "machine": _machine(),
        "calibration": _calib(),
        "bench_wall_s": 1.0,
        "peak_rss_gb_process": 1.0,
        "spec": {
            "schedule": "least-time",
            "time_budget_s": 2.0,
            "max_iterations": 9,
            "eval_every": 5,
            "fast": "a",
            "reference": "b",
            "algorithms": [{"name": "a"}, {"name": "b"}],
        },
        "algorithms": legacy,
    }
    (tmp_path / "bench.json").write_text(json.dumps(old))
    assert bench.main(["--report-only", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result["runs"]) == {"a/seed0", "b/seed0"}
    assert result["algorithms"]["a"]["s_per_iter"]["n"] == 1
    assert result["comparisons"]["ratios"]["a"]["s_per_iter"]["mean"] == pytest.approx(2.0)
    assert "| A | a |" in (tmp_path / "bench.md").read_text()


def _full(result: dict[str, Any]) -> dict[str, Any]:
    """A synthetic result with the machine, calibration and totals a written bench.json has."""
    return {**result, "machine": _machine(), "calibration": _calib(), "bench_wall_s": 1.0, "peak_rss_gb_process": 1.0}


def _markdown(result: dict[str, Any]) -> str:
    return bench.markdown(_full(result))


def _machine() -> dict[str, Any]:
    return {"platform": "test", "nproc": 2, "torch_threads": 2, "torch": "x", "cuda": False}


def _calib() -> dict[str, Any]:
    return {
        "batch_sizes": [1],
        "forward_s_per_row": [0.1],
        "fwd_bwd_s_per_row": [0.2],
        "decode_reward_s_per_image": 0.01,
    }


@pytest.mark.slow
def test_report_only_rerenders_from_json(tiny_result: tuple[Path, dict]) -> None:
    out, _ = tiny_result
    (out / "bench.md").unlink()
    assert bench.main(["--report-only", str(out)]) == 0
    text = (out / "bench.md").read_text()
    assert "## DanceGRPO / fast ratios" in text and "## Conclusions" in text


def test_eval_metrics_keep_every_numeric_eval_key() -> None:
    """Whatever prompt sets and judges the evaluator reports under eval/, numeric values are kept, others dropped."""
    metrics = {
        "eval/r": 1,
        "eval/heldout/r": 0.5,
        "eval/judge/clip": 0.25,
        "eval/flag": True,
        "eval/per": [1.0],
        "perf/eval_sec": 3.0,
    }
    assert bench.eval_metrics(metrics) == {"eval/r": 1.0, "eval/heldout/r": 0.5, "eval/judge/clip": 0.25}


def test_missing_metric_fails_before_training() -> None:
    spec = bench.BenchSpec(output_dir="unused", base=[], algorithms=[bench.AlgoSpec("a", "A", [])], metric="eval/x")
    b = bench.Bench(spec, host=build_host(), log=lambda msg: None)
    state: Any = bench.AlgoState(spec.algorithms[0], None, None, None, seed=3)  # type: ignore[arg-type]
    state.evals.append({"iteration": 0, "train_time_s": 0.0, "eval/r": 0.5})
    b.algos.append(state)
    with pytest.raises(RecipeError, match=r"bench.metric: 'eval/x' is not among .*a/seed3.*eval/r"):
        b._check_metric()
    spec.metric = "eval/r"
    b._check_metric()


def test_plot_has_one_panel_per_eval_metric(tmp_path: Path) -> None:
    runs = [
        _run(n, s, [0, 1, 2], {"eval/r": [0.1, 0.2, 0.3], "eval/judge": [0.3, 0.2, 0.1]}, 1.0)
        for n in ("a", "b")
        for s in (0, 1)
    ]
    result = _result(runs, ["a"], "b")
    path = bench.plot_wallclock(result, tmp_path / "p.png")
    assert path is not None and path.stat().st_size > 1000
    from PIL import Image

    with Image.open(path) as img:
        width, height = img.size
    assert height > width, "two stacked panels"


def test_build_lists_an_algorithms_problem_once_for_all_seeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    path = tmp_path / "b.yaml"
    path.write_text(
        f"bench: {{output_dir: {tmp_path / 'out'}, base: [recipes/bench/digits/base.yaml], seeds: [0, 1, 2]}}\n"
        "algorithms:\n"
        "  - {name: bad, recipes: [recipes/bench/digits/dancegrpo.yaml], overrides: {sampler.colour: red}}\n"
        "  - {name: good, recipes: [recipes/bench/digits/dancegrpo.yaml]}\n"
    )
    spec = bench.load_bench(str(path))
    with pytest.raises(RecipeError) as info:
        bench.Bench(spec, host=build_host(), log=lambda msg: None).build()
    problems = info.value.problems
    assert problems and all(p.startswith("bad: ") for p in problems)
    assert len(problems) == len(set(problems)) and any("colour" in p for p in problems)
    assert not (tmp_path / "out").exists(), "nothing is written before every recipe validates"


def test_bench_binds_its_time_budget_to_a_learning_rate_schedule_over_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """recipes/bench/digits/lr_decay_budget.yaml decays the LR to 0 at the end of bench.time_budget_s: the bench fills
    in the schedule's budget_s (rlpost.engine.lr_schedule.bind_time_budget) before validating the arm."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(SD3Policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))
    digits = "recipes/bench/digits"
    algo = bench.AlgoSpec("decay", "Decay", [f"{digits}/treegrpo_paper.yaml", f"{digits}/lr_decay_budget.yaml"])
    spec = bench.BenchSpec(
        output_dir=str(tmp_path), base=[f"{digits}/base.yaml"], algorithms=[algo], time_budget_s=80.0
    )
    recipe = bench.Bench(spec, host=build_host(), log=lambda msg: None)._recipe(algo, 3)
    assert recipe.config["lr_scheduler"] == {
        "class_path": "rlpost.RunLengthLR",
        "init_args": {"shape": "linear", "warmup": 0.0, "final": 0.0, "over": "time", "budget_s": 80.0},
    }
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = recipe.lr_scheduler(optimizer)
    scheduler.end_step(60.0)
    scheduler.begin_step(1, 1000)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25)  # 60 of the bench's 80 s spent


def test_bench_binds_its_time_budget_to_a_sampler_schedule_over_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampler whose schedule runs over time (MixGRPO's ``shift_over: time``) gets bench.time_budget_s as its
    budget_s; a recipe's own budget is kept."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(SD3Policy, "setup", lambda self, device: pytest.fail("validation loaded a model"))
    digits = "recipes/bench/digits"
    over = {"sampler.init_args.shift_over": "time"}
    arms = [
        bench.AlgoSpec("mix", "Mix", [f"{digits}/mixgrpo.yaml"], over),
        bench.AlgoSpec("own", "Own", [f"{digits}/mixgrpo.yaml"], {**over, "sampler.init_args.budget_s": 30.0}),
    ]
    spec = bench.BenchSpec(output_dir=str(tmp_path), base=[f"{digits}/base.yaml"], algorithms=arms, time_budget_s=80.0)
    runner = bench.Bench(spec, host=build_host(), log=lambda msg: None)
    assert runner._recipe(arms[0], 3).config["sampler"]["init_args"]["budget_s"] == 80.0
    assert runner._recipe(arms[1], 3).config["sampler"]["init_args"]["budget_s"] == 30.0
