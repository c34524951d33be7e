"""The one reader of settings: a dotted-key walk over a plain mapping, typed values of the
keys a schema declares (:class:`Field`) and dataclass sections (:class:`Section`).

Both sources -- a composed Hydra config and a recipe YAML -- are plain dicts by the time they
get here (``sources``), so every key is found, checked and named in errors the same way.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from ..layout import LayoutError
from ..wire.protocol import one_line

__all__ = ["REQUIRED", "Field", "Section", "lookup", "read", "read_mapping", "read_section", "keys", "sections",
           "check_type", "build_dataclass", "container"]


#: ``Field.default`` / ``read_mapping``: no default, a missing or null key is an error naming
#: it (dataclasses' own "no default" marker).
REQUIRED: Any = MISSING


@dataclass(frozen=True)
class Field:
    """One setting at the dotted ``key``: a missing or null value reads as ``default`` (a null
    default is checked against ``tp`` too, so ``model: null`` is named as not a string)."""

    key: str
    tp: Any
    default: Any = None
    minimum: int | None = None
    #: The values it may take (checked after the type).
    choices: tuple | None = None


@dataclass(frozen=True)
class Section:
    """The mapping at ``key`` as a ``cls`` dataclass, each field named ``<key>.<field>``.

    ``required``: None passes whatever is there to :func:`build_dataclass` (a Hydra config
    lists every key, a null is named there); True / False: a recipe section that must be
    there / may be left out (read as empty), whose missing required fields are named.
    """

    key: str
    cls: type
    required: bool | None = None
    #: Read only these keys of the mapping (it holds others the section does not own).
    only: tuple[str, ...] | None = None
    minimum: Mapping[str, int] = field(default_factory=dict)
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The prefix ``cls``'s own checks name its fields with, when that is not ``key``
    #: (``RefitConfig`` says ``refit.*`` wherever the section sits).
    names: str | None = None
    #: Keys of the mapping that are sections of their own (``grpo.async_grpo``): left to those.
    sub: tuple[str, ...] = ()

    @property
    def names_read(self) -> tuple[str, ...]:
        return self.only if self.only is not None else tuple(f.name for f in fields(self.cls) if f.init)


def keys(schema: Any) -> frozenset[str]:
    """The dotted keys a schema dataclass (attributes that are Fields and Sections) reads."""
    out: set[str] = set()
    for f in fields(schema):
        item = getattr(schema, f.name)
        if isinstance(item, Field):
            out.add(item.key)
        elif isinstance(item, Section):
            out.update(f"{item.key}.{name}" for name in item.names_read)
    return frozenset(out)


def sections(schema: Any) -> tuple[str, ...]:
    """The keys of a schema's sections (Hydra's ``open_sections``: their reader names unknown keys)."""
    return tuple(item.key for item in (getattr(schema, f.name) for f in fields(schema)) if isinstance(item, Section))


def lookup(cfg: Any, key: str) -> Any:
    """``cfg[a][b]...`` for ``key = "a.b..."``; None where a key is missing or null. A value
    on the way that is not a mapping is named (``recipe: a is a list, not a mapping``)."""
    node: Any = cfg
    seen: list[str] = []
    for part in key.split("."):
        if node is None:
            return None
        if not isinstance(node, Mapping):
            raise ConfigError(f"recipe: {'.'.join(seen)} is a {type(node).__name__}, not a mapping")
        seen.append(part)
        node = node.get(part)
    return node


def read(cfg: Any, f: Field) -> Any:
    """The value of ``f`` in ``cfg``, checked (``ConfigError`` naming ``f.key``)."""
    value = lookup(cfg, f.key)
    if value is None:
        if f.default is REQUIRED:
            raise ConfigError(f"recipe: {f.key} is missing")
        value = f.default
    value = check_type(f.key, value, f.tp)
    if value is not None and f.minimum is not None and value < f.minimum:
        raise ConfigError(f"{f.key}={value} must be >= {f.minimum}")
    if value is not None and f.choices is not None and value not in f.choices:
        raise ConfigError(f"{f.key}={value!r} is not one of {list(f.choices)}")
    return value


def read_mapping(cfg: Any, key: str, default: Any = REQUIRED) -> Any:
    """The mapping at ``key`` (``default`` where it is missing or null)."""
    node = lookup(cfg, key)
    if node is None:
        if default is REQUIRED:
            raise ConfigError(f"recipe: {key} is missing")
        return default
    if not isinstance(node, Mapping):
        raise ConfigError(f"recipe: {key} is a {type(node).__name__}, not a mapping")
    return node


def read_section(cfg: Any, s: Section) -> Any:
    """``s.cls`` built from the mapping at ``s.key`` (see :class:`Section`)."""
    if s.required is None:
        node = lookup(cfg, s.key)
        if s.sub:
            node = {k: v for k, v in dict(container(node, s.key) or {}).items() if k not in s.sub}
    else:
        node = dict(read_mapping(cfg, s.key, REQUIRED if s.required else {}))
        if s.only is not None:
            node = {k: node[k] for k in s.only if node.get(k) is not None}
        for k in s.sub:
            node.pop(k, None)
        for f in fields(s.cls):
            if f.default is MISSING and f.default_factory is MISSING and node.get(f.name) is None:
                raise ConfigError(f"recipe: {s.key}.{f.name} is missing")
    try:
        return build_dataclass(s.cls, node, s.key, minimum=s.minimum, choices=s.choices)
    except ConfigError as exc:
        msg = str(exc)
        if s.names is None or not msg.startswith(s.names + "."):
            raise
        raise ConfigError(s.key + msg[len(s.names):]) from None


# --------------------------------------------------------------------------- types


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        named = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if tp is bool:
        return "a boolean (true or false)"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin in (tuple, list, Sequence):
        inner = args[0] if args else Any
        return f"a list of {_describe(inner).split(' ', 1)[-1]}s" if inner is not Any else "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {[m.value for m in tp]}"
    return getattr(tp, "__name__", str(tp))


def _check_union(key: str, value: Any, tp: Any, args: tuple) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{key}=null is not {_describe(tp)}")
    errors = []
    for a in (a for a in args if a is not type(None)):
        try:
            return check_type(key, value, a)
        except ConfigError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    raise ConfigError(f"{key}={value!r} is not {_describe(tp)}")


def _check_enum(key: str, value: Any, tp: type) -> Any:
    if isinstance(value, tp):
        return value
    parse = getattr(tp, "parse", None)
    if parse is not None:
        return parse(value, key)
    try:
        return tp(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not {_describe(tp)}") from None


def _check_scalar(key: str, value: Any, tp: type) -> Any:
    """bool, int, float, str: ints are not bools, strings or floats; floats may be ints."""
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not {_describe(tp)}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not an integer")
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} is not a number")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} is not a string")
    return value


def _check_sequence(key: str, value: Any, tp: Any, origin: Any, args: tuple) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r} is not {_describe(tp)}")
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise ConfigError(f"{key}={value!r} must have {len(args)} entries")
        items = [check_type(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args))]
    else:
        inner = args[0] if args else Any
        items = [check_type(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    return list(items) if origin is list else tuple(items)


def check_type(key: str, value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (and normalised: lists to tuples where
    the annotation says tuple, ints to floats where it says float, strings to enums); raises
    ``ConfigError`` naming ``key``, e.g. ``training.tp='two' is not an integer``."""
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _check_union(key, value, tp, args)
    if value is None:
        raise ConfigError(f"{key}=null is not {_describe(tp)}")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _check_enum(key, value, tp)
    if tp in (bool, int, float, str):
        return _check_scalar(key, value, tp)
    if origin in (tuple, list, Sequence):
        return _check_sequence(key, value, tp, origin, args)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}={value!r} is not a mapping")
        kt, vt = args if len(args) == 2 else (Any, Any)
        return {check_type(f"{key} key", k, kt): check_type(f"{key}.{k}", v, vt) for k, v in value.items()}
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r} is not a {tp.__name__}")
    return value


