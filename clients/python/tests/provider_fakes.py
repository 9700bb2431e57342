"""A local OpenAI- and Anthropic-compatible HTTP server for the provider tests.

It speaks real HTTP/1.1 (keep-alive, chunked server-sent event streams) on
127.0.0.1, answers each request with the next scripted `Reply` (or a default
success), and records every request it received, bytes and headers as they
came. The bodies are shaped like the real providers' (their usage blocks and
their error bodies).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import queue
import socket
import sys
import threading
from typing import Any

MODEL = "model-a"  # the model the lanes in conftest price


@dataclasses.dataclass(frozen=True)
class Reply:
    status: int = 200
    body: dict[str, Any] | None = None
    # A server-sent event stream instead of a JSON body: (event name, data).
    events: list[tuple[str | None, dict[str, Any] | str]] | None = None
    # Seconds to wait before answering (a stall).
    delay: float = 0.0
    # Close the connection after this many events, mid-stream.
    cut_after: int | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def json(self) -> dict[str, Any]:
        value = json.loads(self.body)
        assert isinstance(value, dict)
        return value


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (a stream dropped unread) is no error of the fake's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeProvider:
    def __init__(self) -> None:
        self.replies: queue.Queue[Reply] = queue.Queue()
        self.received: list[Received] = []
        self.stopping = threading.Event()
        self._server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        while not self.replies.empty():
            self.replies.get_nowait()
        self.received.clear()

    def script(self, *replies: Reply) -> None:
        for reply in replies:
            self.replies.put(reply)

    def booked_requests(self) -> list[Received]:
        return [r for r in self.received if r.method == "POST" and _booked_path(r.path)]


def _booked_path(path: str) -> bool:
    return path.endswith(("/chat/completions", "/responses", "/v1/messages"))


def _refusal(method: str, path: str, body: bytes) -> Reply | None:
    """What OpenAI refuses before running a chat completion: metadata on a
    request that does not set `store: true`."""
    if method != "POST" or not path.endswith("/chat/completions"):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    if request.get("metadata") is not None and request.get("store") is not True:
        return Reply(status=400, body=OPENAI_METADATA_WITHOUT_STORE)
    return None


def _default_reply(method: str, path: str) -> Reply:
    if path.endswith("/chat/completions"):
        return Reply(body=openai_chat_body())
    if path.endswith("/responses"):
        return Reply(body=openai_responses_body())
    if path.endswith("/v1/messages"):
        return Reply(body=anthropic_message_body())
    if path.endswith("/messages/count_tokens"):
        return Reply(body={"input_tokens": 12})
    if method == "GET" and path.endswith("/models"):
        model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}
        return Reply(body={"object": "list", "data": [model]})
    return Reply(status=404, body={"error": {"message": "not found", "type": "not_found"}})


def _handler(provider: FakeProvider) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._serve()

        def do_POST(self) -> None:
            self._serve()

        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            path = self.path.split("?", 1)[0]
            headers = {name.lower(): value for name, value in self.headers.items()}
            provider.received.append(Received(self.command, path, headers, body))
            try:
                reply = _refusal(self.command, path, body)
                if reply is None and _booked_path(path):
                    reply = provider.replies.get_nowait()
            except queue.Empty:
                reply = None
            reply = reply or _default_reply(self.command, path)
            try:
                if reply.delay and provider.stopping.wait(reply.delay):
                    return
                if reply.events is not None:
                    self._stream(reply)
                else:
                    self._json(reply)
            except OSError:  # the client gave up (a stall past its timeout)
                self.close_connection = True

        def _json(self, reply: Reply) -> None:
            data = json.dumps(reply.body or {}).encode()
            self.send_response(reply.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def _stream(self, reply: Reply) -> None:
            self.send_response(reply.status)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            assert reply.events is not None
            for index, (name, data) in enumerate(reply.events):
                if reply.cut_after is not None and index >= reply.cut_after:
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                text = data if isinstance(data, str) else json.dumps(data)
                event = (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
                chunk = event.encode()
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


# OpenAI's shapes ------------------------------------------------------------------


def openai_chat_body(
    prompt: int = 1200, cached: int = 1000, completion: int = 30
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "logprobs": None,
                "message": {"role": "assistant", "content": "hello", "refusal": None},
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 10,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
    }


def _responses_usage(input_tokens: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 5},
        "total_tokens": input_tokens + output,
    }


def openai_responses_body(
    input_tokens: int = 800, cached: int = 600, output: int = 40, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": "resp_test",
        "object": "response",
        "created_at": 1_700_000_000,
        "status": status,
        "model": MODEL,
        "output": [
            {
                "type": "message",
                "id": "msg_test",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "hello", "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": None
        if status == "in_progress"
        else _responses_usage(input_tokens, cached, output),
    }


def openai_chat_stream(
    prompt: int = 1200, cached: int = 1000, completion: int = 30
) -> list[tuple[str | None, dict[str, Any] | str]]:
    def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-test",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": MODEL,
            "usage": None,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    final = openai_chat_body(prompt, cached, completion)
    usage_chunk = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [],
        "usage": final["usage"],
    }
    return [
        (None, chunk({"role": "assistant", "content": ""}, None)),
        (None, chunk({"content": "hel"}, None)),
        (None, chunk({"content": "lo"}, None)),
        (None, chunk({}, "stop")),
        (None, usage_chunk),
        (None, "[DONE]"),
    ]


def openai_responses_stream(
    input_tokens: int = 800, cached: int = 600, output: int = 40
) -> list[tuple[str | None, dict[str, Any] | str]]:
    created = openai_responses_body(status="in_progress")
    done = openai_responses_body(input_tokens, cached, output)
    return [
        (
            "response.created",
            {"type": "response.created", "sequence_number": 0, "response": created},
        ),
        (
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "sequence_number": 1,
                "item_id": "msg_test",
                "output_index": 0,
                "content_index": 0,
                "delta": "hello",
                "logprobs": [],
            },
        ),
        (
            "response.completed",
            {"type": "response.completed", "sequence_number": 2, "response": done},
        ),
    ]


OPENAI_OVERFLOW = {
    "error": {
        "message": "This model's maximum context length is 128000 tokens. However, your messages "
        "resulted in 131072 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
}
# OpenAI's chat completions refuse metadata unless the completion is stored.
OPENAI_METADATA_WITHOUT_STORE = {
    "error": {
        "message": "The 'metadata' parameter is only allowed when 'store' is enabled.",
        "type": "invalid_request_error",
        "param": "metadata",
        "code": None,
    }
}
OPENAI_FORBIDDEN = {
    "error": {
        "message": "Country, region, or territory not supported",
        "type": "request_forbidden",
        "param": None,
        "code": "unsupported_country_region_territory",
    }
}
OPENAI_RATE_LIMITED = {
    "error": {
        "message": "Rate limit reached for requests",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
OPENAI_SERVER_ERROR = {
    "error": {
        "message": "The server had an error while processing your request. Sorry about that!",
        "type": "server_error",
        "param": None,
        "code": None,
    }
}


# Anthropic's shapes -----------------------------------------------------------------


def _anthropic_usage(uncached: int, read: int, written: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": uncached,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": written,
        "output_tokens": output,
    }


def anthropic_message_body(
    uncached: int = 25, read: int = 100, written: int = 10, output: int = 15
) -> dict[str, Any]:
    return {
        "id": "msg_test",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "hello"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": _anthropic_usage(uncached, read, written, output),
    }


def anthropic_stream(
    uncached: int = 25, read: int = 100, written: int = 10, output: int = 15
) -> list[tuple[str | None, dict[str, Any] | str]]:
    start = anthropic_message_body(uncached, read, written, 1)
    start["content"] = []
    start["stop_reason"] = None
    return [
        ("message_start", {"type": "message_start", "message": start}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "hello"},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": output},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def anthropic_error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_test"}


ANTHROPIC_OVERFLOW = anthropic_error(
    "invalid_request_error", "prompt is too long: 210000 tokens > 200000 maximum"
)
ANTHROPIC_FORBIDDEN = anthropic_error(
    "permission_error", "Your API key does not have permission to use the specified resource."
)
ANTHROPIC_RATE_LIMITED = anthropic_error(
    "rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit"
)
ANTHROPIC_SERVER_ERROR = anthropic_error("api_error", "Internal server error")
