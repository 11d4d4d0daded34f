"""EnginePool over real embedded engines (fast) and two real SGLang servers, one killed
mid-generation, the other asking for an API key (slow)."""
import asyncio
import subprocess
import threading
import time

import pytest

from megatron_marsrl.rollout.engine import EngineRequest, EngineSampling
from megatron_marsrl.rollout.hf_engine import TransformersEngine
from megatron_marsrl.rollout.pool import MEMORY_TAGS, EnginePool, RequestFailedError


class Counting:
    """A real engine that counts its calls and can be made to fail like a dead process."""

    def __init__(self, engine, fail=False):
        self.engine, self.fail, self.calls, self.restarts, self._alive = engine, fail, 0, 0, True

    @property
    def weight_version(self):
        return self.engine.weight_version

    def alive(self):
        return self._alive

    def submit(self, requests, *, on_start=None):
        self.calls += 1
        if self.fail:
            self._alive = False
            raise ConnectionError("connection reset by peer")
        return self.engine.submit(requests, on_start=on_start)

    def restart(self):
        self.restarts += 1
        self.fail, self._alive = False, True

    def update_weights(self, buckets, *, version):
        return self.engine.update_weights(buckets, version=version)

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def hf_engines(tiny_hf):
    return [TransformersEngine(tiny_hf("qwen3"), seed=i) for i in range(2)]


def _reqs(n, max_new=3):
    return [EngineRequest(rid=f"q{i}", prompt_ids=[1 + i, 2, 3], sampling=EngineSampling(max_new_tokens=max_new))
            for i in range(n)]


def test_requests_are_balanced_over_engines(hf_engines):
    a, b = Counting(hf_engines[0]), Counting(hf_engines[1])
    outs = asyncio.run(EnginePool([a, b], max_concurrency=8).generate_many(_reqs(8)))
    assert [o.rid for o in outs] == [f"q{i}" for i in range(8)]
    assert a.calls >= 2 and b.calls >= 2 and a.calls + b.calls == 8


def test_failed_requests_are_retried_elsewhere_and_the_dead_engine_restarted(hf_engines):
    dead, good = Counting(hf_engines[0], fail=True), Counting(hf_engines[1])
    pool = EnginePool([dead, good], max_concurrency=4)
    outs = asyncio.run(pool.generate_many(_reqs(6)))
    assert len(outs) == 6 and all(len(o.output_ids) == 3 for o in outs)
    assert pool.failures and all(f["engine"] == 0 for f in pool.failures)
    time.sleep(0.2)
    assert dead.restarts == 1 and dead.alive()


def test_a_request_failing_everywhere_is_reported_not_dropped(hf_engines):
    pool = EnginePool([Counting(hf_engines[0], fail=True), Counting(hf_engines[1], fail=True)],
                      max_attempts=2, wait_for_engine=1.0)
    with pytest.raises(RequestFailedError, match="'q0'"):
        asyncio.run(pool.generate(_reqs(1)[0]))


class SlowToDie(Counting):
    """A killed server: its connections refused at once, its process seen to exit `after` s later."""

    def __init__(self, engine, after):
        super().__init__(engine, fail=True)
        self.dies_at = time.monotonic() + after

    def alive(self):
        return self._alive and time.monotonic() < self.dies_at

    def submit(self, requests, *, on_start=None):
        self.calls += 1
        raise ConnectionError("connection refused")


def test_a_lone_engine_dying_after_an_update_aborts_the_step_once_seen_dead(hf_engines):
    """The retries wait for a refusing engine's exit to show (RETRY_PAUSE) instead of spending
    every attempt on it at once: the pool then restarts it, and the request fails because a
    restart holds the initial weights, which a resume after the abort takes care of."""
    dying = SlowToDie(hf_engines[0], after=0.3)
    pool = EnginePool([dying])
    pool.version = dying.engine.weight_version = 1  # after the first weight sync
    try:
        with pytest.raises(RequestFailedError, match="initial weights, not version 1"):
            asyncio.run(pool.generate(_reqs(1)[0]))
    finally:
        dying.engine.weight_version = 0
    time.sleep(0.2)  # the restart runs in the background
    assert dying.calls == 1 and dying.restarts == 1


