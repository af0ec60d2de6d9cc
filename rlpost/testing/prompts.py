"""``check_prompt_source``: a :class:`~rlpost.core.api.PromptSource` against its contract.

The core loads a source once and shuffles what it returned per epoch from the run's seed (``PromptStream``), so a
resumed run sees the same order only if ``load`` is deterministic. Rules: ``load()`` returns a non-empty list of
``(prompt, metadata)`` pairs, each prompt a non-empty ``str`` and each metadata a ``dict`` with ``str`` keys, and two
loads return the same pairs.
"""

from __future__ import annotations

from rlpost.core.api import PromptSource
from rlpost.testing.violations import Checker

__all__ = ["check_prompt_source"]


def check_prompt_source(source: PromptSource) -> list[tuple[str, dict[str, object]]] | None:
    """Check ``source`` against the prompt-source contract (the module docstring lists the rules).

    Returns:
        What ``load()`` returned, or ``None`` when it raised.

    Raises:
        ConformanceError: Listing every broken rule.
    """
    check = Checker("prompt source", source)
    items = check.call("load()", source.load)
    if items is None:
        check.done()
        return None
    if check.expect(isinstance(items, list) and bool(items), f"load() must return a non-empty list, got {items!r:.80}"):
        bad = [
            i
            for i, item in enumerate(items)
            if not (
                isinstance(item, tuple)
                and len(item) == 2
                and isinstance(item[0], str)
                and item[0].strip()
                and isinstance(item[1], dict)
                and all(isinstance(k, str) for k in item[1])
            )
        ]
        check.expect(not bad, f"load() items {bad[:5]} are not (non-empty prompt, metadata dict with str keys) pairs")
        again = check.call("load()", source.load)
        check.expect(again is None or again == items, "two load() calls returned different prompts")
    check.done()
    return items
