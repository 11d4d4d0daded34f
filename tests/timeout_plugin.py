"""A time limit on every phase of every test (setup, call, teardown), so that a hung engine
start or a deadlocked rank fails that test within minutes and the run still ends with its
summary, instead of eating CI's 90 minutes and printing nothing.

The limit is MARSRL_TEST_TIMEOUT seconds (default 600, 0 turns every limit off); a test marked
``@pytest.mark.time_limit(seconds)`` gets its own instead (the main job: 6-11 minutes on 2 busy
cores, with its own subprocess timeout inside). On expiry a watchdog thread writes every thread's
stack to the test's captured stderr (where it hung) and signals the main thread (SIGUSR2, which
interrupts a blocking wait), whose handler raises TestTimeout; subprocess.run kills its child
on the way out. Not SIGALRM: math_verify sets and cancels its own alarms in the main thread.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

import pytest

DEFAULT_LIMIT_S = 600
_limit = {"s": DEFAULT_LIMIT_S}


class TestTimeout(Exception):
    """A test phase ran past its time limit."""


def pytest_configure(config) -> None:
    raw = os.environ.get("MARSRL_TEST_TIMEOUT", str(DEFAULT_LIMIT_S))
    try:
        _limit["s"] = int(raw)
    except ValueError:
        raise pytest.UsageError(f"MARSRL_TEST_TIMEOUT={raw!r}: give whole seconds (0 turns the limit off)") from None
    if _limit["s"] < 0:
        raise pytest.UsageError(f"MARSRL_TEST_TIMEOUT={raw}: give whole seconds >= 0 (0 turns the limit off)")
    config.addinivalue_line("markers", "time_limit(seconds): this test's limit per phase instead of "
                                       "MARSRL_TEST_TIMEOUT's (tests/timeout_plugin.py)")


def _limited(item, phase: str):
    seconds = _limit["s"]
    marker = item.get_closest_marker("time_limit")
    if seconds and marker is not None:
        if len(marker.args) != 1 or not isinstance(marker.args[0], int) or marker.args[0] < 1:
            raise pytest.UsageError(f"{item.nodeid}: time_limit takes one positional number of seconds >= 1")
        seconds = marker.args[0]
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    message = f"{phase} ran past {seconds} s ({'time_limit' if marker else 'MARSRL_TEST_TIMEOUT'})"

    def expire(signum, frame):
        raise TestTimeout(message)

    def watchdog():
        print(f"\n{item.nodeid}: {message}; stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, expire)
    timer = threading.Timer(seconds, watchdog)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a watchdog already running finishes (and signals) before the handler goes
        signal.signal(signal.SIGUSR2, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _limited(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _limited(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _limited(item, "teardown")
