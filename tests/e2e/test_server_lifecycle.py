"""Start-up and shutdown of a real ``kiln serve``: SIGTERM drains in-flight requests, then exits."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from kiln.testing.server import RemoteServer

pytestmark = pytest.mark.slow


def test_sigterm_drains_in_flight_stream_then_exits(default_model_dir):
    with RemoteServer(["--max-model-len", "1024", "--disable-log-stats"]) as server:
        first_chunk = threading.Event()
        received: dict = {"text": "", "tokens": None, "done": False}

        def stream() -> None:
            body = {"prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        received["done"] = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            received["tokens"] = chunk["usage"]["completion_tokens"]
                        for choice in chunk["choices"]:
                            received["text"] += choice["text"]
                            first_chunk.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first_chunk.wait(60)
        server.terminate()
        client.join(120)
        assert received["done"] and received["tokens"] == 48 and received["text"]
        assert server.proc.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=2)
        assert "draining in-flight requests" in server.output()
