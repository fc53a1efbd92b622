"""JSON Schema's ECMA-262 regexes read with Python's re."""

from __future__ import annotations

import re

import pytest

from gateway.schema_regex import (
    RegexTooSlow,
    bounded_validator,
    has_lookahead,
    python_patterns,
    python_regex,
    regex_budget,
    repeat_copies,
)


@pytest.mark.parametrize(
    ("ecma", "python"),
    [
        ("^(?<y>[0-9]{4})$", "^(?P<y>[0-9]{4})$"),
        ("(?<a>x)|(?<b>(?<c>y))", "(?P<a>x)|(?P<b>(?P<c>y))"),
        ("(?<=a)b(?<!c)", "(?<=a)b(?<!c)"),  # look-behinds are spelled alike
        (r"\\(?<y>a)", r"\\(?P<y>a)"),  # an escaped backslash, then a group
        (r"a\(?<y>", r"a\(?<y>"),  # an escaped "(": literal
        ("[(?<y>]", "[(?<y>]"),  # in a character class: literal
        (r"[\]](?<y>a)", r"[\]](?P<y>a)"),
    ],
)
def test_a_named_group_is_spelled_as_pythons_re_spells_it(ecma: str, python: str) -> None:
    assert python_regex(ecma) == python
    re.compile(python)


def test_a_lookahead_is_found_only_where_it_opens_a_group() -> None:
    assert has_lookahead("^(?=.*[0-9])a$") and has_lookahead("a(?!b)")
    assert not any(has_lookahead(p) for p in ("[(?=]", r"\(?=", "(?<=a)", "(?:a)"))


def test_only_patterns_in_schema_places_are_respelled() -> None:
    schema = {
        "type": "object",
        "properties": {"pattern": {"type": "string", "pattern": "(?<a>x)"}},
        "patternProperties": {"(?<k>y)": {"items": [{"pattern": "(?<i>z)"}]}},
        "enum": [{"pattern": "(?<data>d)"}],  # data, not a schema
    }
    assert python_patterns(schema) == {
        "type": "object",
        "properties": {"pattern": {"type": "string", "pattern": "(?P<a>x)"}},
        "patternProperties": {"(?P<k>y)": {"items": [{"pattern": "(?P<i>z)"}]}},
        "enum": [{"pattern": "(?<data>d)"}],
    }


@pytest.mark.parametrize(
    ("pattern", "copies"),
    [
        ("^[0-9]{4}-[0-9]{2}$", 3 + 1),
        ("(ab){3}", 2 * 3),  # written out as (ab)(ab)(ab): a group and its two letters, twice more
        ("(a{10}){10}", 10 * 11 - 2),  # nested counts multiply: ten groups of ten a's, for one of one
        ("a{0,100000}|b{1,}|c*", 0),  # only a minimum is written out
        ("a{100}?b{100}+", 2 * 99),  # lazy and possessive repeats too
        (r"\{100000}|[{]", 0),  # a brace escaped: no count
        ("(?<y>a{3})", 2),  # ECMA's named group
        ("(?x)(a{100})#)\n{100}", 100 * 101 - 2),  # a verbose comment hides no repeat
    ],
)
def test_repeat_copies_are_counted_as_the_regex_module_writes_them_out(pattern: str, copies: int) -> None:
    assert repeat_copies(pattern) == copies


def test_a_bounded_validators_regexes_are_bounded_outside_a_budget_too() -> None:
    validator = bounded_validator({"pattern": "^(a|aa)+$"})
    with pytest.raises(RegexTooSlow):  # seconds in the regex module: stopped at REGEX_BUDGET_S
        validator.is_valid("a" * 36 + "!")
    with regex_budget(0), pytest.raises(RegexTooSlow):  # a budget spent
        validator.is_valid("a")
    assert validator.is_valid("aa") and not validator.is_valid("b")  # gone with its block
