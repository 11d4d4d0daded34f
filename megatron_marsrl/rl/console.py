"""What `marsrl train` shows, and where everything else goes.

The console (rank 0) shows the progress bar, one summary line per step and per evaluation,
marsrl's own warnings and, at the end, a results table (observe.results_table). Everything
else, from every rank, goes to ``<run>/train.log``: Python logging (Megatron's INFO included),
warnings (captured into logging), and whatever libraries print or write to the file
descriptors 1 and 2 (C++ logs, tqdm bars of model loading). ``--verbose`` keeps the
descriptors on the console and logs to both.

Errors are never hidden: every rank's ERROR records, the traceback of a rank that fails and
the log's path go to its original stderr, and a crash (segfault, abort) dumps the Python stacks
there too.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TextIO

LOG_FILE = "train.log"

_terminal: TextIO | None = None  # rank 0's console (the original stdout), once set up
_errors: TextIO | None = None  # this rank's original stderr
_log_path: Path | None = None


def setup(run_dir: str | Path, *, rank: int, verbose: bool) -> Path:
    """Route this rank's output as the module docstring says; returns the log's path."""
    global _terminal, _errors, _log_path
    _log_path = Path(run_dir) / LOG_FILE
    _log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    _errors = os.fdopen(os.dup(2), "w", buffering=1)
    _terminal = os.fdopen(os.dup(1), "w", buffering=1) if rank == 0 else None
    if not verbose:
        fd = os.open(_log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    fmt = logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [logging.FileHandler(_log_path)]
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        handler.setFormatter(fmt)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    logging.captureWarnings(True)
    if not verbose:
        _console_handlers(rank)
    faulthandler.enable(file=_errors)
    logging.getLogger(__name__).info("marsrl train: rank %d logging to %s (pid %d, argv %s)", rank, _log_path,
                                     os.getpid(), " ".join(sys.argv))
    return _log_path


def _console_handlers(rank: int) -> None:
    """Without --verbose: ERROR records of any logger on this rank's stderr, and on rank 0
    marsrl's own warnings on the console."""
    errors = logging.StreamHandler(_errors)
    errors.setLevel(logging.ERROR)
    errors.setFormatter(logging.Formatter(f"rank{rank} %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(errors)
    if _terminal is not None:
        own = logging.StreamHandler(_terminal)
        own.setLevel(logging.WARNING)
        own.addFilter(lambda record: record.levelno < logging.ERROR)  # errors: the handler above
        own.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logging.getLogger("megatron_marsrl").addHandler(own)


def terminal() -> TextIO:
    """Where the console output goes: rank 0's original stdout once set up, else sys.stdout."""
    return _terminal if _terminal is not None else sys.stdout


def report_failure(exc: BaseException) -> None:
    """Log the traceback (to the log and, as an ERROR, to the console) and point to the log."""
    logging.getLogger(__name__).error("failed:\n%s", "".join(traceback.format_exception(exc)).rstrip())
    if _errors is not None:
        print(f"marsrl train: rank {os.environ.get('RANK', 0)} failed: {type(exc).__name__}: {exc}"
              f"\nfull log: {_log_path}", file=_errors, flush=True)
