"""megatron/launch.py: ranks as new interpreters, or forked from the fork server the test suite
runs (conftest.py): the same results, failures reported with the rank's traceback, and any call
whose environment differs from the server's gets interpreters."""
import os

import pytest

from megatron_marsrl.megatron.launch import LaunchError, fork_server, launch

FACTS = "tests.megatron.workers:process_facts"


def test_forked_ranks_come_from_the_server_and_interpreters_otherwise(launch_fork_server, monkeypatch):
    if launch_fork_server is None:
        pytest.skip("MARSRL_LAUNCH_FORK=0: no fork server in this session")
    server_pid = launch_fork_server.proc.pid
    forked = launch(FACTS, 2)
    assert [r["rank"] for r in forked] == [0, 1]
    assert all(r["ppid"] == server_pid for r in forked)
    assert all(r["ppid"] != server_pid for r in launch(FACTS, 2, env={"MARSRL_TEST_MARKER": "x"}))
    monkeypatch.setenv("MARSRL_TEST_MARKER", "y")  # changed after the server started: interpreters
    fresh = launch(FACTS, 2)
    assert all(r["ppid"] == os.getpid() and r["marker"] == "y" for r in fresh)


def test_a_failing_rank_is_reported_with_its_traceback_either_way(launch_fork_server, monkeypatch):
    with pytest.raises(LaunchError, match=r"rank 1 exited with code 1(.|\n)*rank 1 failed on purpose"):
        launch(FACTS, 2, {"fail_rank": 1})
    monkeypatch.setenv("MARSRL_TEST_MARKER", "z")
    with pytest.raises(LaunchError, match=r"rank 0 exited with code 1(.|\n)*rank 0 failed on purpose"):
        launch(FACTS, 2, {"fail_rank": 0})


def test_only_one_fork_server_at_a_time(launch_fork_server):
    if launch_fork_server is None:
        with fork_server():
            with pytest.raises(RuntimeError, match="already running"), fork_server():
                pass
    else:
        with pytest.raises(RuntimeError, match="already running"), fork_server():
            pass
