"""Test doubles at the true external edge: model outputs.

`ScriptedGenerator` is an in-process `Generator` replaying per-role queues of
outputs. `ScriptedServer` is a real HTTP server on 127.0.0.1 speaking the
OpenAI chat / completions API, whose replies a test function decides.
"""
from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megatron_marsrl.agents.client import Completion, GenerationRequest

Reply = str | tuple[str, str]  # text, or (text, finish_reason)


def role_of(prompt: str) -> str:
    """Which built-in role a prompt belongs to (by the section headers our prompts use)."""
    if "Reviewer's report:" in prompt:
        return "corrector"
    if "Proposed solution:" in prompt:
        return "verifier"
    return "solver"


def prompt_text(messages: Sequence[dict[str, str]]) -> str:
    return "\n\n".join(m["content"] for m in messages)


def section(prompt: str, header: str) -> str:
    """The text of a prompt section, e.g. section(p, "Proposed solution:")."""
    after = prompt.split(header, 1)[1]
    return re.split(r"\n\n(?:Write your review|Reviewer's report:|Weigh each finding)", after, maxsplit=1)[0].strip()


class ScriptedGenerator:
    """Replays queued replies per role; records every request it got."""

    def __init__(self, script: dict[str, list[Reply]] | None = None,
                 respond: Callable[[str, str], Reply] | None = None) -> None:
        self.script = {role: list(replies) for role, replies in (script or {}).items()}
        self.respond = respond
        self.requests: list[tuple[str, GenerationRequest]] = []

    async def generate(self, request: GenerationRequest) -> list[Completion]:
        prompt = prompt_text(request.messages)
        role = role_of(prompt)
        self.requests.append((role, request))
        out = []
        for _ in range(request.n):
            if self.respond is not None:
                reply = self.respond(role, prompt)
            else:
                queue = self.script.get(role)
                if not queue:
                    raise AssertionError(f"script has no reply left for the {role}; requests so far: "
                                         f"{[r for r, _ in self.requests]}")
                reply = queue.pop(0)
            text, finish = (reply, "stop") if isinstance(reply, str) else reply
            out.append(Completion(text=text, finish_reason=finish, prompt=prompt))
        return out

    def roles_called(self) -> list[str]:
        return [role for role, _ in self.requests]


def oracle_respond(answers: dict[str, tuple[str, str, str]]) -> Callable[[str, str], Reply]:
    """A deterministic model: per problem marker -> (reference, solver answer, corrector answer).

    The verifier is perfect: "Correct" iff the judged boxed answer equals the reference.
    """
    def respond(role: str, prompt: str) -> Reply:
        marker = next(m for m in answers if f"[{m}]" in prompt)
        reference, first, fixed = answers[marker]
        if role == "solver":
            return f"<think>scratch work</think>Working.\n\\boxed{{{first}}}"
        if role == "corrector":
            return f"I agree with the report.\n\\boxed{{{fixed}}}"
        judged = re.findall(r"\\boxed\{([^}]*)\}", section(prompt, "Proposed solution:"))
        ok = bool(judged) and judged[-1] == reference
        return "Findings: None\nVerdict: Correct" if ok else "Findings:\n1. Arithmetic slip.\nVerdict: Wrong"
    return respond


class _QuietServer(ThreadingHTTPServer):
    """A client that gave up on a reply (a timeout test) is expected: no traceback for it."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class ScriptedServer:
    """An OpenAI-compatible HTTP server in a thread; `handler(path, body) -> (status, payload)`.

    payload may be a dict (sent as JSON) or a str (sent raw). Use as a context manager.
    """

    def __init__(self, handler: Callable[[str, dict[str, Any]], tuple[int, Any]]) -> None:
        self.handler = handler
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._lock:
                    outer.requests.append((self.path, body))
                status, payload = outer.handler(self.path, body)
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def openai_reply(path: str, body: dict[str, Any], texts: Sequence[Reply]) -> dict[str, Any]:
    """An OpenAI-style JSON reply carrying `texts` as choices of the request kind at `path`."""
    choices = []
    for i, reply in enumerate(texts):
        text, finish = (reply, "stop") if isinstance(reply, str) else reply
        if path.endswith("/chat/completions"):
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
        else:
            choices.append({"index": i, "text": text, "finish_reason": finish})
    return {"id": "x", "object": "chat.completion", "model": body.get("model"), "choices": choices}


def request_prompt(path: str, body: dict[str, Any]) -> str:
    """The prompt text of a chat or completions request."""
    return prompt_text(body["messages"]) if path.endswith("/chat/completions") else body["prompt"]


def oracle_handler(respond: Callable[[str, str], Reply]) -> Callable[[str, dict[str, Any]], tuple[int, Any]]:
    """Server handler answering every request with `respond(role, prompt)` for each of n choices."""
    def handle(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        prompt = request_prompt(path, body)
        texts = [respond(role_of(prompt), prompt) for _ in range(body.get("n", 1))]
        return 200, openai_reply(path, body, texts)
    return handle
