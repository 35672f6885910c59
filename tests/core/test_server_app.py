"""The server in-process on a tiny model: the async engine thread, health, config files, and a
bounded schemathesis run over the server's own OpenAPI schema (no 5xx for anything a client sends)."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from fastapi.testclient import TestClient

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine, EngineDeadError
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.cli_args import add_serve_args, apply_config_file
from kiln.entrypoints.openai.serving import ServerOptions
from kiln.sampling_params import RequestOutputKind


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    apply_config_file(parser, argv)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = EngineConfig.create(
        model=tiny_model_dir("llama"), max_model_len=256, block_size=16, dtype="float32", max_num_seqs=8
    )
    return LLMEngine(config)


def make_app(engine: LLMEngine, *argv: str):
    async_engine = AsyncEngine(engine, log_stats_interval=None)
    options = ServerOptions(served_model_names=["tiny"], disable_log_requests=True)
    return async_engine, build_app(async_engine, options, serve_args(list(argv)))


def test_async_engine_streams_match_offline(engine):
    prompts = [[5, 6, 7, 8], list(range(100, 140)), [42] * 20]
    expected = []
    for p in prompts:
        engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                expected.append(out.outputs[0].token_ids)

    async def run():
        async_engine = AsyncEngine(engine, log_stats_interval=None)
        async_engine.start()
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        streams = [async_engine.add_request(f"r{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(prompts)]

        async def collect(stream):
            return [t async for out in stream for t in out.outputs[0].token_ids]

        got = await asyncio.gather(*(collect(s) for s in streams))
        async_engine.shutdown()
        return got

    assert asyncio.run(run()) == expected


def test_abort_frees_blocks(engine):
    async def run():
        async_engine = AsyncEngine(engine, log_stats_interval=None)
        async_engine.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        stream = async_engine.add_request("long", {"prompt_token_ids": list(range(50, 90))}, params)
        async for _ in stream:
            break
        stream.close()
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        async_engine.shutdown()

    asyncio.run(run())
    assert not engine.has_unfinished_requests()
    assert engine.kv.usage == 0.0


def test_engine_death_fails_requests_and_health(engine, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    async_engine, app = make_app(engine)
    monkeypatch.setattr(engine, "step", broken_step)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        with pytest.raises(EngineDeadError):
            async_engine.add_request("x", {"prompt_token_ids": [1, 2]}, SamplingParams())
    monkeypatch.undo()
    for request_id in list(engine.output_processor.groups):
        engine.abort_request(request_id)


def test_config_file_is_overridden_by_command_line(tmp_path):
    path = tmp_path / "kiln.yaml"
    path.write_text("port: 9001\nmax-num-seqs: 7\nserved_model_name: [a, b]\nallowed-origins: '[\"https://x\"]'\n")
    ns = serve_args(["--config", str(path), "--port", "9002"])
    assert ns.port == 9002  # command line wins
    assert ns.max_num_seqs == 7 and ns.served_model_name == ["a", "b"]
    assert ns.allowed_origins == ["https://x"]
    path.write_text("no_such_flag: 1\n")
    with pytest.raises(SystemExit):
        serve_args(["--config", str(path)])


def test_serve_help_documents_flags(capsys):
    from kiln.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--api-key", "--served-model-name", "--chat-template-content-format", "--max-num-seqs", "--config"):
        assert flag in text


def test_middleware_and_root_path(engine):
    _, app = make_app(engine, "--middleware", "tests.core.test_server_app:tag_middleware", "--root-path", "/api")
    with TestClient(app, root_path="/api") as client:
        r = client.get("/api/v1/models")
        assert r.status_code == 200 and r.headers["x-tagged"] == "yes"
        assert r.json()["data"][0]["id"] == "tiny"


async def tag_middleware(request, call_next):
    response = await call_next(request)
    response.headers["x-tagged"] = "yes"
    return response


@pytest.mark.slow
def test_schemathesis_finds_no_server_errors(engine):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    _, app = make_app(engine)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)  # each call runs the app's lifespan
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case):
            response = case.call()
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r}: {response.status_code} {response.text}")

        check()
    assert not failures, "\n".join(failures[:5])
