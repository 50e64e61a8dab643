"""Generic machinery of typed, frozen config dataclasses: overrides, introspection and checks.

Nothing here knows the experiment's sections (``mage_jax.config`` defines them); these functions work
on any tree of frozen dataclasses whose fields are typed with bool / int / float / str, ``Literal``
choices, ``X | None``, ``tuple[X, ...]``, ``dict`` or a nested dataclass.

Overrides use dotted keys and are parsed against the field's declared type, so command lines and
JSON files go through the same checks:

    --set optim.lr=1e-3      --optim.lr 1e-3      --optim.lr=1e-3      --rollout.reflect false

Tuples take comma-separated values (``--env.opponents a,b``) or JSON lists, dicts take JSON
(``--env.options '{"max_turns": 6}'``), optional fields take ``none``. Every problem (unknown key,
wrong type, impossible value) is one ``ConfigError`` with a one-line message naming the key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union

Config = TypeVar("Config")


class ConfigError(ValueError):
    """A bad configuration; the message is one line that names the offending key."""


# --------------------------------------------------------------------------------------------------
# typed parsing of values


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(tp: Any) -> str:
    optional, inner = _is_optional(tp)
    if optional:
        return f"{_type_name(inner)} or none"
    if typing.get_origin(tp) is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) is dict or tp is dict:
        return "a JSON object"
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (a CLI string or a JSON value) to the field type ``tp`` or raise ConfigError."""
    optional, inner = _is_optional(tp)
    if optional:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        return coerce(key, inner, value)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))} (got {value!r})")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    f = float(value.strip())
                except ValueError:
                    raise bad from None
                if f.is_integer():
                    return int(f)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if typing.get_origin(tp) is tuple:
        (elem,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError:
                    raise bad from None
            else:
                value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad
        return tuple(coerce(key, elem, v) for v in value)
    if typing.get_origin(tp) is dict or tp is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise bad from None
        if not isinstance(value, Mapping):
            raise bad
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, prefix=key + ".")
        raise bad
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


# --------------------------------------------------------------------------------------------------
# dict <-> config, overrides


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready nested dict (tuples become lists)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def from_dict(cls: type, data: Mapping[str, Any], *, prefix: str = "") -> Any:
    """Build a (section) config from a nested dict; unknown keys and wrong types are ConfigErrors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a JSON object, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            known = ", ".join(sorted(names))
            raise ConfigError(f"unknown config key {prefix + key!r}; known in this section: {known}")
        kwargs[key] = coerce(prefix + key, hints[key], value)
    return cls(**kwargs)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def all_keys(cls: type) -> list[str]:
    """Every dotted key an override of the config dataclass ``cls`` may set."""
    return _all_keys(cls)


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """One config key as ``--list-keys`` shows it."""

    key: str
    type_name: str
    default: Any
    doc: str


def _field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (the string literal under a field) of a dataclass, by field name."""
    try:
        body = ast.parse(inspect.getsource(cls)).body[0].body
    except (OSError, TypeError, IndexError, AttributeError):
        return {}
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _key_infos(cls: type, default: Any, prefix: str) -> list[KeyInfo]:
    out: list[KeyInfo] = []
    hints, docs = _hints(cls), _field_docs(cls)
    for f in dataclasses.fields(cls):
        tp, value = hints[f.name], getattr(default, f.name)
        if dataclasses.is_dataclass(tp):
            out += _key_infos(tp, value, prefix + f.name + ".")
        else:
            shown = to_dict(value) if dataclasses.is_dataclass(value) else value
            out.append(KeyInfo(prefix + f.name, _type_name(tp), shown, docs.get(f.name, "")))
    return out


def describe_keys(cls: type) -> list[KeyInfo]:
    """Every key of the config dataclass ``cls`` with its type, its default in ``cls()`` and its field
    docstring."""
    return _key_infos(cls, cls(), "")


