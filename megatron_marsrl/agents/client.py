"""Text generation for the agents: the `Generator` protocol and an HTTP client.

`Generator` is the one thing the inference loop and the training rollout need
from a model: "given these chat messages, sample n completions". The
`OpenAIClient` here implements it against any OpenAI-compatible server
(SGLang, vLLM, ...) via /v1/chat/completions or /v1/completions; the trainer
plugs its in-process SGLang engine in through the same protocol.

Transport: aiohttp when installed, else urllib run in a worker thread.
Failures: connection errors, timeouts, HTTP 408/429/5xx are retried with
exponential backoff; other HTTP errors and malformed replies fail at once.
Either way the caller gets an `EndpointError` naming the URL and the cause.
"""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}
_RETRIABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(kw_only=True)
class SamplingParams:
    """Sampling settings of one request. Defaults: MarsRL's evaluation settings."""

    temperature: float = 0.6
    """Softmax temperature; 0 is greedy."""
    top_p: float = 0.95
    """Nucleus sampling mass, in (0, 1]."""
    max_tokens: int = 65536
    """Most new tokens per completion (MarsRL evaluates with up to 64k)."""
    stop: tuple[str, ...] = ()
    """Extra stop strings."""
    seed: int | None = None
    """Sampling seed passed to the server, when it honours one."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(kw_only=True)
class GenerationRequest:
    """Sample `n` completions of one prompt."""

    messages: list[Message]
    """The chat messages; completion-style endpoints get them rendered to text."""
    n: int = 1
    """Number of independent completions."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """How to sample."""


@dataclass(kw_only=True)
class Completion:
    """One generated completion."""

    text: str
    """The generated text (a <think> block included when the server leaves it in)."""
    finish_reason: str
    """"stop", "length", or "" when the server did not say."""
    reasoning: str | None = None
    """Reasoning the server split off (SGLang --reasoning-parser), if any."""
    prompt: str = ""
    """The prompt text as the model saw it, when known."""
    prompt_token_ids: list[int] | None = None
    """Prompt tokens, when the generator reports them."""
    token_ids: list[int] | None = None
    """Generated tokens, when the generator reports them."""
    logprobs: list[float] | None = None
    """Per-token log-probs of `token_ids` under the sampling engine, when reported."""
    token_versions: list[int] | None = None
    """Weight version the engine generated each of `token_ids` with, as the engine reported it
    (segment rollout spans versions)."""
    routed_experts: object | None = None
    """MoE routing the engine used for prompt + output tokens (an int tensor [tokens-1, layers,
    top_k]) when routing replay is on; opaque to the agents."""


class Generator(Protocol):
    """Extension point: anything that samples completions for chat messages."""

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        """Return exactly `request.n` completions of `request.messages`."""
        ...


class EndpointError(RuntimeError):
    """A model endpoint failed for good (after retries, or with a non-retriable error)."""


@dataclass(kw_only=True)
class EndpointConfig:
    """One OpenAI-compatible endpoint."""

    base_url: str
    """Server address, e.g. "http://127.0.0.1:30000" (a trailing "/v1" is accepted)."""
    model: str = "default"
    """The "model" field of requests (SGLang accepts any name for its one model)."""
    api: str = "chat"
    """"chat" (/v1/chat/completions) or "completions" (/v1/completions, prompt rendered locally)."""
    api_key: str | None = None
    """Bearer token, if the server wants one."""
    timeout_s: float = 3600.0
    """Per-request time limit; long reasoning completions take many minutes."""
    max_retries: int = 3
    """Retries after the first attempt for connection errors, timeouts and HTTP 408/429/5xx."""
    backoff_s: float = 1.0
    """First retry delay; doubled after each retry, capped at `max_backoff_s`."""
    max_backoff_s: float = 30.0
    """Largest retry delay."""
    max_concurrency: int = 64
    """Most requests in flight to this endpoint at once."""
    transport: str = "auto"
    """"aiohttp", "urllib" (stdlib, in a thread) or "auto" (aiohttp when installed)."""

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', got {self.api!r}")
        if self.transport not in ("auto", "aiohttp", "urllib"):
            raise ValueError(f"transport must be 'auto', 'aiohttp' or 'urllib', got {self.transport!r}")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.backoff_s < 0 or self.max_concurrency < 1:
            raise ValueError("timeout_s must be > 0, max_retries >= 0, backoff_s >= 0, max_concurrency >= 1; "
                             f"got {self.timeout_s}, {self.max_retries}, {self.backoff_s}, {self.max_concurrency}")

    @property
    def url(self) -> str:
        root = self.base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        return root + ("/v1/chat/completions" if self.api == "chat" else "/v1/completions")


def render_plain(messages: Sequence[Message]) -> str:
    """Fallback prompt rendering for /v1/completions without a tokenizer: the
    message contents joined by blank lines (fine for scripted or base models)."""
    return "\n\n".join(m["content"] for m in messages)


def chat_template_renderer(tokenizer_path: str) -> Callable[[Sequence[Message]], str]:
    """Render messages with a Hugging Face tokenizer's chat template."""
    from transformers import AutoTokenizer  # deferred: only /v1/completions users need it

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda messages: tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                          add_generation_prompt=True)


