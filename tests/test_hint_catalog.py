"""Stable hint identifiers: every hint of the package has one, and a failure message is traced
back to the hints it contains (what the class report counts)."""

from __future__ import annotations

import string

import importlib

from attention_lab import hint_catalog


def formatted(text: str, value: str = "7") -> str:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(text) if name}
        return text.format(**{name.split(".")[0].split("[")[0]: value for name in fields})
    except (ValueError, KeyError, IndexError, AttributeError):
        return text


def test_every_hint_of_the_package_has_one_unique_id():
    catalog = hint_catalog.catalog()
    assert len({h.id for h in catalog}) == len(catalog)
    # every hint table a check module can see (its own and those it imports) is in the catalog once
    texts = {h.text for h in catalog}
    for name in hint_catalog.modules():
        seen = hint_catalog.hints_in(name, vars(importlib.import_module(name)))
        assert {h.text for h in seen} <= texts, name
    assert "mha_shapes.split_heads/reshape_only" in hint_catalog.by_id()


def test_ids_do_not_depend_on_numbers_or_the_message_around_the_hint():
    for hint in hint_catalog.catalog():
        for value in ("7", "12.50"):
            message = f"split_heads(x) returned the wrong values\n  Likely mistake: {formatted(hint.text, value)}\n"
            found = hint_catalog.identify(message)
            # a hint may contain a shorter one (then the longer is the mistake named); never none
            assert found, hint.id
            assert hint.id in found or any(hint.text in hint_catalog.by_id()[i].text for i in found), (hint.id, found)


def test_a_message_without_a_hint_names_no_mistake():
    assert hint_catalog.identify("NameError: name 'split_heads' is not defined") == []
