"""Component registries: self-naming, base-class checks, duplicates, did-you-mean."""

from __future__ import annotations

from typing import ClassVar

import pytest

from rlpost.core.api import RewardSource, Sampler
from rlpost.core.registry import DuplicateComponentError, Registry
from tests.toy_components import ToyChainSampler, ToyMeanReward


def test_register_and_lookup():
    reg: Registry[RewardSource] = Registry("reward", RewardSource)
    reg.set_provenance("toys", "rlpost-toys")
    reg(ToyMeanReward)
    entry = reg.get("toy-brightness")
    assert entry.cls is ToyMeanReward and entry.distribution == "rlpost-toys"
    assert entry.class_path == "tests.toy_components.ToyMeanReward"
    reg(ToyMeanReward)  # registering the same class again is harmless
    assert reg.names() == ["toy-brightness"]


def test_wrong_base_and_bad_names_are_rejected():
    reg: Registry[Sampler] = Registry("sampler", Sampler)
    with pytest.raises(TypeError, match="subclasses of Sampler"):
        reg(ToyMeanReward)  # type: ignore[arg-type]

    class NoName(ToyChainSampler):
        name: ClassVar[str] = "Bad Name"

    with pytest.raises(TypeError, match="kebab-case"):
        reg(NoName)


def test_duplicate_names_name_both_distributions():
    reg: Registry[RewardSource] = Registry("reward", RewardSource)
    reg.set_provenance("a", "dist-a")
    reg(ToyMeanReward)

    class Other(ToyMeanReward):
        pass

    reg.set_provenance("b", "dist-b")
    with pytest.raises(DuplicateComponentError, match=r"'toy-brightness' is registered twice.*dist-a.*dist-b"):
        reg(Other)


def test_unknown_name_suggests():
    reg: Registry[RewardSource] = Registry("reward", RewardSource)
    reg(ToyMeanReward)
    with pytest.raises(KeyError, match="did you mean 'toy-brightness'"):
        reg.get("toy-brightnes")
