"""Which output directories we may delete: one rule for every `--force` and every replace.

Every directory we write as an output (converted checkpoints, the self-check's working
directory) carries a marker file, :data:`MARKER`. An existing output path may be replaced only
when it is empty or carries the marker, and ``--force`` is needed for a non-empty one; `/`, the
home directory, the working directory and its parents are never replaced. A directory that
some other tool (or a person) made is therefore never deleted, whatever the flags say.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

MARKER = ".marsrl-output"


def mark(path: str | Path, kind: str) -> None:
    """Declare ``path`` (a directory we just created) an output of ours that a later run may replace."""
    (Path(path) / MARKER).write_text(json.dumps({"written_by": "megatron_marsrl", "kind": kind}) + "\n")


def is_ours(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _protected(path: Path) -> bool:
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    return resolved == Path(resolved.anchor) or resolved == Path.home().resolve() or cwd.is_relative_to(resolved)


def check_replaceable(path: str | Path, *, force: bool) -> None:
    """Raise FileExistsError unless an output may be written to ``path`` (a missing or empty
    directory; with ``force``, a non-empty one only if it carries our marker)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or not path.is_dir():
        raise FileExistsError(f"output {path} exists and is not a directory (or is a symbolic link); "
                              "choose another path")
    if _protected(path):
        raise FileExistsError(f"output {path} is /, the home directory or the working directory (or one of its "
                              "parents); it is never replaced: choose a new directory")
    if not any(path.iterdir()):
        return
    if not force:
        raise FileExistsError(f"output {path} exists and is not empty; choose another path or pass --force")
    if not is_ours(path):
        raise FileExistsError(f"output {path} is not empty and was not written by marsrl (no {MARKER} file in it); "
                              "--force replaces only marsrl's own outputs: delete it yourself or choose another path")


def remove(path: str | Path) -> None:
    """Delete an existing output directory, if the rule allows it (else FileExistsError)."""
    check_replaceable(path, force=True)
    if Path(path).exists():
        shutil.rmtree(path)


def replace(tmp: str | Path, path: str | Path, *, kind: str) -> None:
    """Mark the complete output ``tmp`` and rename it to ``path``, removing the old ``path``
    under the rule (the caller checked ``force`` before doing the work)."""
    mark(tmp, kind)
    remove(path)
    os.rename(tmp, path)


def prepare_dir(path: str | Path, *, kind: str) -> Path:
    """Create (or reuse) a working directory of ours: missing, empty or marked; then marked."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink() and any(path.iterdir()) and not is_ours(path):
        raise FileExistsError(f"{path} is not empty and was not written by marsrl (no {MARKER} file in it); "
                              "choose a new or empty directory")
    check_replaceable(path, force=True)  # never a file, a link, /, home or the working directory
    path.mkdir(parents=True, exist_ok=True)
    mark(path, kind)
    return path
