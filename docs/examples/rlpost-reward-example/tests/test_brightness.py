from __future__ import annotations

import rlpost_reward_example
import torch
from rlpost_reward_example import Brightness

from rlpost.testing import check_reward_source


def test_brightness_scores_and_registers() -> None:
    images = torch.stack([torch.zeros(4, 4, 3), torch.full((4, 4, 3), 255.0)]).to(torch.uint8)
    scores = Brightness().score(images, ["a", "b"], [{}, {}])
    assert scores.tolist() == [0.0, 1.0]
    registered: list[type] = []
    rlpost_reward_example.rlpost_register_reward_sources(registered.append)
    assert registered == [Brightness]


def test_brightness_meets_the_reward_contract() -> None:
    # rlpost's conformance kit: finite [S] float scores, independent of the batch, deterministic, inputs untouched.
    check_reward_source(Brightness())
