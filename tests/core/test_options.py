"""Typed options: unknown names and wrong types are refused with the valid options named."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from p2psync.core.errors import OptionsError
from p2psync.core.options import NoOptions, describe, parse


@dataclass(frozen=True)
class Example:
    layout: Literal["copy_map", "replica"] = "copy_map"
    timeout: float = 1.0
    retries: int = 3
    host: str | None = None
    params: dict = field(default_factory=dict)


def test_a_mapping_becomes_the_dataclass():
    assert parse(Example, {"layout": "replica", "timeout": 2, "host": "h"}, what="x") == Example("replica", 2, 3, "h")
    assert parse(Example, None, what="x") == Example()
    given = Example(retries=5)
    assert parse(Example, given, what="x") is given


def test_an_unknown_option_names_the_valid_ones():
    with pytest.raises(OptionsError) as err:
        parse(Example, {"layuot": "replica"}, what="engine target 'sglang'")
    assert str(err.value) == (
        "engine target 'sglang': unknown option(s) ['layuot']; valid options: layout: 'copy_map' | 'replica' = "
        "'copy_map', timeout: float = 1.0, retries: int = 3, host: str | NoneType = None, params: dict = {}"
    )
    with pytest.raises(OptionsError, match=r"unknown option\(s\) \['a'\]; valid options: none"):
        parse(NoOptions, {"a": 1}, what="t")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [("layout", "fast", "'copy_map' | 'replica'"), ("timeout", "1", "float"), ("retries", 2.5, "int"),
     ("retries", True, "int"), ("host", 5, "str | NoneType"), ("params", [], "dict")],
)
def test_a_value_of_the_wrong_type_is_refused(name, value, expected):
    with pytest.raises(OptionsError) as err:
        parse(Example, {name: value}, what="t")
    assert str(err.value) == f"t: option {name}={value!r} is not {expected}"


def test_describe_lists_every_option():
    assert describe(NoOptions) == "none"
    assert describe(Example).startswith("layout: 'copy_map' | 'replica' = 'copy_map', timeout: float = 1.0")
