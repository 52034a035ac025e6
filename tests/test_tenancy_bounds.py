"""Bounded work per request, checked before the engine queues it: logit_bias keys (ASCII digits,
at most 300, no token twice), every client-filled field in the pre-tokenization bound, stop
strings at their allowed maximum served, a connection that never finishes its headers closed, and
the streaming detokenizer's window bounded whatever ids come."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import LiveServer, live_server, save_tiny_chat_model
from tiny_tokenizers import byte_level, token_id

from radixlm.config import ServerConfig
from radixlm.detokenizer import MAX_UNREAD, IncrementalDetokenizer
from radixlm.server.protocol import MAX_LOGIT_BIAS_ENTRIES

pytestmark = pytest.mark.timeout(120)
CONTEXT = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-bounds"), context_len=CONTEXT)
    config = ServerConfig(model_name="tiny", header_timeout_s=0.5)
    with live_server(model, server=config) as live:
        yield live


def refused(server: LiveServer, path: str, body: dict[str, Any], param: str) -> str:
    """POST `body`: a 400 naming `param`; the error message. The server stays idle after."""
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert server.wait_idle()["idle"]
    return str(error["message"])


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    "bias",
    [
        {"²": 1},  # a digit str.isdigit() takes and int() refuses
        {"٣": 1},  # an Arabic-Indic digit: int() reads it, a token id it is not
        {"12345678901": 1},  # more digits than any token id has
        {"9" * 5000: 1},
        {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)},
        {"7": 60, "07": 60},  # one token twice: the biases would add past the clamp
    ],
    ids=["superscript", "arabic-indic", "eleven-digits", "5000-digits", "301-entries", "twice"],
)
def test_bad_logit_bias_keys_are_400s(server: LiveServer, bias: dict[str, float]) -> None:
    message = refused(server, "/v1/completions", completion(logit_bias=bias), "logit_bias")
    assert "logit_bias" in message


def test_good_logit_bias_keys_are_served(server: LiveServer) -> None:
    bias = {"0000000007": 5.0, **{str(i): -1.0 for i in range(8, 8 + 255)}}
    response = server.post("/v1/completions", json=completion(logit_bias=bias))
    assert response.status_code == 200, response.text
    assert server.wait_idle()["idle"]


def test_every_field_counts_in_the_length_bound(server: LiveServer) -> None:
    limit = server.engine.tokenizer.max_chars_per_token * CONTEXT
    tool = {"type": "function",
            "function": {"name": "f", "description": "x" * limit, "parameters": {}}}  # fmt: skip
    message = refused(server, "/v1/chat/completions", chat(tools=[tool]), "tools")
    assert "tools" in message and "cannot fit" in message
    schema = {"type": "object", "description": "y" * limit}
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    refused(server, "/v1/chat/completions", chat(response_format=response_format),
            "response_format")  # fmt: skip
    stops = ["z" * (limit // 4 + 1)] * 4
    refused(server, "/v1/completions", completion(stop=stops), "stop")
    refused(server, "/v1/chat/completions", chat(stop=stops), "stop")
    # the messages and the tools together: each fits alone, not both
    half = {
        "type": "function",
        "function": {"name": "f", "description": "x" * (limit // 3), "parameters": {}},
    }
    long = [{"role": "user", "content": "w" * (2 * limit // 3)}]  # fmt: skip
    refused(server, "/v1/chat/completions", {**chat(tools=[half]), "messages": long}, "messages")


def test_stop_strings_at_their_maximum_are_served(server: LiveServer) -> None:
    """Sixteen stop strings that together just fit: the output is matched against them in time
    linear in the output (a long stop string costs what the output follows of it)."""
    limit = server.engine.tokenizer.max_chars_per_token * CONTEXT
    stops = [chr(ord("a") + i) * (limit // 16 - 8) for i in range(16)]
    body = completion(stop=stops, max_tokens=64, ignore_eos=True, temperature=0)
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert server.wait_idle()["idle"]


def test_a_connection_that_never_finishes_its_headers_is_closed(server: LiveServer) -> None:
    """A client sending its headers a byte at a time is cut off (header_timeout_s: 0.5 s here),
    and the server goes on serving."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(100):  # trickle for up to 10 s; the timeout must not wait for the end
            try:
                sock.sendall(b"X")
                sock.settimeout(0.1)
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed = True
                break
        assert closed, "the server kept a connection whose headers never ended"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_an_idle_keep_alive_connection_does_not_escape_the_timeout(server: LiveServer) -> None:
    """After one whole request, the next request's headers are timed the same way."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in sock.recv(4096).split(b"\r\n")[0]
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request, never finished
        sock.settimeout(10)
        deadline = time.monotonic() + 10
        data = b"x"
        while data and time.monotonic() < deadline:
            data = sock.recv(1024)
        assert data == b"", "the half-sent second request held its connection"


def test_the_detokenizer_window_stays_short_whatever_ids_come() -> None:
    """A flood of special tokens, or of bytes that are no UTF-8, never makes a push decode
    more than a bounded window."""
    tok = byte_level()
    counted: list[int] = []
    decode = tok.decode

    class Counting:
        hf_tokenizer = tok.hf_tokenizer

        def decode(self, ids: list[int]) -> str:
            counted.append(len(ids))
            return decode(ids)

    special = token_id(tok, "<|im_start|>")
    stray = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")  # a lone byte
    for flood in ([special] * 2000, [stray] * 2000):
        detokenizer = IncrementalDetokenizer(Counting())  # type: ignore[arg-type]  # a stand-in tokenizer that counts its work
        text = "".join(detokenizer.push([i]) for i in tok.encode("hi ", add_special_tokens=False))
        counted.clear()
        for token in flood:
            text += detokenizer.push([token])
        assert max(counted) <= 2 * MAX_UNREAD + 8, max(counted)
        text += detokenizer.flush()
        assert text == tok.decode(tok.encode("hi ", add_special_tokens=False) + flood)
