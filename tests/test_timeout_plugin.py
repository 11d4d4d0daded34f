"""The per-test time limit (tests/timeout_plugin.py) fails a hung test and lets the run go on."""
import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


def test_a_hung_test_fails_with_its_stacks_and_the_next_one_runs(pytester, monkeypatch):
    monkeypatch.setenv("MARSRL_TEST_TIMEOUT", "2")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_inner="""
        import subprocess, sys, time

        def test_hangs_in_a_child():
            subprocess.run([sys.executable, "-c", "import time; time.sleep(60)"])

        def test_after_it():
            assert True
    """)
    result = pytester.runpytest_subprocess("-p", "tests.timeout_plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*TestTimeout: call ran past 2 s (MARSRL_TEST_TIMEOUT)*"])
    # the watchdog's stacks, in the failed test's captured stderr: where it hung
    result.stdout.fnmatch_lines(["*Captured stderr call*", "*test_hangs_in_a_child: call ran past 2 s*",
                                 "*File*test_inner.py*line 4 in test_hangs_in_a_child*"])
    assert result.duration < 30


def test_a_bad_limit_is_a_usage_error(pytester, monkeypatch):
    monkeypatch.setenv("MARSRL_TEST_TIMEOUT", "ten")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_inner="def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "tests.timeout_plugin", "-p", "no:cacheprovider")
    assert result.ret == 4  # pytest's usage error, before any test ran
    result.stderr.fnmatch_lines(["*MARSRL_TEST_TIMEOUT='ten': give whole seconds*"])


def test_a_marked_test_has_its_own_limit(pytester, monkeypatch):
    monkeypatch.setenv("MARSRL_TEST_TIMEOUT", "60")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_inner="""
        import time

        import pytest

        @pytest.mark.time_limit(1)
        def test_marked():
            time.sleep(30)

        @pytest.mark.time_limit(5)
        def test_marked_longer_than_it_runs():
            time.sleep(2)
    """)
    result = pytester.runpytest_subprocess("-p", "tests.timeout_plugin", "-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*TestTimeout: call ran past 1 s (time_limit)*"])
    assert result.duration < 25
