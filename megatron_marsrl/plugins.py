"""Resolve user extensions (roles, rewards, advantage estimators) by import path.

An extension is named either by its short registry name ("grpo") or by an
import path "package.module:attribute". Resolution never mutates a registry:
callers pass the mapping of built-ins they accept, and the plugin object is
returned to them.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def import_object(spec: str) -> Any:
    """Import "package.module:attr" (attr may be dotted) and return the object.

    Raises ValueError with the expected form when `spec` is malformed or the
    module / attribute does not exist.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"import path {spec!r} must look like 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} from {spec!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj


def resolve(spec: str, builtins: Mapping[str, T], *, what: str) -> T:
    """Return `builtins[spec]`, or the object at import path `spec`.

    `what` names the kind of extension for error messages ("advantage estimator").
    """
    if spec in builtins:
        return builtins[spec]
    if ":" not in spec:
        raise ValueError(f"unknown {what} {spec!r}; choose one of {sorted(builtins)} "
                         "or give an import path 'package.module:attribute'")
    return import_object(spec)
