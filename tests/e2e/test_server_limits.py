"""Overload and faults on a real ``kiln serve`` (tiny model): the request queue bound, streams dropped
mid-way, the engine watchdog, the body size limit, and TLS with client certificates."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import ssl
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from kiln.testing.server import RemoteServer, metric_value

BASE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--disable-log-requests", "--disable-log-stats"]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == status and "type" in error
    return error


@pytest.fixture(scope="module")
def busy_server(tiny_model_dir):
    args = [tiny_model_dir("llama"), *BASE_ARGS, "--max-num-seqs", "16", "--max-queued-requests", "0"]
    with RemoteServer(args) as srv:
        yield srv


def test_overload_gets_clean_503s_and_metrics_count_every_request(busy_server):
    prompt = "one two three four five six"
    with httpx.Client(base_url=busy_server.url) as http:
        prompt_tokens = http.post("/tokenize", json={"prompt": prompt}).json()["count"]

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 96, "ignore_eos": True, "temperature": 0}
        return await client.post("/v1/completions", json=body)

    async def storm() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client) for _ in range(128)))

    responses = asyncio.run(storm())
    done = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(done) >= 16 and refused, [r.status_code for r in responses]
    texts = set()
    for r in done:
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, 96)
        texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1  # greedy: every admitted request got the same answer
    for r in refused:
        error = assert_openai_error(r, 503)
        assert "--max-queued-requests" in error["message"]
        assert r.headers["retry-after"] == "1"
    text = httpx.get(busy_server.url + "/metrics").text
    assert metric_value(text, "kiln:request_success_total", finished_reason="length") == len(done)
    assert metric_value(text, "kiln:request_rejected_total", reason="overloaded") == len(refused)


def test_dropped_streams_leave_nothing_running(busy_server):
    before = httpx.get(busy_server.url + "/metrics").text
    rng = random.Random(0)

    async def drop_after(client: httpx.AsyncClient, chunks: int) -> None:
        body = {"prompt": "stream me", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= chunks:
                    break  # leaving the block closes the connection mid-stream

    async def storm() -> None:
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=300) as client:
            # 30 streams in two waves, within --max-num-seqs 16 so none is refused.
            for wave in (15, 15):
                await asyncio.gather(*(drop_after(client, rng.randint(1, 40)) for _ in range(wave)))

    asyncio.run(storm())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(busy_server.url + "/metrics").text
        if (
            metric_value(text, "kiln:num_requests_running") == 0
            and metric_value(text, "kiln:num_requests_waiting") == 0
        ):
            break
        time.sleep(0.2)
    assert metric_value(text, "kiln:num_requests_running") == 0
    assert metric_value(text, "kiln:num_requests_waiting") == 0
    ended = metric_value(text, "kiln:request_success_total") - metric_value(before, "kiln:request_success_total", 0.0)
    assert ended == 30  # every dropped stream is accounted for (as an abort)
    assert (
        metric_value(text, "kiln:request_success_total", finished_reason="abort")
        - metric_value(before, "kiln:request_success_total", 0.0, finished_reason="abort")
        == 30
    )


def test_request_body_limit(tiny_model_dir):
    args = [tiny_model_dir("llama"), *BASE_ARGS, "--max-request-body-bytes", "4096"]
    with RemoteServer(args) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        small = {"prompt": "hello", "max_tokens": 2}
        assert http.post("/v1/completions", json=small).status_code == 200
        big = {"prompt": "hello " * 2000, "max_tokens": 2}
        assert_openai_error(http.post("/v1/completions", json=big), 413)

        def chunked():  # no Content-Length: the limit must hold while reading
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"x" * 100
            yield b'", "max_tokens": 2}'

        response = http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
        assert_openai_error(response, 413)
        assert http.post("/v1/completions", json=small).status_code == 200  # still serving


HANG_HOOK = textwrap.dedent(
    """
    import os, time
    from kiln.engine.llm_engine import LLMEngine

    _step = LLMEngine.step

    def step(self):
        if os.path.exists(os.environ["KILN_TEST_HANG_FILE"]):
            time.sleep(3600)  # a step that never returns, as a wedged device would
        return _step(self)

    LLMEngine.step = step
    """
)


def test_watchdog_marks_a_stuck_engine_dead_and_exits(tiny_model_dir, tmp_path):
    # sitecustomize runs in the server process at start-up and wraps the engine step with the fault.
    (tmp_path / "sitecustomize.py").write_text(HANG_HOOK)
    hang = tmp_path / "hang"
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "KILN_TEST_HANG_FILE": str(hang),
        "KILN_ENGINE_ITERATION_TIMEOUT_S": "2",
    }
    with RemoteServer([tiny_model_dir("llama"), *BASE_ARGS], env=env) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            hang.touch()
            statuses = []
            waiter = threading.Thread(
                target=lambda: statuses.append(
                    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code
                )
            )
            waiter.start()
            waiter.join(30)
        assert statuses == [503]
        assert srv.proc.wait(30) == 1
        assert "engine is stuck" in srv.output()


def make_pki(root) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with the openssl CLI."""
    paths = {
        name: str(root / name) for name in ("ca.key", "ca.pem", "server.key", "server.pem", "client.key", "client.pem")
    }

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kiln-test-ca",
        "-keyout", paths["ca.key"], "-out", paths["ca.pem"])  # fmt: skip
    ext = root / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        csr = str(root / f"{who}.csr")
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=kiln-test-{who}", "-keyout", paths[f"{who}.key"],
            "-out", csr)  # fmt: skip
        run("x509", "-req", "-in", csr, "-CA", paths["ca.pem"], "-CAkey", paths["ca.key"], "-CAcreateserial",
            "-days", "2", "-extfile", str(ext), "-out", paths[f"{who}.pem"])  # fmt: skip
    return paths


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_requires_client_certificates_and_reloads_changed_ones(tiny_model_dir, tmp_path):
    pki = make_pki(tmp_path)
    with_cert = ssl.create_default_context(cafile=pki["ca.pem"])
    with_cert.load_cert_chain(pki["client.pem"], pki["client.key"])
    args = [tiny_model_dir("llama"), *BASE_ARGS, "--ssl-keyfile", pki["server.key"], "--ssl-certfile",
            pki["server.pem"], "--ssl-ca-certs", pki["ca.pem"], "--ssl-cert-reqs", "2", "--enable-ssl-refresh"]  # fmt: skip
    with RemoteServer(args, tls={"verify": with_cert}) as srv:
        assert httpx.get(srv.url + "/v1/models", verify=with_cert).status_code == 200
        without_cert = ssl.create_default_context(cafile=pki["ca.pem"])
        with pytest.raises(httpx.HTTPError):  # the handshake (or the first read) fails without a certificate
            httpx.get(srv.url + "/v1/models", verify=without_cert)

        # A renewed server certificate from a new CA: picked up without a restart.
        (tmp_path / "renewed").mkdir()
        renewed = make_pki(tmp_path / "renewed")
        for name in ("server.key", "server.pem", "ca.pem"):
            shutil.copy(renewed[name], pki[name])
        new_ca = ssl.create_default_context(cafile=renewed["ca.pem"])
        new_ca.load_cert_chain(renewed["client.pem"], renewed["client.key"])
        deadline = time.monotonic() + 20
        while True:
            try:
                assert httpx.get(srv.url + "/v1/models", verify=new_ca).status_code == 200
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert "reloaded the TLS certificate files" in srv.output()


def test_tls_flags_without_tls_are_refused(tiny_model_dir):
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "serve", tiny_model_dir("llama"), "--ssl-cert-reqs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--ssl-cert-reqs: needs TLS (--ssl-certfile)" in result.stderr + result.stdout
