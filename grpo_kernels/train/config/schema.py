"""Typed config fields: checking a value against a dataclass field's annotation, parsing override strings, and the
range / choice checks the config sections share (messages name the field as section.field)."""

import math
import types
import typing
from dataclasses import fields
from functools import cache

_NONE = ("none", "null")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


# ---------------------------------------------------------------------------------------------------------------
# Field checks shared by every section.


@cache
def field_types(cls) -> dict:
    """{field name: resolved annotation} of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _unwrap_optional(tp) -> tuple[object, bool]:
    """(X, True) for `X | None`, (tp, False) for any other annotation."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def typed_value(name: str, tp, value):
    """value checked against annotation tp and normalized (int -> float, list -> tuple, "none" -> None)."""
    inner, optional = _unwrap_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
        return None
    if inner is bool and isinstance(value, bool):
        return value
    if inner is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if inner is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if inner is str and isinstance(value, str):
        return value
    if typing.get_origin(inner) is tuple and typing.get_args(inner)[1:] == (Ellipsis,):  # tuple[X, ...]
        item = typing.get_args(inner)[0]
        if isinstance(value, str):  # TRL's report_to takes one name as a string too
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            return tuple(typed_value(f"{name}[{i}]", item, v) for i, v in enumerate(value))
    elif typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(typed_value(f"{name}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    raise ValueError(f"{name} must be {describe_type(tp)}, got {value!r}")


def describe_type(tp) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is tuple and typing.get_args(inner)[1:] == (Ellipsis,):
        text = "a list of strings" if typing.get_args(inner)[0] is str else "a list of numbers"
    elif typing.get_origin(inner) is tuple:
        text = f"a list of {len(typing.get_args(inner))} numbers"
    else:
        text = {bool: "a bool", int: "an int", float: "a finite number", str: "a string"}[inner]
    return text + " or none" * optional


def parse_value(name: str, tp, text: str):
    """A command-line string as the type of annotation tp (checked afterwards by typed_value)."""
    inner, optional = _unwrap_optional(tp)
    s = text.strip()
    if optional and s.lower() in _NONE:
        return None
    if inner is str:
        return text
    if typing.get_origin(inner) is tuple and typing.get_args(inner)[1:] == (Ellipsis,):
        item = typing.get_args(inner)[0]
        parts = [part.strip() for part in s.strip("()[]").split(",") if part.strip()]
        return parts if item is str else [parse_value(f"{name}[{i}]", item, p) for i, p in enumerate(parts)]
    if typing.get_origin(inner) is tuple:
        args, parts = typing.get_args(inner), s.strip("()[]").split(",")
        if len(parts) != len(args):
            raise ValueError(f"{name} must be {describe_type(tp)} (like 0.9,0.95), got {text!r}")
        return [parse_value(f"{name}[{i}]", a, p) for i, (a, p) in enumerate(zip(args, parts, strict=True))]
    try:
        return _BOOLS[s.lower()] if inner is bool else inner(s)
    except (KeyError, ValueError):
        hint = " (true/false/1/0/yes/no)" if inner is bool else ""
        raise ValueError(f"{name} must be {describe_type(tp)}{hint}, got {text!r}") from None


def validate(config, *, at_least: dict | None = None, choices: dict | None = None) -> None:
    """Type-check and normalize every field, then the lower bounds {field: low} and the {field: allowed values}."""
    for name, tp in field_types(type(config)).items():
        setattr(config, name, typed_value(f"{config.section}.{name}", tp, getattr(config, name)))
    for name, low in (at_least or {}).items():
        check(config, name, getattr(config, name) >= low, f">= {low}")
    for name, allowed in (choices or {}).items():
        check(config, name, getattr(config, name) in allowed, f"one of {', '.join(map(repr, allowed))}")


def check(config, name: str, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{config.section}.{name} must be {rule}, got {getattr(config, name)!r}")
