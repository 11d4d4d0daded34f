"""Override fields of a tree of typed config dataclasses from the command line or a YAML file.

Recipes build a full config in Python; these functions only change fields of it:

    config = apply_mapping(config, load_yaml(path))                 # nested YAML mapping
    config = apply_overrides(config, ["optim.lr=1e-5", "parallel.tp=2", "loss.tis.cap=3"])
    json.dumps(config_to_dict(config))                              # saved next to checkpoints

An override is `dotted.path=value`; the text is parsed by the field's type hint:
  int, float, str         `1e-5`, `2`; a str field takes the text as is
  bool                    true/false, 1/0, yes/no, on/off
  X | None                `null` / `none` / `~` give None (a plain str field keeps "none")
  tuple[X, ...], list[X]  a comma list `1,2,3` (empty text: empty), or a YAML list `[a, "b,c"]`
  Literal[...], Enum      one of the allowed values (an Enum also by member name)
  dict, dict[K, V]        `{a: 1}` (YAML flow mapping) replaces the dict; `field.key=value`
                          sets one key of it
  nested dataclass        `null` turns an optional section off; `{}` turns it on (keeping its
                          values when already on); `default` resets it to the field's default;
                          `{cap: 3}` (YAML flow mapping) sets fields of it. Setting a field
                          inside a section that is off (`loss.tis.cap=3`) turns it on first.

All overrides of one call are merged first (later ones win) and the config is then rebuilt
once with `dataclasses.replace`, innermost section first, so every touched dataclass runs its
`__post_init__` validation again on the final values (never on a half-applied state). Errors
are `OverrideError`s naming the override(s) involved.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import pathlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import yaml

C = TypeVar("C")
_NULL_TEXT = {"null", "none", "~"}
_BOOL_TEXT = {"true": True, "1": True, "yes": True, "on": True,
              "false": False, "0": False, "no": False, "off": False}


class OverrideError(ValueError):
    """An override that names no field, does not parse, or leaves a config invalid."""


class _Mismatch(Exception):
    """A value that does not fit a type hint (turned into an OverrideError by the caller)."""


class _DictKeys(dict):
    """Keys to set in a dict field, merged into its current value when rebuilding."""


@dataclasses.dataclass(kw_only=True)
class _Section:
    """Pending changes to one dataclass of the tree."""

    cls: type
    """The dataclass the changes apply to."""
    path: str = ""
    """Its dotted location with a trailing dot ("loss.tis."); "" for the root."""
    reset: bool = False
    """Start from the field's default instead of the current value."""
    changes: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Field name -> new value (a plain value or a nested `_Section`)."""
    origins: list[str] = dataclasses.field(default_factory=list)
    """The overrides that touched this section or one inside it (for error messages)."""


# ---- public API ---------------------------------------------------------------------------------

def apply_overrides(config: C, overrides: Sequence[str]) -> C:
    """Return a new config with every `dotted.path=value` override applied (see module doc)."""
    root = _root_section(config)
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key.strip():
            raise OverrideError(f"override {override!r}: expected 'dotted.path=value'")
        _put(root, key.strip().split("."), text.strip(), f"override {override!r}")
    return _rebuild(config, root)


def apply_mapping(config: C, mapping: Mapping[str, Any], *, source: str = "<mapping>") -> C:
    """Return a new config with a nested mapping applied (e.g. parsed YAML); keys may be
    dotted. Values are native (YAML-typed) or text, checked against the field types.
    `source` names the mapping in error messages."""
    if not isinstance(mapping, Mapping):
        raise OverrideError(f"{source}: overrides must be a mapping of field names, got {type(mapping).__name__}")
    root = _root_section(config)
    for key, value in mapping.items():
        _put(root, str(key).split("."), value, source)
    return _rebuild(config, root)


def load_yaml(path: str | pathlib.Path) -> dict[str, Any]:
    """Read a YAML file holding a (nested) mapping of overrides; an empty file gives {}."""
    path = pathlib.Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OverrideError(f"override file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OverrideError(f"override file {path}: cannot read it: {exc}") from exc
    except yaml.YAMLError as exc:
        raise OverrideError(f"override file {path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OverrideError(f"override file {path}: must hold a mapping of field names, "
                            f"got {type(data).__name__}")
    return data


def apply_yaml(config: C, path: str | pathlib.Path) -> C:
    """`apply_mapping` of the YAML file at `path`; errors name the file."""
    return apply_mapping(config, load_yaml(path), source=str(path))


def config_to_dict(config: Any) -> Any:
    """A JSON-serialisable copy of a config tree: dataclasses become dicts of their init
    fields (so `apply_mapping(default, config_to_dict(c))` rebuilds `c`), tuples become
    lists, enums their values, paths strings. Raises TypeError for anything else."""
    return _to_plain(config, "config")


# ---- resolving keys against the type tree -------------------------------------------------------

def _root_section(config: Any) -> _Section:
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"expected a dataclass instance, got {type(config).__name__}")
    return _Section(cls=type(config))


@functools.cache
def _settable_fields(cls: type) -> dict[str, Any]:
    """Init fields of `cls` -> resolved type hint (string annotations evaluated)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # NameError for a type that is not importable where cls lives
        raise OverrideError(f"cannot resolve the field types of {cls.__qualname__}: {exc}") from exc
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _put(section: _Section, parts: list[str], value: Any, origin: str) -> None:
    """Record `value` for the field at `parts` below `section`, checked against its type."""
    section.origins.append(origin)
    name, rest = parts[0], parts[1:]
    fields = _settable_fields(section.cls)
    where = section.path + name
    if name not in fields:
        raise OverrideError(_unknown_field(origin, where, section.cls, fields))
    hint = fields[name]
    sub_cls = _dataclass_in(hint)
    if rest and _is_dict(hint) and len(rest) == 1:
        _put_dict_key(section, name, hint, rest[0], value, origin)
    elif rest:
        if sub_cls is None:
            raise OverrideError(f"{origin}: {where} is {_type_name(hint)}, not a config section")
        _put(_child_section(section, name, sub_cls), rest, value, origin)
    elif sub_cls is not None:
        _put_section(section, name, sub_cls, hint, value, origin)
    else:
        try:
            section.changes[name] = _coerce(value, hint)
        except _Mismatch:
            raise OverrideError(f"{origin}: {where} expects {_type_name(hint)}, got {value!r}") from None