def build_dataclass(cls: type, section: Any, what: str, *, minimum: Mapping[str, int] | None = None,
                    choices: Mapping[str, Sequence[str]] | None = None) -> Any:
    """``cls(**section)``: unknown keys, every value's type (against ``cls``'s annotations),
    sizes below their ``minimum`` and values outside their ``choices`` named as ``<what>.<key>``."""
    data = container(section, what)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what}={data!r} is not a mapping of settings")
    names = [f.name for f in fields(cls) if f.init]
    unknown = sorted(str(k) for k in set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(f'{what}.{k}' for k in unknown)}; {what} takes {names}")
    hints = typing.get_type_hints(cls)
    kwargs = {k: check_type(f"{what}.{k}", v, hints[k]) for k, v in data.items()}
    for name, low in (minimum or {}).items():
        value = kwargs.get(name)
        if value is not None and value < low:
            raise ConfigError(f"{what}.{name}={value} must be >= {low}")
    for name, allowed in (choices or {}).items():
        if name in kwargs and kwargs[name] not in allowed:
            raise ConfigError(f"{what}.{name}={kwargs[name]!r} is not one of {list(allowed)}")
    try:
        return cls(**kwargs)
    except (ConfigError, LayoutError):
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: {one_line(exc)}") from None


def container(node: Any, what: str) -> Any:
    """A plain dict / list / value from an OmegaConf node (interpolations resolved)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(node, resolve=True)
        except Exception as exc:  # noqa: BLE001 - interpolation errors are bad input
            key = getattr(exc, "full_key", None)
            raise ConfigError(f"{what}: {key + ': ' if key else ''}{one_line(exc)}") from None
    return node
