"""Meta-tests (datasette's pattern): every hook spec is documented in docs/plugin_hooks.md with its arguments and an
example implementing it, every python block of the page compiles, every hook has a ``test_hook_<name>`` test, and
the examples run: registered together (each as a plugin module of its own), they train a toy run and resume it."""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from rlpost.apps.host import build_host
from rlpost.core import hookspecs
from rlpost.core.contract import RewardScores
from rlpost.engine.checkpoint import find_checkpoint, read_checkpoint
from rlpost.engine.recipe import validate
from rlpost.engine.runner import Runner
from tests import toy_components

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "plugin_hooks.md"
HOOKS = [name for name in hookspecs.__all__ if name.startswith("rlpost_")]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _sections() -> dict[str, str]:
    """Hook name -> its section of docs/plugin_hooks.md (from its ``###`` heading to the next heading)."""
    parts = re.split(r"^(?=##+ )", DOC.read_text(), flags=re.M)
    return {m.group(1): part for part in parts if (m := re.match(r"### (rlpost_\w+)\(", part))}


def _examples() -> dict[str, str]:
    """Hook name -> the python code of its section's example blocks."""
    return {hook: "\n".join(PYTHON_BLOCK.findall(text)) for hook, text in _sections().items()}


def _example_module(hook: str) -> types.ModuleType:
    """The hook's example as a plugin module of its own (``hook_example_<hook>``)."""
    module = types.ModuleType(f"hook_example_{hook}")
    exec(compile(_examples()[hook], f"docs/plugin_hooks.md ({hook} example)", "exec"), module.__dict__)
    return module


def test_every_spec_is_exported():
    defined = {n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("rlpost_")}
    assert defined == set(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_with_arguments(hook):
    doc = (ROOT / "docs" / "plugin_hooks.md").read_text()
    args = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    assert f"### {hook}({args})" in doc, f"docs/plugin_hooks.md lacks a heading '### {hook}({args})'"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_docstring_with_params(hook):
    fn = getattr(hookspecs, hook)
    doc = inspect.getdoc(fn) or ""
    for arg in inspect.signature(fn).parameters:
        assert f":param {arg}:" in doc, f"{hook} docstring does not document {arg}"


def _test_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_hook_"):
                names.add(node.name)
    return names


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    names = _test_names()
    assert any(n == f"test_hook_{hook}" or n.startswith(f"test_hook_{hook}_") for n in names), (
        f"no test named test_hook_{hook}[_...] in tests/"
    )


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_section_has_an_example_implementing_it(hook):
    code = _examples().get(hook, "")
    assert code, f"docs/plugin_hooks.md: the {hook} section has no ```python example"
    implemented = [
        node.name
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == "hookimpl" for d in node.decorator_list)
    ]
    assert hook in implemented, f"the {hook} example implements {implemented}, not {hook}"


def test_every_python_block_of_the_page_compiles():
    blocks = PYTHON_BLOCK.findall(DOC.read_text())
    assert len(blocks) > len(HOOKS)  # one per hook, plus the whole-plugin example
    for i, block in enumerate(blocks):
        compile(block, f"docs/plugin_hooks.md (python block {i})", "exec")


def test_examples_train_a_toy_run_and_resume_it(tmp_path, capsys, monkeypatch):
    """Every example registered as its own plugin; the sampler, estimator, reward, update rule and prompt source of
    the registration examples train the toy policy for 10 steps, the lifecycle examples observe it, and a resume
    restores the saved state."""
    modules = {hook: _example_module(hook) for hook in HOOKS}
    for module in modules.values():  # importable, as an installed plugin is: recipes resolve its class paths
        monkeypatch.setitem(sys.modules, module.__name__, module)
    host = build_host(load_entrypoints=False, extra_plugins=(toy_components, *modules.values()))
    failed = {i.name: i.error for i in host.plugins() if i.error is not None}
    assert not failed, failed
    # The model example is built (its weights are never loaded in a test).
    model = host.registry("model").get("sd35-large-lora").cls()
    assert (model.pretrained, model.resolution, model.lora.rank) == ("stabilityai/stable-diffusion-3.5-large", 1024, 16)

    run = tmp_path / "run"

    def cfg(max_steps: int) -> dict:
        return {
            "run": {"seed": 0, "output_dir": str(run), "max_steps": max_steps, "groups_per_step": 2,
                    "samples_per_group": 3, "device": "cpu", "progress": False},
            "model": {"class_path": "toy-policy"},
            "prompts": {"class_path": "colour-shapes", "init_args": {"colours": ["red", "green"], "shapes": ["cube"]}},
            "sampler": {"class_path": "sde-chains", "init_args": {"num_steps": 4}},
            "rewards": [{"class_path": "redness", "init_args": {"gamma": 2.0}}],
            "advantage": {"class_path": "group-rank"},
            "optimizer": {"class_path": "plain-pg"},
            "torch_optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}},
            "checkpoint": {"every": 5, "keep_last": 2},
        }  # fmt: skip

    runner = Runner(validate(cfg(10), host), host)
    history = runner.run()
    out = capsys.readouterr().out
    assert f"sde-chains, 10 steps, into {run}" in out  # rlpost_before_run
    assert "step 10: reward " in out  # rlpost_after_step
    assert (run / "first_sample_000000.png").is_file()  # rlpost_after_rollout
    assert 0 < runner.ctx.stash[modules["rlpost_after_advantages"].ABS_ADVANTAGE] <= 1  # rlpost_after_advantages
    # The registration examples' components did the training.
    assert float(runner.recipe.model.a) != -1.0  # the toy policy's initial scale moved
    assert {"loss/policy", "train/grad_norm", "adv/rank_abs_mean", "reward/redness"} <= history[-1].keys()
    assert history[-1]["train/lr"] == pytest.approx(0.1)
    summary = json.loads((run / "my_summary.json").read_text())  # rlpost_after_run
    assert summary == {"status": "completed", "steps": 10, "best_reward": max(m["reward/weighted"] for m in history)}
    # rlpost_save_state: the prompts seen, in the checkpoint; rlpost_load_state restores them on resume.
    seen = modules["rlpost_save_state"].seen_prompts
    assert seen == {"a red cube", "a green cube"}
    _, state, _ = read_checkpoint(find_checkpoint("latest", run))
    assert state["plugins"]["seen-prompts"] == sorted(seen)
    restored = modules["rlpost_load_state"].seen_prompts
    assert restored == set()
    Runner(validate(cfg(12), host), host, resume="latest").run()
    assert restored == seen
    # rlpost_after_rewards warns about a reward that gave every image the same score.
    flat = RewardScores({"flat": torch.ones(3)}, {"flat": 1.0})
    with pytest.warns(UserWarning, match="reward 'flat' gave every image the same score"):
        modules["rlpost_after_rewards"].rlpost_after_rewards(runner.ctx, None, flat)
