"""The conformance kit: check a sampler, advantage estimator, reward source, update rule, model adapter or prompt
source against the component contract, on a tiny real-architecture model, in a plugin's own test suite::

    from rlpost.testing import check_reward_source

    def test_redness_conforms():
        check_reward_source(Redness())

Each ``check_*`` runs the component the way the engine does, collects every broken rule (what each checks: its
module's docstring) and raises one :class:`ConformanceError` listing them all; it returns normally when the
component conforms. Samplers, estimators and update rules are held to what they declare (``provides`` /
``requires``, ``docs/writing_plugins.md`` "Capabilities"): a likelihood-free rule and a sampler without edge
log-probs are not asked for what only the clipped surrogate needs. The pytest plugin
:mod:`rlpost.testing.pytest_plugin` provides a tiny SD3 policy for the checks that need one
(``rlpost_tiny_policy``). rlpost's own suite runs the kit over every first-party component
(``tests/meta/test_conformance.py``); ``docs/writing_plugins.md`` ("Test your plugin with rlpost.testing") shows the
rest.
"""

from __future__ import annotations

from rlpost.testing.estimator import check_advantage_estimator
from rlpost.testing.inputs import (
    PROMPTS,
    prompt_batch,
    sample_images,
    sample_media,
    sample_rollout,
    sample_scores,
    tiny_policy,
)
from rlpost.testing.policy import check_policy
from rlpost.testing.prompts import check_prompt_source
from rlpost.testing.reward import check_reward_source
from rlpost.testing.sampler import check_sampler
from rlpost.testing.update_rule import check_update_rule, signed_advantages
from rlpost.testing.violations import ConformanceError

__all__ = [
    "PROMPTS",
    "ConformanceError",
    "check_advantage_estimator",
    "check_policy",
    "check_prompt_source",
    "check_reward_source",
    "check_sampler",
    "check_update_rule",
    "prompt_batch",
    "sample_images",
    "sample_media",
    "sample_rollout",
    "sample_scores",
    "signed_advantages",
    "tiny_policy",
]
