"""Contested component names: the first registrant keeps the name, the refused claim is remembered, and an
unqualified lookup of a contested name is refused naming every claimant; ``dist:name`` chooses."""

from __future__ import annotations

import pytest

from rlpost.core.api import RewardSource
from rlpost.core.registry import ContestedComponentError, DuplicateComponentError, Registry
from tests.toy_components import ToyMeanReward


class Impostor(ToyMeanReward):
    """Same name ('toy-brightness'), different class."""


class Harmless(ToyMeanReward):
    name = "harmless"


def _contested() -> Registry[RewardSource]:
    reg: Registry[RewardSource] = Registry("reward", RewardSource)
    reg.set_provenance("rewards", "rlpost")
    reg(ToyMeanReward)
    reg.set_provenance("evil", "evil-dist")
    with pytest.raises(DuplicateComponentError, match="second registration is refused.*always stay with rlpost"):
        reg(Impostor)
    return reg


def test_first_registrant_keeps_the_name_and_the_contest_is_remembered():
    reg = _contested()
    assert [c.distribution for c in reg.claims("toy-brightness")] == ["rlpost", "evil-dist"]
    assert list(reg.contested()) == ["toy-brightness"]
    with pytest.raises(ContestedComponentError) as err:
        reg.get("toy-brightness")
    text = str(err.value)
    for needle in ("'rlpost'", "'evil-dist'", "'rlpost:toy-brightness'", "RLPOST_BLOCK_PLUGINS=evil-dist"):
        assert needle in text, text
    assert f"{Impostor.__module__}.{Impostor.__qualname__}" in text  # the explicit way to the other one


def test_qualified_lookup_chooses_and_normalises_the_distribution():
    reg = _contested()
    assert reg.get("rlpost:toy-brightness").cls is ToyMeanReward
    assert "rlpost:toy-brightness" in reg and "evil-dist:toy-brightness" not in reg
    refused = "of distribution 'evil-dist' was refused.*block plugin 'rewards'"
    with pytest.raises(ContestedComponentError, match=refused):
        reg.get("Evil_Dist:toy-brightness")  # PEP 503 normalisation: Evil_Dist == evil-dist
    with pytest.raises(KeyError, match="does not come from distribution 'other'"):
        reg.get("other:toy-brightness")
    with pytest.raises(KeyError, match="unknown reward 'rlpost:nope'"):
        reg.get("rlpost:nope")


def test_removed_plugin_keeps_its_claims():
    reg: Registry[RewardSource] = Registry("reward", RewardSource)
    reg.set_provenance("evil", "evil-dist")
    reg(Harmless)
    assert reg.remove_plugin("evil") == ["harmless"]
    assert "harmless" not in reg
    with pytest.raises(ContestedComponentError, match="none of them registered it|was refused"):
        reg.get("harmless")
    reg.set_provenance("other", "other-dist")

    class Late(ToyMeanReward):
        name = "harmless"

    reg(Late)  # a later plugin gets the free name, but it stays contested: a recipe must choose
    with pytest.raises(ContestedComponentError, match="'evil-dist'.*'other-dist'"):
        reg.get("harmless")


def test_uncontested_names_resolve_as_before():
    reg: Registry[RewardSource] = Registry("reward", RewardSource)
    reg.set_provenance("a", "dist-a")
    reg(ToyMeanReward)
    reg(ToyMeanReward)  # same class again: no claim, no contest
    assert reg.get("toy-brightness").cls is ToyMeanReward and reg.contested() == {}