def _put_section(parent: _Section, name: str, sub_cls: type, hint: Any, value: Any, origin: str) -> None:
    """A whole nested dataclass given: None, `{}`, `default`, or a mapping of its fields."""
    where = parent.path + name
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise OverrideError(f"{origin}: {where}: not a valid YAML mapping: {exc}") from exc
    if _is_null(value):
        if type(None) not in typing.get_args(hint):
            raise OverrideError(f"{origin}: {where} ({sub_cls.__name__}) is not optional: it cannot be null")
        parent.changes[name] = None
    elif isinstance(value, str) and value.strip() == "default":
        parent.changes[name] = _Section(cls=sub_cls, path=where + ".", reset=True, origins=[origin])
    elif isinstance(value, Mapping):
        child = _child_section(parent, name, sub_cls)
        child.origins.append(origin)
        for key, item in value.items():
            _put(child, str(key).split("."), item, origin)
    else:
        raise OverrideError(f"{origin}: {where} is a {sub_cls.__name__} section: give null, {{}}, "
                            f"default or a mapping, or set its fields as {where}.<field>=..., not {value!r}")


def _put_dict_key(section: _Section, name: str, hint: Any, key: str, value: Any, origin: str) -> None:
    keys = section.changes.get(name)
    if not isinstance(keys, dict):  # a whole-dict value set before stays, this key goes into it
        keys = section.changes[name] = _DictKeys()
    value_hint = typing.get_args(hint)[1] if typing.get_args(hint) else Any
    if value_hint is Any and isinstance(value, str):
        value = _parse_yaml_scalar(value)
    try:
        keys[key] = _coerce(value, value_hint)
    except _Mismatch:
        raise OverrideError(f"{origin}: {section.path}{name}.{key} expects {_type_name(value_hint)}, "
                            f"got {value!r}") from None


def _child_section(parent: _Section, name: str, sub_cls: type) -> _Section:
    child = parent.changes.get(name)
    if not isinstance(child, _Section):  # absent, or turned off by an earlier override
        child = parent.changes[name] = _Section(cls=sub_cls, path=f"{parent.path}{name}.")
    return child


