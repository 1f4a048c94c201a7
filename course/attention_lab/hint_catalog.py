"""Every hint of the checks, with a stable identifier, and which hints a failure message names.

A hint is a string in a module-level table named ``HINTS`` or ``<SOMETHING>_HINTS`` of
``attention_lab.checking`` or of a module of ``attention_lab.checks`` (nested dicts, lists and
tuples of strings count too). Its identifier is ``<module>.<table>/<key>``, e.g.
``mha_shapes.split_heads/reshape_only``: it does not change when the hint's wording or the
numbers it formats change, so the class report can count how many students made each mistake
across a term. A hint's ``str.format`` fields (``{d_head}``) match any text in a message.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import re
import string
from dataclasses import dataclass
from typing import Any, Iterator, Mapping


@dataclass(frozen=True)
class Hint:
    id: str        # mha_shapes.split_heads/reshape_only
    module: str    # attention_lab.checks.mha_shapes
    table: str     # SPLIT_HEADS_HINTS
    key: str       # reshape_only (nested keys joined with '/')
    text: str

    @property
    def pattern(self) -> re.Pattern:
        return hint_pattern(self.text)

    def where(self) -> str:
        """Where the hint is written: ``attention_lab.checks.mha_shapes.SPLIT_HEADS_HINTS[reshape_only]``."""
        return f"{self.module}.{self.table}[{self.key}]"


def _normalise(text: str) -> str:
    return " ".join(text.split())


# What a format field of a hint matches: any text, within one message. Messages searched at once
# are joined with NUL (see tests/hint_coverage.py): a field that could run on into the following
# messages made a failed search cost the corpus's length to the power of the hint's fields (a
# session's end spent many minutes there once the 04 checks ran both ways).
MESSAGE_SEPARATOR = "\x00"
ANY_TEXT_OF_ONE_MESSAGE = "[^\x00]*?"


@functools.lru_cache(maxsize=None)  # one per hint: identify() tries every hint on every message
def hint_pattern(text: str) -> re.Pattern:
    """A regex for the hint as it appears in a message: format fields match anything."""
    text = _normalise(text)
    try:
        parts = list(string.Formatter().parse(text))
    except ValueError:  # unbalanced braces: not a format string, match it literally
        return re.compile(re.escape(text))
    pattern = ""
    for literal, field, _spec, _conversion in parts:
        pattern += re.escape(literal) + (ANY_TEXT_OF_ONE_MESSAGE if field is not None else "")
    return re.compile(pattern)


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, tuple):
        return "x".join(str(k) for k in key)
    return str(key)


def _strings(value: Any, key: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, Mapping):
        for inner_key, inner in value.items():
            yield from _strings(inner, f"{key}/{_key(inner_key)}")
    elif isinstance(value, (list, tuple)):
        for index, inner in enumerate(value):
            yield from _strings(inner, f"{key}/{index}")


def is_hint_table(name: str, value: Any) -> bool:
    return (name == "HINTS" or name.endswith("_HINTS")) and isinstance(value, Mapping)


def hints_in(module_name: str, namespace: Mapping[str, Any], seen_tables: set[int] | None = None) -> list[Hint]:
    """Every hint of the hint tables of one module's namespace (a table already in
    ``seen_tables``, imported from another module, is skipped: it has the id of its first module)."""
    short = module_name.rsplit(".", 1)[-1]
    hints = []
    for table, value in namespace.items():
        if not is_hint_table(table, value):
            continue
        if seen_tables is not None:
            if id(value) in seen_tables:
                continue
            seen_tables.add(id(value))
        table_id = table[:-len("_HINTS")].lower() if table.endswith("_HINTS") else "hints"
        for key, inner in value.items():
            for path, text in _strings(inner, _key(key)):
                hints.append(Hint(f"{short}.{table_id}/{path}", module_name, table, path, text))
    return hints


def modules() -> list[str]:
    import attention_lab.checks

    return ["attention_lab.checking"] + [f"attention_lab.checks.{info.name}"
                                         for info in pkgutil.iter_modules(attention_lab.checks.__path__)]


@functools.lru_cache(maxsize=1)
def catalog() -> tuple[Hint, ...]:
    """Every hint of the package, each with its identifier (unique)."""
    hints: list[Hint] = []
    tables: set[int] = set()
    names = modules()
    # a table imported into another module keeps the id of the module that defines it
    for defining in (True, False):
        for name in names:
            module = importlib.import_module(name)
            namespace = vars(module)
            if defining:
                source = inspect.getsource(module)
                namespace = {table: value for table, value in namespace.items()
                             if re.search(rf"^{re.escape(table)}\s*[:=]", source, re.MULTILINE)}
            hints += hints_in(name, namespace, tables)
    ids = [hint.id for hint in hints]
    assert len(ids) == len(set(ids)), "two hints with one identifier"
    return tuple(hints)


def by_id() -> dict[str, Hint]:
    return {hint.id: hint for hint in catalog()}


def identify(message: str, hints: tuple[Hint, ...] | None = None) -> list[str]:
    """The identifiers of the hints a failure message contains, in catalog order. A hint whose
    text lies inside a longer hint found at the same place is not counted twice."""
    text = _normalise(message)
    found: list[tuple[int, int, Hint]] = []
    for hint in hints if hints is not None else catalog():
        if not hint.pattern.pattern:  # a blank hint names nothing
            continue
        match = hint.pattern.search(text)
        if match:
            found.append((match.start(), match.end(), hint))
    kept = [(start, end, hint) for start, end, hint in found
            if not any(s <= start and end <= e and (e - s) > (end - start) for s, e, _ in found)]
    seen_text: set[str] = set()
    ids = []
    for _, _, hint in kept:
        if hint.text in seen_text:
            continue
        seen_text.add(hint.text)
        ids.append(hint.id)
    return ids
