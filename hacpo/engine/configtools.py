"""Generic helpers for the typed config dataclasses: nested from_dict with unknown-key and
wrong-type errors, and dotted-key overrides ("loss.alpha=0", "agents.1.lr=3e-4") parsed to each
field's type."""
from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from typing import Any


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_of(tp) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _list_item(tp) -> type | None:
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        return _dataclass_of(args[0]) if args else None
    return None


def from_dict(cls, d: dict[str, Any], prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict; unknown keys, and values that are not of
    their field's type, are errors naming the dotted key.

    Strings are parsed as their field's type (YAML spells ``1e-3`` as a string) and an int
    where a float is expected becomes a float. The dataclass's own checks run first (their
    messages say which values are allowed, e.g. "an integer >= 1, got 1.5"); the types are
    checked after them, or where those checks fail on a value of the wrong type."""
    if not isinstance(d, dict):
        raise ValueError(f"config section {prefix.rstrip('.') or cls.__name__!r} must be a "
                         f"mapping, got {type(d).__name__}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"unknown config key(s) {sorted(prefix + k for k in unknown)}; "
                         f"known: {sorted(prefix + k for k in names)}")
    kwargs = {}
    for k, v in d.items():
        tp, key = hints[k], prefix + k
        sub, item = _dataclass_of(tp), _list_item(tp)
        if sub is not None:
            v = v if isinstance(v, sub) else from_dict(sub, v, f"{key}.")
        elif item is not None and isinstance(v, (list, tuple)):
            v = [x if isinstance(x, item) else _list_entry(item, x, f"{key}.{i}")
                 for i, x in enumerate(v)]
        else:
            v = _normalize(v, tp, key)
        kwargs[k] = v
    try:
        obj = cls(**kwargs)
    except ValueError:
        raise
    except Exception:       # e.g. TypeError: '>' not supported between 'list' and 'int'
        _check_types(kwargs, hints, prefix)     # a value of the wrong type: say which
        raise
    _check_types(kwargs, hints, prefix)
    return obj


def _list_entry(item: type, x: Any, path: str):
    """Entry ``path`` (e.g. "agents.0") of a list of ``item`` sections. An error inside it is
    prefixed with where it is: ``item.config_error(x, path, message)`` if the class defines it
    (e.g. to name the agent), else ``path``."""
    if not isinstance(x, dict):
        return from_dict(item, x, f"{path}.")      # the error: entry <path> must be a mapping
    try:
        return from_dict(item, x, f"{path}.")
    except ValueError as e:
        where = getattr(item, "config_error", None)
        raise ValueError(where(x, path, str(e)) if where else f"{path}: {e}") from None


def _matches(value: Any, tp) -> bool:
    """Is ``value`` of field type ``tp``? (an int is no float here, a bool no int)"""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        items = [a for a in args if a is not Ellipsis]
        return len(items) != 1 or all(_matches(x, items[0]) for x in value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            return False
        return len(args) != 2 or all(_matches(k, args[0]) and _matches(v, args[1])
                                     for k, v in value.items())
    return isinstance(value, tp) if isinstance(tp, type) else True


def _describe(tp) -> str:
    """Field type ``tp`` in words, for error messages: "an integer", "a number or null"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        return f"a list of {_describe(items[0])}" if len(items) == 1 else "a list"
    if origin is dict or tp is dict or _dataclass_of(tp):
        return "a mapping"
    words = {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
             str: "a string"}
    return words.get(tp, getattr(tp, "__name__", str(tp)))


