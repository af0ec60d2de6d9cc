"""YAML reading with limits, for files a user may have been handed by someone else (recipes, overlays, overrides).

``yaml.safe_load`` never runs code, but it will happily build a "billion laughs" document: nine anchors of nine
aliases each are ~500 bytes of text and 9**9 values once expanded (PyYAML shares the aliased objects, so building
is cheap; everything that walks the result afterwards, validation, ``repr`` in an error message, a deep copy,
pays the full expansion). Deep nesting (``[[[[...]]]]``) overflows PyYAML's recursive composer with a
``RecursionError``. :func:`load_yaml` refuses both *before* constructing any Python object, with a
:class:`YamlLimitError` (a ``yaml.YAMLError``, so callers report it as "not valid YAML"):

* nesting deeper than :data:`MAX_DEPTH`, counted with aliases expanded;
* more than :data:`MAX_NODES` values with aliases expanded (recursive aliases are refused outright);
* more than :data:`MAX_BYTES` of text.

It also refuses a mapping that repeats a key (PyYAML silently keeps the last one, so two ``sampler:`` blocks would
run the second without a word), like ruamel.yaml does by default; ``<<`` merge keys may still be overridden.

:func:`short_repr` bounds what an error message may quote of a value.
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "YamlLimitError", "load_yaml", "short_repr"]

# A real recipe is a few kB, a dozen levels deep and a few hundred values; these leave room for generated ones.
MAX_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 100_000


class YamlLimitError(yaml.YAMLError):  # type: ignore[misc,unused-ignore]  # PyYAML ships no types
    """A YAML document exceeds a size, depth or alias-expansion limit."""


class _LimitedLoader(yaml.SafeLoader):  # type: ignore[misc,unused-ignore]
    """``SafeLoader`` whose composer stops at :data:`MAX_DEPTH` and whose documents are size-checked before
    construction."""

    def __init__(self, stream: str, name: str) -> None:
        super().__init__(stream)
        self.name = name  # PyYAML's marks say "<unicode string>" otherwise
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        # PyYAML composes recursively: stop at MAX_DEPTH instead of at Python's recursion limit.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlLimitError(f"nesting deeper than {MAX_DEPTH} levels (at line {mark.line + 1})")
            return super().compose_node(parent, index)  # type: ignore[no-any-return,unused-ignore]
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        check_expansion(node)
        return self.construct_document(node)


def check_expansion(root: Node) -> None:
    """Refuse a composed document whose alias-expanded size or depth exceeds the limits.

    Each distinct node is visited once (memoised), so the check costs the size of the *text*, not of the expansion.

    Raises:
        YamlLimitError: Too many values or too deep once aliases are expanded, or a recursive alias.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            active.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > MAX_NODES:
                raise YamlLimitError(
                    f"aliases expand to more than {MAX_NODES} values (line {node.start_mark.line + 1}); "
                    "write the values out or use fewer aliases"
                )
            if depth[key] > MAX_DEPTH:
                raise YamlLimitError(
                    f"nesting deeper than {MAX_DEPTH} levels once aliases are expanded "
                    f"(line {node.start_mark.line + 1})"
                )
            continue
        if key in size:
            continue
        if key in active:
            raise YamlLimitError(f"recursive alias (a node contains itself, line {node.start_mark.line + 1})")
        if isinstance(node, MappingNode):
            _check_duplicate_keys(node)
        active.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


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


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse one YAML document with :func:`yaml.safe_load` semantics and the limits above.

    Args:
        text: The document.
        source: Where the text comes from (a path, or an option name), shown in error messages.

    Raises:
        yaml.YAMLError: Invalid YAML, including :class:`YamlLimitError` for a document over a limit.
    """
    if len(text) > MAX_BYTES:
        raise YamlLimitError(f"{source} is {len(text)} characters, more than the {MAX_BYTES} a recipe may have")
    loader = _LimitedLoader(text, source)
    try:
        return loader.get_single_data()
    except RecursionError:  # belt and braces: MAX_DEPTH is far below Python's limit
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