def test_engines_with_stale_weights_get_no_requests(hf_engines, tiny_hf):
    stale = Counting(TransformersEngine(tiny_hf("qwen3")))
    fresh = Counting(hf_engines[1])
    pool = EnginePool([stale, fresh])
    pool.version = fresh.engine.weight_version = 5  # as if `stale` restarted after a sync
    asyncio.run(pool.generate_many(_reqs(4)))
    assert stale.calls == 0 and fresh.calls == 4
    fresh.engine.weight_version = 0


class Releasing(Counting):
    """An engine with SGLang's memory-saver calls, recording them."""

    def __init__(self, engine):
        super().__init__(engine)
        self.memory = []

    def release_memory(self, tags):
        self.memory.append(("release", tags))

    def resume_memory(self, tags):
        self.memory.append(("resume", tags))


def test_memory_release_reaches_every_engine_that_can(hf_engines):
    saver = Releasing(hf_engines[0])
    pool = EnginePool([saver, Counting(hf_engines[1])])
    assert pool.release_memory(MEMORY_TAGS) == 1  # the embedded engine has nothing to release
    assert pool.resume_memory(("weights",)) == 1
    assert saver.memory == [("release", MEMORY_TAGS), ("resume", ("weights",))]
    with pytest.raises(ValueError, match=r"memory tags \['kv'\]"):
        pool.resume_memory(("kv",))


def test_bad_requests_are_not_retried(hf_engines):
    engine = Counting(hf_engines[0])
    bad = EngineRequest(prompt_ids=[], sampling=EngineSampling(max_new_tokens=2))
    with pytest.raises(ValueError, match="empty prompt"):
        asyncio.run(EnginePool([engine]).generate(bad))
    assert engine.calls == 1


def test_an_attached_server_that_stops_answering_leaves_the_pool(tiny_hf, tmp_path):
    """Another node's server (attached by URL, never restarted from here): unreachable at attach
    time is an error naming the URL; unreachable later, it stops counting as alive, so requests
    and weight syncs leave it out. A slow answer does not count as lost."""
    import socket
    import urllib.error

    from megatron_marsrl.net import free_port
    from megatron_marsrl.rollout.sglang_server import EngineStartError, SGLangServer, SGLangServerConfig

    config = SGLangServerConfig(model_path=tiny_hf("qwen3"), log_dir=str(tmp_path))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(EngineStartError, match=f"{url} does not answer"):
        SGLangServer.attach(config, url)
    server = SGLangServer(config)
    server.url, server.attached = url, True
    assert server.alive()
    import unittest.mock as mock

    with mock.patch("urllib.request.urlopen", side_effect=urllib.error.URLError(socket.timeout("timed out"))):
        with pytest.raises(ConnectionError):
            server.generate([EngineRequest(prompt_ids=[1], sampling=EngineSampling(max_new_tokens=1))])
    assert server.alive()  # slow is not lost
    with pytest.raises(ConnectionError):
        server.generate([EngineRequest(prompt_ids=[1], sampling=EngineSampling(max_new_tokens=1))])
    assert not server.alive()
    pool = EnginePool([server])
    assert pool.update_weights([[("w", None)]], version=1) == 0  # nothing live to send to
    server.shutdown()  # an attached server's process is not ours: nothing to stop