def get_key(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg: Any, parts: list[str], value: Any, full: str) -> Any:
    cls = type(cfg)
    names = {f.name for f in dataclasses.fields(cls)}
    head = parts[0]
    if head not in names:
        known = ", ".join(sorted(names))
        raise ConfigError(f"unknown config key {full!r} ({head!r} is not one of: {known})")
    tp = _hints(cls)[head]
    if len(parts) == 1:
        if dataclasses.is_dataclass(tp) and not isinstance(value, Mapping):
            example = f"{full}.{dataclasses.fields(tp)[0].name}"
            raise ConfigError(f"{full} is a section; set one of its keys (e.g. {example})")
        return dataclasses.replace(cfg, **{head: coerce(full, tp, value)})
    child = getattr(cfg, head)
    if isinstance(child, Mapping) and len(parts) == 2:  # one entry of a dict field; the others stay
        return dataclasses.replace(cfg, **{head: {**child, parts[1]: _entry_value(value)}})
    if not dataclasses.is_dataclass(child):
        raise ConfigError(f"unknown config key {full!r} ({'.'.join(full.split('.')[:-1])} is not a section)")
    return dataclasses.replace(cfg, **{head: _set(child, parts[1:], value, full)})


def _entry_value(value: Any) -> Any:
    """A dict field's entry from the command line: a JSON value (``4``, ``false``, ``[1, 2]``) where the
    text is one, else the text itself (``full``)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def closest_key(key: str, keys: Iterable[str]) -> str | None:
    """The known dotted key a mistyped ``key`` most likely meant: one of the same name in another
    section (``train.lr`` -> ``optim.lr``), else the closest spelling (``optim.lrr`` -> ``optim.lr``);
    None when nothing is close."""
    keys = list(keys)
    name = key.rsplit(".", 1)[-1]
    same_name = [k for k in keys if k.rsplit(".", 1)[-1] == name]
    if same_name:
        return max(same_name, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if close:
        return close[0]
    names = {k.rsplit(".", 1)[-1]: k for k in sorted(keys, reverse=True)}
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.8)
    return names[close[0]] if close else None


def apply_overrides(cfg: Config, overrides: Mapping[str, Any]) -> Config:
    """Apply dotted-key overrides in order (values may be CLI strings or typed values). An unknown key's
    error names the closest known key of any section."""
    for key, value in overrides.items():
        if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"bad config key {key!r}")
        try:
            cfg = _set(cfg, key.split("."), value, key)
        except ConfigError as err:
            hint = closest_key(key, all_keys(type(cfg))) if str(err).startswith(
                f"unknown config key {key!r}") else None
            if hint is None:
                raise
            raise ConfigError(f"{err}; did you mean {hint!r}?") from None
    return cfg


def parse_assignment(text: str) -> tuple[str, str]:
    """``"optim.lr=1e-3"`` -> ``("optim.lr", "1e-3")``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"bad override {text!r}; expected KEY=VALUE such as optim.lr=1e-3")
    return key.strip(), value


# --------------------------------------------------------------------------------------------------
# checks shared by validators


def check(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)


def one_of(key: str, value: Any, allowed: Iterable[Any]) -> None:
    """``value`` of ``key`` is one of ``allowed``, or a ConfigError that lists them."""
    allowed = tuple(allowed)
    check(value in allowed, f"{key} must be one of {', '.join(map(str, allowed))} (got {value!r})")


def check_choices(section: Any, prefix: str = "") -> None:
    """Every field of a ``Literal`` type holds one of its values (nested sections included)."""
    hints = _hints(type(section))
    for f in dataclasses.fields(section):
        value, tp = getattr(section, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is Literal:
            one_of(prefix + f.name, value, typing.get_args(tp))


def check_finite(section: Any, prefix: str = "") -> None:
    """Every float field (and every float in a tuple field) is a finite number: ``inf`` / ``nan``
    pass range checks (``inf > 0``) but turn the first update into NaN."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{prefix}{f.name}.")
            continue
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, float):
                check(math.isfinite(v), f"{prefix}{f.name} must be a finite number (got {value!r})")