def _unknown_field(origin: str, where: str, cls: type, fields: Mapping[str, Any]) -> str:
    name = where.rpartition(".")[2]
    close = difflib.get_close_matches(name, list(fields), n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    return f"{origin}: unknown field {where} in {cls.__name__}{hint}; valid fields: {', '.join(fields)}"


# ---- rebuilding ---------------------------------------------------------------------------------

def _rebuild(obj: Any, section: _Section) -> Any:
    """`dataclasses.replace(obj, ...)` with nested sections rebuilt first."""
    changes = {}
    for name, change in section.changes.items():
        if isinstance(change, _DictKeys):
            change = {**(getattr(obj, name) or {}), **change}
        elif isinstance(change, _Section):
            base = getattr(obj, name)
            if change.reset or base is None:
                base = _field_default(type(obj), name, change.cls, change.origins)
            change = _rebuild(base, change)
        changes[name] = change
    try:
        return dataclasses.replace(obj, **changes)
    except (ValueError, TypeError, AssertionError) as exc:
        label = section.path.rstrip(".") or "config"
        raise OverrideError(f"{_joined(section.origins)}: invalid {label} "
                            f"({type(obj).__name__}): {exc}") from exc


def _field_default(owner: type, name: str, cls: type, origins: list[str]) -> Any:
    """The field's own default when it is an instance of `cls`, else `cls()`."""
    field = next(f for f in dataclasses.fields(owner) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        if isinstance(value, cls):
            return value
    if isinstance(field.default, cls):
        return dataclasses.replace(field.default)
    try:
        return cls()
    except (TypeError, ValueError) as exc:
        raise OverrideError(f"{_joined(origins)}: cannot build a default "
                            f"{cls.__name__} for {name!r}: {exc}") from exc


def _joined(origins: list[str]) -> str:
    """"override 'a=1'", or "overrides 'a=1', 'b=2'", then any file names."""
    unique = list(dict.fromkeys(origins))
    cli = [o.removeprefix("override ") for o in unique if o.startswith("override ")]
    files = [o for o in unique if not o.startswith("override ")]
    head = [("override " if len(cli) == 1 else "overrides ") + ", ".join(cli)] if cli else []
    return "; ".join(head + files)


# ---- values -------------------------------------------------------------------------------------

def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in _NULL_TEXT)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass of a hint `D` or `D | None`, else None."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _coerce(value: Any, hint: Any) -> Any:
    """`value` (text or native) converted to `hint`; raises _Mismatch."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if type(None) in args and _is_null(value):
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is Literal:
        for allowed in args:
            if value == allowed or (isinstance(value, str) and value == str(allowed)):
                return allowed
        raise _Mismatch
    if origin in (tuple, list) or hint in (tuple, list):
        return _coerce_sequence(value, origin or hint, args)
    if _is_dict(hint):
        return _coerce_dict(value, args)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        for member in hint:
            if value in (member, member.value, member.name) or str(member.value) == value:
                return member
        raise _Mismatch
    return _coerce_scalar(value, hint)


def _coerce_sequence(value: Any, kind: type, args: tuple) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            value = _parse_yaml_scalar(text)
        else:
            value = [item.strip() for item in text.split(",")] if text else []
    if not isinstance(value, (list, tuple)):
        raise _Mismatch
    if not args:
        items = list(value)
    elif kind is tuple and not (len(args) == 2 and args[1] is Ellipsis):  # fixed length
        if len(value) != len(args):
            raise _Mismatch
        items = [_coerce(v, a) for v, a in zip(value, args)]
    else:
        items = [_coerce(v, args[0]) for v in value]
    return tuple(items) if kind is tuple else items


def _coerce_dict(value: Any, args: tuple) -> dict:
    if isinstance(value, str):
        value = {} if not value.strip() else _parse_yaml_scalar(value)
    if not isinstance(value, Mapping):
        raise _Mismatch
    if not args:
        return dict(value)
    return {_coerce(k, args[0]): _coerce(v, args[1]) for k, v in value.items()}


def _coerce_scalar(value: Any, hint: Any) -> Any:
    if isinstance(value, str):
        try:
            if hint is bool:
                return _BOOL_TEXT[value.strip().lower()]
            if hint in (int, float, pathlib.Path):
                return hint(value.strip())
        except (KeyError, ValueError):
            raise _Mismatch from None
        if hint is str:
            return value
    elif type(value) is hint:  # native YAML value of the exact type (a bool is no int)
        return value
    elif type(value) is int and (hint is float or (hint is bool and value in (0, 1))):
        return hint(value)
    raise _Mismatch


def _parse_yaml_scalar(text: str) -> Any:
    """YAML-parse one value (`3` -> 3, `[a, b]` -> list); text that is not YAML stays text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _is_dict(hint: Any) -> bool:
    return hint is dict or typing.get_origin(hint) is dict


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _to_plain(value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name), f"{where}.{f.name}")
                for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return _to_plain(value.value, where)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {str(k): _to_plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, pathlib.PurePath):
        return str(value)
    raise TypeError(f"{where}: {type(value).__name__} is not JSON-serialisable config data")