def test_a_changed_server_set_frees_the_old_broadcast_group_on_the_servers_still_here(monkeypatch):
    """The pool's side of the group's life (tests/rollout/test_sglang_engine.py frees a real
    group): a lost server makes a new group over the others; the old one is closed on this rank
    and on the servers still here only; shutdown closes the last one on this rank."""
    from megatron_marsrl.rollout import weight_sync

    senders = []

    class RecordingSender:  # the broadcast group itself needs SGLang servers and a process group
        def __init__(self, servers, *, group_name):
            self.servers, self.group_name, self.closed_on, self.sent = list(servers), group_name, None, []
            senders.append(self)

        def send(self, buckets, *, version):
            self.sent.append(version)

        def close(self, servers):
            self.closed_on = [s.url for s in servers]

    class Server:
        weight_version = 0

        def __init__(self, url):
            self.url, self.up = url, True

        def alive(self):
            return self.up

        def shutdown(self):
            self.up = False

    monkeypatch.setattr(weight_sync, "DistributedWeightSender", RecordingSender)
    servers = [Server(f"http://10.0.0.{i}:30000") for i in range(3)]
    pool = EnginePool(servers, by_broadcast=True)
    pool.update_weights([[("w", None)]], version=1)
    pool.update_weights([[("w", None)]], version=2)
    assert len(senders) == 1 and senders[0].sent == [1, 2]  # one group while the servers stay
    servers[1].up = False
    pool.update_weights([[("w", None)]], version=3)
    assert [s.url for s in senders[1].servers] == [servers[0].url, servers[2].url] and senders[1].sent == [3]
    assert senders[0].closed_on == [servers[0].url, servers[2].url]  # not on the lost one
    pool.shutdown()
    assert senders[1].closed_on == []  # this rank only: the servers' side goes with them


def test_abort_cancels_in_flight_requests(hf_engines):
    pool = EnginePool([Counting(hf_engines[0])], max_concurrency=1)

    async def scenario():
        task = asyncio.create_task(pool.generate_many(_reqs(24, max_new=60)))
        await asyncio.sleep(0.1)
        cancelled = pool.abort()
        with pytest.raises(asyncio.CancelledError):
            await task
        return cancelled

    assert asyncio.run(scenario()) >= 5


API_KEY = "s3cret"


@pytest.fixture(scope="module")
def sglang_servers(tiny_hf, tmp_path_factory):
    """Two real SGLang servers (a 4096-token context), started side by side, shared by this
    module's tests; the second asks for an API key (API_KEY). Afterwards no process of theirs is
    left."""
    from megatron_marsrl.rollout.sglang_server import SGLangServer, SGLangServerConfig

    model = tiny_hf("qwen3", max_position_embeddings=4096)
    log_dir = str(tmp_path_factory.mktemp("sglang_logs"))
    servers = [SGLangServer(SGLangServerConfig(model_path=model, max_total_tokens=16384, seed=i, log_dir=log_dir,
                                               api_key=API_KEY if i == 1 else None))
               for i in range(2)]
    starters = [threading.Thread(target=s.start) for s in servers]
    for t in starters:
        t.start()
    for t in starters:
        t.join()
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()
    # these servers only (by their model directory): another pytest worker may be running its own
    leftover = subprocess.run(["pgrep", "-f", f"sglang.launch_server.*{model}"], capture_output=True,
                              text=True).stdout.split()
    assert not leftover, f"orphan SGLang processes: {leftover}"


@pytest.mark.slow
def test_sglang_server_killed_mid_generation_is_retried_elsewhere_and_restarted(sglang_servers):
    servers = sglang_servers
    # start() returned, so both were ready; two servers on two cores answer slowly
    assert all(s.alive() for s in servers), [s.log_tail() for s in servers]
    assert all(s.url.startswith("http://127.0.0.1:") for s in servers)
    pool = EnginePool(servers, max_concurrency=8)

    async def scenario():
        task = asyncio.create_task(pool.generate_many(_reqs(8, max_new=600)))
        await asyncio.sleep(0.5)  # the requests are on both servers, each far from its 600th token
        servers[0].kill()
        return await task

    outs = asyncio.run(scenario())
    assert len(outs) == 8, outs
    assert all(len(o.output_ids) == 600 for o in outs), [(len(o.output_ids), o.finish_reason) for o in outs]
    assert any(f["engine"] == 0 for f in pool.failures), "the kill hit no request"
    deadline = time.time() + 180
    while not servers[0].healthy(timeout=60) and time.time() < deadline:
        time.sleep(1)
    assert servers[0].healthy(timeout=60), servers[0].log_tail()


