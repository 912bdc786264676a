"""Typed options: each engine target and transport declares the options it takes as a
frozen dataclass, and `parse` turns what a user passed (a mapping, or an instance) into
it. An unknown option, or a value of the wrong type, is an error naming the valid ones,
raised before anything connects."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import OptionsError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """For classes that take no options."""


def parse(cls: type[T], given: Mapping[str, Any] | T | None, *, what: str) -> T:
    """`given` as an instance of the options dataclass `cls`; `what` names the owner in errors
    (e.g. "transport 'nixl'")."""
    if given is None:
        return cls()
    if isinstance(given, cls):
        return given
    if not isinstance(given, Mapping):
        raise OptionsError(f"{what}: options must be a mapping or {cls.__name__}, not {type(given).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise OptionsError(f"{what}: unknown option(s) {unknown}; valid options: {describe(cls)}")
    hints = typing.get_type_hints(cls)
    for name, value in given.items():
        if not _fits(value, hints[name]):
            raise OptionsError(f"{what}: option {name}={value!r} is not {_type_text(hints[name])}")
    try:
        return cls(**given)
    except (TypeError, ValueError) as exc:  # __post_init__ checks of the dataclass
        raise OptionsError(f"{what}: {exc}") from exc


def describe(cls: type) -> str:
    """`name: type = default` of every option, for errors and `p2psync plugins`."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "required"
        )
        out.append(f"{f.name}: {_type_text(hints[f.name])} = {default!r}")
    return ", ".join(out) or "none"


def _fits(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint)


def _type_text(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint))
