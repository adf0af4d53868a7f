"""Generic helpers for the typed config dataclasses: nested from_dict with unknown-key errors,
and dotted-key overrides ("loss.alpha=0", "agents.1.lr=3e-4") parsed to each field's type."""
from __future__ import annotations

import dataclasses
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
    """Build dataclass ``cls`` from a nested dict; unknown keys are an error naming them."""
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
        tp = hints[k]
        sub, item = _dataclass_of(tp), _list_item(tp)
        if sub is not None and isinstance(v, dict):
            v = from_dict(sub, v, f"{prefix}{k}.")
        elif item is not None and isinstance(v, (list, tuple)):
            v = [from_dict(item, x, f"{prefix}{k}.{i}.") if isinstance(x, dict) else x
                 for i, x in enumerate(v)]
        kwargs[k] = v
    return cls(**kwargs)


def _coerce(value: Any, tp, key: str) -> Any:
    base = tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):    # Optional[X], X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if isinstance(value, str) and value.lower() in ("none", "null"):
            return None
        base = args[0] if len(args) == 1 else str
    if not isinstance(value, str) or base is str:
        if base is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
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
        if typing.get_origin(base) in (list, tuple, dict):
            import yaml
            return yaml.safe_load(value)
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
                raise ValueError(f"unknown config key {key!r}: {part!r} has no sub-keys")
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