@pytest.mark.slow
def test_a_server_with_a_key_refuses_requests_without_it(sglang_servers):
    """The pool's own requests carry the key (the kill test above generated on this server too)."""
    import json
    import urllib.error
    import urllib.request

    keyed = sglang_servers[1]
    req = urllib.request.Request(f"{keyed.url}/generate", data=json.dumps({"input_ids": [1, 2, 3]}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(req, timeout=30)
    assert denied.value.code == 401
    out = keyed.generate(_reqs(1, max_new=2))
    assert len(out[0].output_ids) == 2


@pytest.mark.slow
def test_idle_sglang_servers_leave_the_cores_to_the_trainer(sglang_servers):
    """Between rollouts a server waits for requests asleep (SGLang's sleep_on_idle, CPU_ARGS):
    polling without pause, each kept a core busy (10.1 core-seconds in 10 s idle, measured)."""
    import psutil

    def cpu_seconds(server) -> float:
        root = psutil.Process(server.proc.pid)
        return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])

    time.sleep(1.0)  # the previous test's last answers out of the way
    before = [cpu_seconds(s) for s in sglang_servers]
    time.sleep(5.0)
    used = [cpu_seconds(s) - b for s, b in zip(sglang_servers, before)]
    assert all(u < 0.5 for u in used), f"core-seconds used by each idle server in 5 s: {used}"


@pytest.mark.slow
def test_sglang_servers_fork_their_scheduler_and_detokenizer_on_cpu(sglang_servers):
    """On CPU a server's children are forked, not spawned (the shim's plugin, patch two): the
    detokenizer never imports torch, transformers and SGLang again (spawned, it spent 17.9
    core-seconds on that; forked, 0.02; measured), and the server starts in about half the time."""
    import psutil

    for server in sglang_servers:
        children = {c.name(): c for c in psutil.Process(server.proc.pid).children()}
        assert sum(children["sglang::detokenizer"].cpu_times()[:2]) < 3.0, children


@pytest.mark.slow
def test_sglang_server_rejects_bad_requests_without_retry_and_bad_model_path(sglang_servers, tmp_path):
    from megatron_marsrl.rollout.sglang_server import SGLangServerConfig

    with pytest.raises(FileNotFoundError, match="no config.json"):
        SGLangServerConfig(model_path=str(tmp_path / "nope"))
    pool = EnginePool(sglang_servers)
    too_long = EngineRequest(prompt_ids=[1, 2, 3], sampling=EngineSampling(max_new_tokens=5000))  # > 4096
    for _ in sglang_servers:  # whichever server it reaches, the answer is the same, with no retry
        with pytest.raises(ValueError, match="maximum context length"):
            asyncio.run(pool.generate(too_long))
    assert pool.failures == []


@pytest.mark.slow
def test_servers_die_with_a_crashed_trainer(tiny_hf, tmp_path):
    """The trainer process is killed without any clean-up (os._exit): its SGLang server
    must not outlive it (parent-death signal), leaving no process behind."""
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os
        from megatron_marsrl.rollout.sglang_server import SGLangServer, SGLangServerConfig
        server = SGLangServer(SGLangServerConfig(model_path={tiny_hf("qwen3")!r}, max_total_tokens=1024,
                                                 log_dir={str(tmp_path)!r})).start()
        print(server.url.rsplit(":", 1)[1], flush=True)
        os._exit(1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400)
    port = proc.stdout.strip().splitlines()[-1]
    assert port.isdigit(), proc.stdout + proc.stderr[-2000:]
    deadline = time.time() + 60
    while time.time() < deadline:
        alive = subprocess.run(["pgrep", "-f", f"sglang.launch_server.*--port {port}"], capture_output=True,
                               text=True).stdout.split()
        if not alive:
            break
        time.sleep(1)
    assert not alive, f"server processes outlived the trainer: {alive}"


