"""The field comparisons of the bench (rlpost/bench/field.py) and their report sections (rlpost/bench/field_tables.py),
on synthetic results whose answers are known."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from rlpost import bench
from rlpost.bench.field import alarm_verdicts, field_comparisons
from rlpost.bench.field_tables import field_tables
from rlpost.engine.evaluation import image_dir
from rlpost.engine.recipe import RecipeError
from tests.unit.test_bench import _full, _markdown, _result, _run

KEY, JUDGE = "eval/r", "eval/r/judge/j"


def _field(levels: list[float], claims: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """Three algorithms, three seeds, evaluations at 0, 5, 10, 15 s of training:

    * ``tree`` (fast) reaches 0.8 at 5 s in every seed and ends at 0.9;
    * ``peer`` reaches 0.8 at 10 s and ends at 0.82-0.84 (the best peer); its judge peaks at 0.9 and falls to 0.6;
    * ``slow`` reaches 0.8 only in seed 0 (at 15 s) and ends at 0.81, 0.7, 0.7.
    """
    runs = []
    for seed in range(3):
        runs.append(_run("tree", seed, [0, 5, 10, 15], {KEY: [0.5, 0.8, 0.85, 0.9], JUDGE: [0.5, 0.7, 0.8, 0.8]}, 1.0))
        runs.append(
            _run(
                "peer",
                seed,
                [0, 5, 10, 15],
                {KEY: [0.5, 0.7, 0.8, 0.82 + 0.01 * seed], JUDGE: [0.5, 0.9, 0.7, 0.6]},
                2.0 + 0.1 * seed,
            )
        )
        final = 0.81 if seed == 0 else 0.7
        runs.append(_run("slow", seed, [0, 5, 10, 15], {KEY: [0.5, 0.6, 0.7, final], JUDGE: [0.5] * 4}, 3.0))
    result = _result(runs, ["tree"], "peer")
    result["spec"]["metric"] = KEY
    result["spec"]["levels"] = levels
    result["spec"]["claims"] = claims or []
    result["field"] = field_comparisons(result)
    return result


def test_time_to_fixed_levels_censors_unreached_seeds_at_their_training_time() -> None:
    field = _field([0.8])["field"]
    fixed, best_peer = field["levels"]
    assert fixed["source"] == "fixed" and fixed["level"] == 0.8
    tree, peer, slow = (fixed["by_algorithm"][n] for n in ("tree", "peer", "slow"))
    assert tree["times_s"] == [5.0] * 3 and tree["reached"] == 3 and not any(tree["censored"])
    assert peer["times_s"] == [10.0] * 3
    # slow reached 0.8 only in seed 0 (0.81 at 15 s); seeds 1 and 2 count their whole 15 s of training.
    assert slow["reached"] == 1 and slow["censored"] == [False, True, True] and slow["times_s"] == [15.0] * 3
    assert slow["iterations"] == [15, None, None]
    # The judge where the level was first reached: tree's 0.7 at 5 s, peer's 0.7 at 10 s, slow's 0.5 (seed 0 only).
    assert tree["judges"][JUDGE]["mean"] == pytest.approx(0.7) and peer["judges"][JUDGE]["mean"] == pytest.approx(0.7)
    assert slow["judges"][JUDGE]["n"] == 1 and slow["judges"][JUDGE]["mean"] == 0.5
    assert fixed["fastest"] == "tree" and set(fixed["ahead_of"]) == {"peer", "slow"} and not fixed["not_separated"]
    # The best peer's level: the highest mean final among the non-fast algorithms (peer: mean of 0.82, 0.83, 0.84).
    assert best_peer["source"] == "best peer: peer" and best_peer["level"] == pytest.approx(0.83)
    assert best_peer["by_algorithm"]["tree"]["times_s"] == [10.0] * 3
    assert best_peer["by_algorithm"]["peer"]["reached"] == 2  # seed 0 ends at 0.82 < 0.83


def test_no_algorithm_is_ahead_where_intervals_overlap() -> None:
    runs = []
    for seed, t in enumerate([4.0, 6.0, 8.0]):
        runs.append(_run("a", seed, [0, t, 20], {KEY: [0.5, 0.8, 0.8]}, 1.0))
        runs.append(_run("b", seed, [0, t + 1.0, 20], {KEY: [0.5, 0.8, 0.8]}, 1.0))
    result = _result(runs, ["a"], "b")
    result["spec"]["levels"] = [0.8]
    level = field_comparisons(result)["levels"][0]
    assert level["fastest"] == "a" and level["ahead_of"] == [] and level["not_separated"] == ["b"]


def test_ranking_late_fall_and_alarm_columns() -> None:
    result = _field([0.8])
    field = result["field"]
    ranking = field["ranking"][KEY]
    assert ranking["top"] == "tree" and set(ranking["above"]) == {"peer", "slow"}
    assert field["ranking"][JUDGE]["top"] == "tree"
    fall = field["late_fall"]
    assert fall[JUDGE]["peer"]["mean"] == pytest.approx(0.3)  # best 0.9, final 0.6
    assert fall[JUDGE]["tree"]["mean"] == 0.0 and fall[KEY]["tree"]["mean"] == 0.0
    assert field["alarm"]["tree"] == [None, None, None]  # runs without a replayed verdict
    result["runs"]["peer/seed1"]["alarm"] = {
        "fired_iteration": 10,
        "reasons": ["r +0.1 over the last 3 evaluations while judge j fell 0.3 below its best"],
        "max_judge_drop": 0.3,
    }
    result["field"] = field_comparisons(result)
    md = _markdown(result)
    assert "## The field: time to held-out levels of `eval/r`" in md
    assert "| TREE | tree-preset | 3/3: 5.0 | 3/3: 10.0 |" in md
    assert "| SLOW | slow-preset | 1/3: >=15.0 |" in md
    assert "Second judge `eval/r/judge/j` at the evaluation where each level was first reached" in md
    assert "| SLOW | slow-preset | 0.500 (n=1) |" in md
    assert "fastest TREE; ahead with separated intervals of PEER, SLOW; not separated from none." in md
    assert "| –, **fired @ it 10** (judge), – |" in md


def test_claims_compare_the_pair_and_say_where_a_fast_seed_fell_short() -> None:
    claims = [
        {"fast": "tree", "slow": "peer", "published": "2x (paper)"},
        {"fast": "slow", "slow": "peer", "published": "25x (paper)"},
    ]
    field = _field([], claims)["field"]
    assert [lv["source"] for lv in field["levels"]] == ["best peer: peer"]
    tree, slow = field["claims"]
    # s/iter: peer's medians 2.0-2.2 over tree's 1.0.
    assert tree["s_per_iter"]["mean"] == pytest.approx(2.1) and tree["s_per_iter"]["vs_1"] == "separated"
    # peer's per-seed bests are its finals (0.82-0.84, at 15 s): level 0.83; tree first reaches it at 10 s.
    ratio = tree["own_best"]["ratios"]["tree"]
    assert ratio["mean"] == pytest.approx(15.0 / 10.0)
    assert "not_reached" in slow["own_best"]["ratios"]["slow"]
    md = "\n".join(field_tables(_field([], claims), _field([], claims)["algorithms"]))
    assert "| TREE | PEER | 2x (paper) | 2.10x" in md and "| SLOW | PEER | 25x (paper) |" in md
    assert "not computed | 0/3 |" in md


def test_bench_recipe_levels_and_claims_are_checked(tmp_path: Path) -> None:
    recipe = tmp_path / "b.yaml"
    recipe.write_text(
        "bench: {base: [], levels: [0.8, x], claims: [{fast: a, slow: zz, published: p}, {fast: a}]}\n"
        "algorithms: [{name: a, recipes: []}]\n"
    )
    with pytest.raises(RecipeError) as err:
        bench.load_bench(str(recipe))
    text = str(err.value)
    assert "bench.levels: a list of held-out metric values" in text
    assert "bench.claims[0]: slow='zz' not among the algorithms ['a']" in text
    assert "bench.claims[1]: give exactly fast, slow and published" in text
    recipe.write_text(
        "bench: {base: [], levels: [0.8], claims: [{fast: a, slow: b, published: p}]}\n"
        "algorithms: [{name: a, recipes: []}, {name: b, recipes: []}]\n"
    )
    spec = bench.load_bench(str(recipe))
    assert spec.levels == [0.8] and spec.claims == [{"fast": "a", "slow": "b", "published": "p"}]


def _saved_run(run_dir: Path, judge: list[float]) -> None:
    """A finished run directory as the evaluator writes it: eval.jsonl with per-prompt scores and the PNGs."""
    (run_dir / "metrics.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"reward/r": 0.5}) + "\n")
    lines = []
    for i, (r, j) in enumerate(zip([0.5, 0.6, 0.7, 0.8], judge, strict=True)):
        step = 5 * i
        folder = image_dir(run_dir, "s", step)
        folder.mkdir(parents=True)
        for k in range(2):
            Image.fromarray(np.full((8, 8, 3), 128, np.uint8)).save(folder / f"{k:04d}.png")
        rows = [{"set": "s", "prompt": f"p{k}", "seed": k, "r": r, "judge/j": j} for k in range(2)]
        lines.append(json.dumps({"step": step, "sets": ["s"], "judges": ["j"], "per_prompt": rows}))
    (run_dir / "eval.jsonl").write_text("\n".join(lines) + "\n")


def test_alarm_verdicts_replay_each_run_and_name_what_cannot_be_replayed(tmp_path: Path) -> None:
    _saved_run(tmp_path / "hacked", [0.9, 0.9, 0.7, 0.6])  # reward rises while the judge falls 0.3
    _saved_run(tmp_path / "honest", [0.5, 0.6, 0.7, 0.8])
    result = {
        "runs": {
            "hacked/seed0": {"run_dir": str(tmp_path / "hacked")},
            "honest/seed0": {"run_dir": str(tmp_path / "honest")},
            "gone/seed0": {"run_dir": str(tmp_path / "missing")},
            "kept/seed0": {"run_dir": "x", "alarm": {"fired_iteration": None}},
        }
    }
    alarm_verdicts(result)
    runs = result["runs"]
    assert runs["hacked/seed0"]["alarm"]["fired_iteration"] == 10
    assert runs["hacked/seed0"]["alarm"]["max_judge_drop"] == pytest.approx(0.3)
    assert runs["honest/seed0"]["alarm"] == {"fired_iteration": None, "reasons": [], "max_judge_drop": 0.0}
    assert runs["gone/seed0"]["alarm"]["error"].startswith("FileNotFoundError")
    assert runs["kept/seed0"]["alarm"] == {"fired_iteration": None}  # a recorded verdict is not replayed again


def test_report_only_with_a_recipe_takes_its_levels_and_claims(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    result = _field([])
    (tmp_path / "bench.json").write_text(json.dumps(_full(result)))
    recipe = tmp_path / "b.yaml"
    algorithms = "algorithms: [{name: tree, recipes: []}, {name: peer, recipes: []}, {name: slow, recipes: []}]\n"
    recipe.write_text(
        "bench: {base: [], levels: [0.75], claims: [{fast: tree, slow: peer, published: 2x}]}\n" + algorithms
    )
    assert bench.main(["--report-only", str(tmp_path), "--recipe", str(recipe)]) == 0
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["spec"]["levels"] == [0.75] and written["field"]["levels"][0]["level"] == 0.75
    assert "| TREE | PEER | 2x |" in (tmp_path / "bench.md").read_text()
    # Runs without a directory get a named reason instead of a verdict.
    assert written["runs"]["tree/seed0"]["alarm"] == {"error": "no run directory recorded"}
    recipe.write_text("bench: {base: []}\nalgorithms: [{name: tree, recipes: []}]\n")
    with pytest.raises(SystemExit):
        bench.main(["--report-only", str(tmp_path), "--recipe", str(recipe)])
    assert "its algorithms ['tree'] are not the result's ['peer', 'slow', 'tree']" in capsys.readouterr().err


def test_alarm_causes_are_named_from_the_detectors_reasons() -> None:
    from rlpost.bench.field_tables import _causes

    reasons = [
        "digit-alignment +0.072 over the last 3 evaluations while image brightness drifted +0.088 from step 0",
        "digit-alignment +0.072 over the last 3 evaluations while image diversity drifted +0.099 from step 0",
        "digit-alignment +0.037 over the last 3 evaluations while judge digit-judge fell 0.149 below its best",
    ]
    assert _causes(reasons) == "brightness+diversity+judge"
    assert _causes(reasons[2:]) == "judge"
