"""The field keys of a bench recipe's ``bench`` section (:mod:`rlpost.bench.field`): ``levels``, fixed values of
the primary held-out metric, and ``claims``, pairs of algorithms with a published speed-up; each problem is named by
its field."""

from __future__ import annotations

from typing import Any

from rlpost.core.yaml_limits import short_repr

__all__ = ["parse_claims", "parse_levels"]


def parse_levels(value: Any, problems: list[str]) -> list[float]:
    """``bench.levels``: a list of numbers (held-out metric values), fixed before the bench runs."""
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        problems.append(f"bench.levels: a list of held-out metric values, got {short_repr(value)}")
        return []
    return [float(v) for v in value]


def parse_claims(value: Any, names: list[str], problems: list[str]) -> list[dict[str, str]]:
    """``bench.claims``: ``[{fast: NAME, slow: NAME, published: "what the paper claims, where"}]``."""
    if value is None:
        return []
    if not isinstance(value, list):
        problems.append(f"bench.claims: a list of {{fast, slow, published}}, got {short_repr(value)}")
        return []
    out = []
    for i, claim in enumerate(value):
        if not isinstance(claim, dict) or set(claim) != {"fast", "slow", "published"}:
            problems.append(f"bench.claims[{i}]: give exactly fast, slow and published, got {short_repr(claim)}")
            continue
        bad = [f"{k}={claim[k]!r}" for k in ("fast", "slow") if claim[k] not in names]
        if bad:
            problems.append(f"bench.claims[{i}]: {', '.join(bad)} not among the algorithms {names}")
            continue
        out.append({k: str(claim[k]) for k in ("fast", "slow", "published")})
    return out
