"""YAML reading with limits, for files a user may have been handed by someone else (recipes, overlays, overrides).

``yaml.safe_load`` never runs code, but it will happily build a "billion laughs" document: nine anchors of nine
aliases each are ~500 bytes of text and 9**9 values once expanded (PyYAML shares the aliased objects, so building
is cheap; everything that walks the result afterwards, validation, ``repr`` in an error message, a deep copy,
pays the full expansion). Deep nesting (``[[[[...]]]]``) overflows PyYAML's recursive composer with a
``RecursionError``. :func:`load_yaml` counts while PyYAML composes the node graph and stops at the first limit
crossed (:class:`YamlLimits`), *before* constructing any Python object, with a :class:`YamlLimitError` (a
``yaml.YAMLError``, so callers report it as "not valid YAML"):

* more than ``max_bytes`` of text;
* nesting deeper than ``max_depth``, counted with aliases expanded;
* more than ``max_nodes`` values or ``max_chars`` characters of scalar text, counted with aliases expanded
  (recursive aliases are refused outright): an alias to a long string counts the whole string each time;
* a list or mapping with more than ``max_items`` entries.

The last two bound what the *reader* of the result does, not PyYAML: jsonargparse deep-copies a whole list-typed
value once per item while checking it (the ``deepcopy(adapt_kwargs)`` in the list branch of
``jsonargparse._typehints.adapt_typehints``, jsonargparse 4.53), on every one of the ~15 passes a recipe check
makes, and builds a namespace per component of a list or mapping of components. Measured on a loaded 2-core
machine before these limits: a recipe list of 2000 prompts took 15 s to check, one of 1000 reward components
100 s, 90 000 aliases of one 500 kB prompt minutes and 20 GB. Within :data:`RECIPE_LIMITS` the slowest recipe
found (eval prompt sets of 128 prompts each, up to 4096 values) takes ~4 s there. The counting costs the size of
the *text*, not of the expansion: each node's expanded size is computed once, when it is complete, and an alias
adds its target's size.

It also refuses a mapping that repeats a key (PyYAML silently keeps the last one, so two ``sampler:`` blocks would
run the second without a word), like ruamel.yaml does by default; ``<<`` merge keys may still be overridden.

:func:`short_repr` bounds what an error message may quote of a value.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode

__all__ = [
    "MAX_BYTES",
    "MAX_CHARS",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "MAX_NODES",
    "RECIPE_LIMITS",
    "SAVED_LIMITS",
    "YamlLimitError",
    "YamlLimits",
    "load_yaml",
    "short_repr",
]

# A real recipe is a few kB, a dozen levels deep, at most ~220 values (the shipped ones) and lists of a dozen items;
# these leave room for generated ones while keeping the worst document within them quick to check.
MAX_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 4096
MAX_CHARS = MAX_BYTES
MAX_ITEMS = 128


@dataclass(frozen=True)
class YamlLimits:
    """What one YAML document may hold (see the module docstring).

    Attributes:
        max_bytes: Characters of text.
        max_depth: Nesting levels, aliases expanded.
        max_nodes: Values (scalars, lists, mappings, keys included), aliases expanded.
        max_chars: Characters of scalar text, aliases expanded.
        max_items: Entries of one list or mapping.
    """

    max_bytes: int = MAX_BYTES
    max_depth: int = MAX_DEPTH
    max_nodes: int = MAX_NODES
    max_chars: int = MAX_CHARS
    max_items: int = MAX_ITEMS


RECIPE_LIMITS = YamlLimits()
"""For what a user writes: recipes, overlays, bench recipes, command-line values."""

SAVED_LIMITS = YamlLimits(4 * MAX_BYTES, MAX_DEPTH + 16, 8 * MAX_NODES, 4 * MAX_CHARS, MAX_ITEMS)
"""For a recipe rlpost resolved and saved itself (a run directory's ``recipe.yaml``) from one within
:data:`RECIPE_LIMITS`: resolving fills in every component's defaults (more values and text, ``init_args`` levels),
so the saved file of an accepted recipe must load again; lists do not grow."""


class YamlLimitError(yaml.YAMLError):  # type: ignore[misc,unused-ignore]  # PyYAML ships no types
    """A YAML document exceeds a size, depth, alias-expansion or length limit."""


class _LimitedLoader(yaml.SafeLoader):  # type: ignore[misc,unused-ignore]
    """``SafeLoader`` whose composer counts what the document holds once aliases are expanded and stops at the first
    limit crossed; a complete node's expanded size is kept in ``_sizes`` as (values, characters, height)."""

    def __init__(self, stream: str, name: str, limits: YamlLimits) -> None:
        super().__init__(stream)
        self.name = name  # PyYAML's marks say "<unicode string>" otherwise
        self.limits = limits
        self._depth = 0
        self._values = 0
        self._chars = 0
        self._aliased = False
        self._sizes: dict[int, tuple[int, int, int]] = {}

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        limits = self.limits
        if parent is not None and len(parent.value) >= limits.max_items:  # checked before the next entry is read
            kind = "list" if isinstance(parent.value[0], Node) else "mapping"
            raise YamlLimitError(
                f"a {kind} with more than {limits.max_items} entries (line {parent.start_mark.line + 1}); longer "
                "ones are slow to check: read the values from a file (many prompts: a prompt-file)"
            )
        # PyYAML composes recursively: stop at max_depth instead of at Python's recursion limit.
        self._depth += 1
        try:
            if self._depth > limits.max_depth:
                mark = self.peek_event().start_mark
                raise YamlLimitError(f"nesting deeper than {limits.max_depth} levels (at line {mark.line + 1})")
            if self.check_event(AliasEvent):
                self._count_alias()
                return super().compose_node(parent, index)  # type: ignore[no-any-return,unused-ignore]
            node: Node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._count(node)
        return node

    def _count_alias(self) -> None:
        """Add an alias's expanded size, before PyYAML returns the node it names."""
        event = self.peek_event()
        target = self.anchors.get(event.anchor)
        if target is None:
            return  # PyYAML reports the undefined alias
        line = event.start_mark.line + 1
        size = self._sizes.get(id(target))
        if size is None:  # the anchored node is still being composed
            raise YamlLimitError(f"recursive alias (a node contains itself, line {line})")
        self._aliased = True
        if self._depth - 1 + size[2] > self.limits.max_depth:
            raise YamlLimitError(
                f"nesting deeper than {self.limits.max_depth} levels once aliases are expanded (line {line})"
            )
        self._add(size[0], size[1], line)

    def _count(self, node: Node) -> None:
        """Record a newly composed node's expanded size and add its own value (its children are counted already)."""
        line = node.start_mark.line + 1
        if isinstance(node, ScalarNode):
            self._sizes[id(node)] = (1, len(node.value), 1)
            self._add(1, len(node.value), line)
            return
        children = [n for pair in node.value for n in pair] if isinstance(node, MappingNode) else node.value
        sizes = [self._sizes[id(c)] for c in children]
        values, chars = 1 + sum(s[0] for s in sizes), sum(s[1] for s in sizes)
        self._sizes[id(node)] = (values, chars, 1 + max((s[2] for s in sizes), default=0))
        if isinstance(node, MappingNode):
            _check_duplicate_keys(node)
        self._add(1, 0, line)

    def _add(self, values: int, chars: int, line: int) -> None:
        self._values += values
        self._chars += chars
        holds = "aliases expand to" if self._aliased else "the document holds"
        fix = "write the values out or use fewer aliases" if self._aliased else "read the values from a file"
        if self._values > self.limits.max_nodes:
            raise YamlLimitError(f"{holds} more than {self.limits.max_nodes} values (line {line}); {fix}")
        if self._chars > self.limits.max_chars:
            raise YamlLimitError(f"{holds} more than {self.limits.max_chars} characters of text (line {line}); {fix}")


def _check_duplicate_keys(node: MappingNode) -> None:
    seen: dict[tuple[str, str], int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        ident = (key_node.tag, key_node.value)
        line = key_node.start_mark.line + 1
        if ident in seen:
            where = f"line {line}" if seen[ident] == line else f"lines {seen[ident]} and {line}"
            raise ConstructorError(
                None,
                None,
                f"duplicate key {short_repr(key_node.value)} ({where}); YAML would keep only the last one: remove "
                "or rename one of them",
                key_node.start_mark,
            )
        seen[ident] = line


def load_yaml(text: str, source: str = "<string>", limits: YamlLimits = RECIPE_LIMITS) -> Any:
    """Parse one YAML document with :func:`yaml.safe_load` semantics and ``limits``.

    Args:
        text: The document.
        source: Where the text comes from (a path, or an option name), shown in error messages.
        limits: What the document may hold; :data:`SAVED_LIMITS` for a recipe rlpost saved itself.

    Raises:
        yaml.YAMLError: Invalid YAML, including :class:`YamlLimitError` for a document over a limit.
    """
    if len(text) > limits.max_bytes:
        raise YamlLimitError(f"{source} is {len(text)} characters, more than the {limits.max_bytes} allowed")
    loader = _LimitedLoader(text, source, limits)
    try:
        return loader.get_single_data()
    except RecursionError:  # belt and braces: max_depth is far below Python's limit
        raise YamlLimitError("nesting too deep") from None
    finally:
        loader.dispose()


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxstring = _REPR.maxother = 60


def short_repr(value: Any, limit: int = 200) -> str:
    """``repr(value)`` cut to at most about ``limit`` characters, without ever building the full ``repr``."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
