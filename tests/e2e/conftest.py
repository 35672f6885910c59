"""One ``kiln serve`` on the default model for the end-to-end tests (fp32: greedy output is stable)."""

from __future__ import annotations

import httpx
import pytest

from kiln.testing.server import RemoteServer

API_KEY = "test-key"
MODEL = "smollm2"
SERVER_ARGS = [
    "--dtype", "float32",
    "--max-model-len", "2048",
    "--max-num-seqs", "64",
    "--api-key", API_KEY,
    "--served-model-name", MODEL, "kiln-default",
    "--enable-prompt-tokens-details",
    "--enable-request-id-headers",
    "--disable-log-stats",
    "--chat-template", "chatml_tools",  # by name, from kiln-plugin-tool-parsers
    "--enable-auto-tool-choice",
    "--tool-call-parser", "hermes",
]  # fmt: skip


@pytest.fixture(scope="session")
def server(default_model_dir):
    with RemoteServer(SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):  # per test: its connections belong to that test's event loop
    import openai

    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c
