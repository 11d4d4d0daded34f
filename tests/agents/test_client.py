"""The OpenAI-compatible client against a real local HTTP server."""
from __future__ import annotations

import asyncio
import time

import pytest

from megatron_marsrl.agents.client import (EndpointConfig, EndpointError, GenerationRequest, OpenAIClient,
                                           SamplingParams)

from .helpers import ScriptedServer, openai_reply

TRANSPORTS = ["aiohttp", "urllib"]


def generate(config: EndpointConfig, request: GenerationRequest, render=None):
    async def go():
        kwargs = {"render": render} if render else {}
        async with OpenAIClient(config, **kwargs) as client:
            return await client.generate(request)
    return asyncio.run(go())


def request(n: int = 1) -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "user", "content": "2+3?"}], n=n,
                             sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=32, seed=1))


def fast(url: str, **kw) -> EndpointConfig:
    return EndpointConfig(base_url=url, backoff_s=0.01, **kw)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_round_trip(api, transport):
    def handler(path, body):
        return 200, openai_reply(path, body, [f"reply {i}" for i in reversed(range(body["n"]))][::-1])

    with ScriptedServer(handler) as server:
        out = generate(fast(server.url + "/v1", api=api, transport=transport, model="m1"), request(n=3),
                       render=lambda msgs: "RENDERED:" + msgs[0]["content"])
    assert [c.text for c in out] == ["reply 0", "reply 1", "reply 2"]
    path, body = server.requests[0]
    assert path == ("/v1/chat/completions" if api == "chat" else "/v1/completions")
    assert body["n"] == 3 and body["model"] == "m1" and body["max_tokens"] == 32 and body["seed"] == 1
    assert body["temperature"] == 0.7 and body["top_p"] == 0.9
    if api == "chat":
        assert body["messages"] == [{"role": "user", "content": "2+3?"}]
    else:
        assert body["prompt"] == "RENDERED:2+3?" and out[0].prompt == "RENDERED:2+3?"


def test_choices_are_ordered_by_index_and_reasoning_kept():
    def handler(path, body):
        return 200, {"choices": [
            {"index": 1, "message": {"content": "b"}, "finish_reason": "length"},
            {"index": 0, "message": {"content": "a", "reasoning_content": "thought"}, "finish_reason": "stop"}]}

    with ScriptedServer(handler) as server:
        out = generate(fast(server.url), request(n=2))
    assert [(c.text, c.finish_reason, c.reasoning) for c in out] == [("a", "stop", "thought"),
                                                                     ("b", "length", None)]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_retries_transient_errors_then_succeeds(transport):
    calls = []

    def handler(path, body):
        calls.append(1)
        return (503, "busy") if len(calls) < 3 else (200, openai_reply(path, body, ["ok"]))

    with ScriptedServer(handler) as server:
        out = generate(fast(server.url, max_retries=3, transport=transport), request())
    assert out[0].text == "ok" and len(calls) == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gives_up_after_retries_with_a_clear_error(transport):
    with ScriptedServer(lambda path, body: (500, "boom")) as server:
        with pytest.raises(EndpointError, match=r"failed after 3 attempts: HTTP 500.*boom"):
            generate(fast(server.url, max_retries=2, transport=transport), request())
        assert len(server.requests) == 3


def test_client_errors_are_not_retried():
    with ScriptedServer(lambda path, body: (400, '{"error": "prompt too long"}')) as server:
        with pytest.raises(EndpointError, match="HTTP 400.*prompt too long"):
            generate(fast(server.url, max_retries=5), request())
        assert len(server.requests) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_connection_refused_names_the_url(transport):
    with ScriptedServer(lambda p, b: (200, {})) as server:
        url = server.url  # the port is closed after the block
    with pytest.raises(EndpointError, match=f"POST {url}/v1/chat/completions failed after 2 attempts"):
        generate(fast(url, max_retries=1, transport=transport), request())


def test_timeout_is_retried_then_reported():
    def handler(path, body):
        time.sleep(0.5)
        return 200, openai_reply(path, body, ["late"])

    with ScriptedServer(handler) as server:
        with pytest.raises(EndpointError, match="failed after 2 attempts"):
            generate(fast(server.url, max_retries=1, timeout_s=0.1), request())


@pytest.mark.parametrize("payload, match", [("not json", "non-JSON"), ({"nochoices": 1}, "expected fields"),
                                            ({"choices": []}, "returned 0 choices, expected n=1")])
def test_malformed_replies(payload, match):
    with ScriptedServer(lambda path, body: (200, payload)) as server:
        with pytest.raises(EndpointError, match=match):
            generate(fast(server.url), request())


def test_concurrency_is_bounded():
    in_flight, peak = [0], [0]
    import threading
    lock = threading.Lock()

    def handler(path, body):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return 200, openai_reply(path, body, ["x"])

    async def go(url):
        async with OpenAIClient(fast(url, max_concurrency=2)) as client:
            await asyncio.gather(*(client.generate(request()) for _ in range(8)))

    with ScriptedServer(handler) as server:
        asyncio.run(go(server.url))
    assert peak[0] == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"base_url": "localhost:30000"}, "must start with http"),
    ({"base_url": "http://x", "api": "responses"}, "api must be"),
    ({"base_url": "http://x", "timeout_s": 0}, "timeout_s must be > 0"),
])
def test_endpoint_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EndpointConfig(**kwargs)


def test_sampling_validation():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