class Scripted:
    """An engine that waits `queued` s before starting a request and `runs` s before it ends,
    then answers from a real engine or raises `error`."""

    weight_version = 0

    def __init__(self, engine, *, queued=0.0, runs=0.0, error=None):
        self.engine, self.queued, self.runs, self.error, self.calls = engine, queued, runs, error, 0

    def submit(self, requests, *, on_start=None):
        import concurrent.futures

        self.calls += 1
        future = concurrent.futures.Future()

        def work():
            outputs = self.engine.generate(requests) if self.error is None else None  # while "queued"
            time.sleep(self.queued)
            if not future.set_running_or_notify_cancel():
                return
            on_start()
            time.sleep(self.runs)
            if self.error is not None:
                future.set_exception(self.error)
            else:
                future.set_result(outputs)

        threading.Thread(target=work, daemon=True).start()
        return future

    def shutdown(self):
        pass


def test_time_queued_does_not_count_against_the_timeout(hf_engines):
    from megatron_marsrl.rollout.engine import GenerationTimeout

    slow_queue = Scripted(hf_engines[0], queued=3.0, runs=0.0)
    pool = EnginePool([slow_queue], timeout=GenerationTimeout(base_s=1.0, per_token_s=0.0))
    assert len(asyncio.run(pool.generate(_reqs(1)[0])).output_ids) == 3 and not pool.failures
    slow_run = Scripted(hf_engines[0], queued=0.0, runs=3.0)
    pool = EnginePool([slow_run], timeout=GenerationTimeout(base_s=1.0, per_token_s=0.0), max_attempts=2)
    with pytest.raises(RequestFailedError, match="TimeoutError"):
        asyncio.run(pool.generate(_reqs(1)[0]))
    assert slow_run.calls == 2  # a timeout is retried


def test_timeouts_scale_with_max_new_tokens():
    from megatron_marsrl.rollout.engine import GenerationTimeout

    timeout = GenerationTimeout(base_s=10, per_token_s=0.5)
    assert timeout.seconds(_reqs(1, max_new=100)) == 60 and timeout.seconds(_reqs(2, max_new=4)) == 12
    with pytest.raises(ValueError, match="base_s"):
        GenerationTimeout(base_s=0)


def test_engine_side_errors_are_not_retried(hf_engines):
    broken = Scripted(hf_engines[0], error=RuntimeError("index out of range in the sampler"))
    spare = Counting(hf_engines[1])
    pool = EnginePool([broken, spare])
    with pytest.raises(RuntimeError, match="index out of range"):
        asyncio.run(pool.generate(_reqs(1)[0]))
    assert broken.calls == 1 and spare.calls == 0 and pool.failures == []


def test_when_every_engine_died_after_an_update_requests_fail_at_once(hf_engines):
    """A restarted engine comes back with its initial weights: once the pool is past version 0
    and no engine is left, waiting `wait_for_engine` cannot help; the request fails at once,
    named, with the attempt that found its engine dead (the trainer aborts the step)."""
    class Restarting(Counting):
        def restart(self):  # as SGLangServer.restart: a new process, the model path's weights
            time.sleep(1.0)
            self.engine.weight_version = 0
            super().restart()

    dead = Restarting(hf_engines[0], fail=True)
    pool = EnginePool([dead], wait_for_engine=600.0)
    pool.version = dead.engine.weight_version = 1  # the engine had taken the first update
    start = time.perf_counter()
    with pytest.raises(RequestFailedError, match=r"'q0'.*initial weights, not version 1.*connection reset"):
        asyncio.run(pool.generate(_reqs(1)[0]))
    assert time.perf_counter() - start < 5.0
    time.sleep(1.5)
    assert dead.restarts == 1
    pool.version = 0  # before any update, a restarting engine is worth waiting for
    assert asyncio.run(pool.generate(_reqs(1)[0])).rid == "q0"