def _normalize(value: Any, tp, key: str) -> Any:
    """A leaf value as field type ``tp`` where it is another spelling of one: a string parsed
    (:func:`_coerce`), an int where only a float fits made a float. Anything else unchanged
    (checked by :func:`_check_types`)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        value = int(value)                   # e.g. numpy's: what JSON and the checks take
    elif isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        value = float(value)
    if _matches(value, tp):
        return value
    if isinstance(value, str):
        return _coerce(value, tp, key)
    if (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and _matches(float(value), tp)):
        return float(value)
    return value


def _check_types(kwargs: dict[str, Any], hints: dict[str, Any], prefix: str) -> None:
    for k, v in kwargs.items():
        if not _matches(v, hints[k]):
            raise ValueError(f"config key {prefix + k!r} must be {_describe(hints[k])}, got "
                             f"{v!r} ({type(v).__name__})")


def _coerce(value: Any, tp, key: str) -> Any:
    """A string value parsed as field type ``tp`` (CLI ``--set`` values, YAML strings); other
    values unchanged (from_dict checks their types)."""
    base = tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):    # Optional[X], X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if isinstance(value, str) and value.lower() in ("none", "null"):
            return None
        base = args[0] if len(args) == 1 else str
    if not isinstance(value, str) or base is str:
        return value
    try:
        if base is bool:
            low = value.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base in (int, float):
            return base(value)
        if typing.get_origin(base) in (list, tuple, dict) or base is dict:
            from .errors import require
            yaml = require("yaml", f"the {getattr(base, '__name__', base)} value {value!r} of "
                                   f"config key {key!r}")
            try:
                return yaml.safe_load(value)    # from_dict checks what it gives
            except yaml.YAMLError:
                raise ValueError from None
    except (ValueError, TypeError):
        raise ValueError(f"cannot parse {value!r} as {getattr(base, '__name__', base)} for "
                         f"config key {key!r}") from None
    return value


def override(obj, overrides: dict[str, Any]):
    """Return a copy of dataclass ``obj`` with dotted-key overrides applied (validated again by
    each dataclass's __post_init__)."""
    d = dataclasses.asdict(obj)
    for key, value in overrides.items():
        _set(type(obj), d, key, value)
    return from_dict(type(obj), d)


def _set(cls, d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node: Any = d
    tp: Any = cls
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"config key {key!r}: {part!r} is not an index < {len(node)}")
            idx = int(part)
            if last:
                raise ValueError(f"config key {key!r} is a section; set one of its fields")
            node, tp = node[idx], _list_item(tp)
            continue
        sub = _dataclass_of(tp)
        fields = _hints(sub) if sub else {}
        if part not in fields:
            raise ValueError(f"unknown config key {key!r}: {part!r} is not one of "
                             f"{sorted(fields)}")
        ftype = fields[part]
        if last:
            if _list_item(ftype) and isinstance(value, list):   # e.g. a YAML list of agents
                node[part] = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                              for v in value]
                return
            if _dataclass_of(ftype) or _list_item(ftype):
                raise ValueError(f"config key {key!r} is a section; set one of its fields")
            node[part] = _coerce(value, ftype, key)
        else:
            if not (_dataclass_of(ftype) or _list_item(ftype)):
                if ftype is dict or typing.get_origin(ftype) is dict:   # e.g. hf_config
                    head, rest = ".".join(parts[:i + 1]), ".".join(parts[i + 1:])
                    raise ValueError(f"config key {key!r}: {head} is a mapping set as a whole, "
                                     f"e.g. {head}='{{{rest}: {value}}}' (YAML; it replaces "
                                     f"the mapping)")
                raise ValueError(f"unknown config key {key!r}: {part!r} has no sub-keys")
            if part not in node:     # a section the YAML left out (e.g. an agent's optim)
                node[part] = {} if _dataclass_of(ftype) else []
            node, tp = node[part], ftype


class ConfigMixin:
    """to_dict / from_dict / override for a config dataclass (each validated on build)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        return from_dict(cls, d)

    def override(self, overrides: dict[str, Any]):
        """Dotted-key overrides, e.g. {"loss.alpha": 0}; strings are parsed as the field's type
        (CLI). Unknown keys are an error."""
        return override(self, overrides)


def parse_overrides(items: list[str]) -> dict[str, str]:
    """["a.b=1", "c=x"] -> {"a.b": "1", "c": "x"} (values parsed later by field type)."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out