class _Retriable(Exception):
    """An attempt failed in a way worth retrying."""


class OpenAIClient:
    """`Generator` over an OpenAI-compatible HTTP endpoint. Use as `async with`, inside one
    event loop (its semaphore and HTTP session belong to the loop that first uses them)."""

    def __init__(self, config: EndpointConfig,
                 render: Callable[[Sequence[Message]], str] = render_plain) -> None:
        self.config = config
        self._render = render
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._session: Any = None
        self._use_aiohttp = config.transport == "aiohttp" or (config.transport == "auto" and _has_aiohttp())

    async def __aenter__(self) -> OpenAIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        payload, prompt = self._payload(request)
        async with self._semaphore:
            reply = await self._post_with_retries(payload)
        completions = self._completions(reply, prompt)
        if len(completions) != request.n:
            raise EndpointError(f"{self.config.url} returned {len(completions)} choices, expected n={request.n}")
        return completions

    def _payload(self, request: GenerationRequest) -> tuple[dict[str, Any], str]:
        s = request.sampling
        payload: dict[str, Any] = {"model": self.config.model, "n": request.n, "temperature": s.temperature,
                                   "top_p": s.top_p, "max_tokens": s.max_tokens}
        if s.stop:
            payload["stop"] = list(s.stop)
        if s.seed is not None:
            payload["seed"] = s.seed
        if self.config.api == "chat":
            payload["messages"] = request.messages
            return payload, render_plain(request.messages)
        prompt = self._render(request.messages)
        payload["prompt"] = prompt
        return payload, prompt

    def _completions(self, reply: dict[str, Any], prompt: str) -> list[Completion]:
        try:
            choices = sorted(reply["choices"], key=lambda c: c.get("index", 0))
            out = []
            for c in choices:
                if self.config.api == "chat":
                    message = c["message"]
                    text, reasoning = message.get("content") or "", message.get("reasoning_content")
                else:
                    text, reasoning = c["text"], None
                out.append(Completion(text=text, finish_reason=c.get("finish_reason") or "",
                                      reasoning=reasoning, prompt=prompt))
            return out
        except (KeyError, TypeError, AttributeError) as exc:
            raise EndpointError(f"{self.config.url} sent a reply without the expected fields "
                                f"({exc!r}): {json.dumps(reply)[:300]}") from exc

    async def _post_with_retries(self, payload: dict[str, Any]) -> dict[str, Any]:
        cfg, delay = self.config, self.config.backoff_s
        for attempt in range(cfg.max_retries + 1):
            try:
                return await self._post_once(payload)
            except _Retriable as exc:
                last = exc
                if attempt < cfg.max_retries:
                    await asyncio.sleep(min(delay, cfg.max_backoff_s))
                    delay *= 2
        raise EndpointError(f"POST {cfg.url} failed after {cfg.max_retries + 1} attempts: {last}. "
                            "Check that the server is running and the URL is right.") from last

    async def _post_once(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self._use_aiohttp:
            status, body = await self._post_aiohttp(payload)
        else:
            status, body = await asyncio.to_thread(self._post_urllib, payload)
        if status in _RETRIABLE_STATUS:
            raise _Retriable(f"HTTP {status}: {body[:200]!r}")
        if status != 200:
            raise EndpointError(f"POST {self.config.url} returned HTTP {status}: {body[:500]!r}")
        try:
            return json.loads(body)
        except json.JSONDecodeError as exc:
            raise EndpointError(f"{self.config.url} sent non-JSON ({exc}): {body[:300]!r}") from exc

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    async def _post_aiohttp(self, payload: dict[str, Any]) -> tuple[int, str]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        try:
            async with self._session.post(self.config.url, json=payload, headers=self._headers()) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise _Retriable(f"{type(exc).__name__}: {exc}") from exc

    def _post_urllib(self, payload: dict[str, Any]) -> tuple[int, str]:
        data = json.dumps(payload).encode()
        req = urllib.request.Request(self.config.url, data=data, headers=self._headers(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                return resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise _Retriable(f"{type(exc).__name__}: {exc}") from exc


def _has_aiohttp() -> bool:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return False
    return True
