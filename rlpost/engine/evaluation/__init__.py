"""Held-out evaluation: fixed prompts and seeds, deterministic ODE sampling, the training rewards and second judges.

One module per responsibility:

* :mod:`~rlpost.engine.evaluation.config`: the recipe's ``eval`` section (settings, the validated :class:`EvalSpec`);
  :mod:`~rlpost.engine.evaluation.section` validates it (the recipe's validation calls :func:`validate_eval`);
* :mod:`~rlpost.engine.evaluation.prompt_sets`: ``eval.prompts`` / ``eval.sets``, checked and loaded;
* :mod:`~rlpost.engine.evaluation.judges`: the evaluation rewards and second judges, checked and scoring a set;
* :mod:`~rlpost.engine.evaluation.sampler`: the Euler-ODE sampler, shared with ``rlpost sample``;
* :mod:`~rlpost.engine.evaluation.alarm`: the reward-hacking alarm and its inputs (``eval.alarm``);
* :mod:`~rlpost.engine.evaluation.records`: ``eval.jsonl`` lines and ``eval.md`` tables, and their readers;
* :mod:`~rlpost.engine.evaluation.grids`: captioned grids and per-image PNGs;
* :mod:`~rlpost.engine.evaluation.keys`: metric keys, set names, image directories, the stash key;
* :mod:`~rlpost.engine.evaluation.evaluator`: :class:`Evaluator` and :func:`run`, the runner's one entry point.
"""

from __future__ import annotations

from rlpost.engine.evaluation.alarm import STATS, AlarmConfig, RewardHackingAlarm, image_stats, ls_change
from rlpost.engine.evaluation.config import SETTING_HELP, ComponentChecks, EvalSettings, EvalSpec
from rlpost.engine.evaluation.evaluator import Evaluator, run
from rlpost.engine.evaluation.keys import JUDGE, LAST_EVAL, SET_NAME_RE, image_dir, metric_key, set_field
from rlpost.engine.evaluation.records import eval_columns, eval_sets, markdown_table, read_evals, write_table
from rlpost.engine.evaluation.sampler import ode_sample
from rlpost.engine.evaluation.section import component_problems, validate_eval

__all__ = [
    "JUDGE",
    "LAST_EVAL",
    "SETTING_HELP",
    "SET_NAME_RE",
    "STATS",
    "AlarmConfig",
    "ComponentChecks",
    "EvalSettings",
    "EvalSpec",
    "Evaluator",
    "RewardHackingAlarm",
    "component_problems",
    "eval_columns",
    "eval_sets",
    "image_dir",
    "image_stats",
    "ls_change",
    "markdown_table",
    "metric_key",
    "ode_sample",
    "read_evals",
    "run",
    "set_field",
    "validate_eval",
    "write_table",
]
