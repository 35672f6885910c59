"""Multi-LoRA over the OpenAI API: one ``kiln serve`` on a tiny model with two ``--lora-modules``
and runtime updates. An adapter is chosen by ``model`` and gives transformers + PEFT's greedy
tokens; adapters are listed, loaded and unloaded at run time, and bad ones are refused with the
reason while the server goes on serving. Gating and start-up errors are checked in-process or
with a ``kiln serve`` that exits before serving."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.cli_args import add_serve_args, apply_config_file
from kiln.entrypoints.openai.serving import ServerOptions
from kiln.entrypoints.openai.serving_models import LoRAModulePath, ServingModels, runtime_updates_enabled
from kiln.testing.lora import build_lora_adapter, hf_lora_greedy
from kiln.testing.server import RemoteServer, metric_value

NEW_TOKENS = 12
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(100, 120))]
ADAPTERS = {"a1": dict(rank=8, seed=1), "a2": dict(rank=4, seed=2), "a3": dict(rank=8, seed=3), "r16": dict(rank=16)}
GREEDY = dict(max_tokens=NEW_TOKENS, temperature=0, logprobs=0)
AS_IDS = {"min_tokens": NEW_TOKENS, "return_tokens_as_token_ids": True}  # min_tokens: EOS masked, as in the reference


def token_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.fixture(scope="module")
def loras(tiny_model_dir, tmp_path_factory):
    """The base model folder and an adapter folder per name."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("server-loras")
    return base, {name: build_lora_adapter(base, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def expected(loras):
    """transformers + PEFT greedy tokens per adapter (None: the base model) and prompt."""
    base, paths = loras
    return {name: hf_lora_greedy(base, paths.get(name), PROMPTS, NEW_TOKENS) for name in (None, "a1", "a2", "a3")}


@pytest.fixture(scope="module")
def server(loras):
    base, paths = loras
    a2 = json.dumps({"name": "a2", "path": paths["a2"], "base_model_name": "org/base"})
    args = [base, "--dtype", "float32", "--max-model-len", "256", "--served-model-name", "tiny", "tiny-alias",
            "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--lora-modules", f"a1={paths['a1']}", a2,
            "--enable-lora-runtime-updates", "--disable-log-stats", "--disable-log-requests"]  # fmt: skip
    with RemoteServer(args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# ------------------------------------------------------------------ listing and selection
def test_models_lists_adapters_after_the_served_names(http, loras):
    _, paths = loras
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert list(cards) == ["tiny", "tiny-alias", "a1", "a2"]
    assert cards["tiny"]["parent"] is None
    assert cards["a1"]["root"] == paths["a1"] and cards["a1"]["parent"] == "tiny"  # the first served name
    assert cards["a2"]["root"] == paths["a2"] and cards["a2"]["parent"] == "org/base"
    assert {c["owned_by"] for c in cards.values()} == {"kiln"} and cards["a2"]["max_model_len"] == 256
    assert http.get("/v1/models/a2").json() == cards["a2"]
    assert http.get("/v1/models/nope").status_code == 404


def test_model_name_selects_the_adapter(client, http, expected):
    for model, name in (("tiny", None), ("tiny-alias", None), ("a1", "a1"), ("a2", "a2")):
        out = client.completions.create(model=model, prompt=PROMPTS, extra_body=AS_IDS, **GREEDY)
        assert out.model == (name or "tiny")
        got = [token_ids(c.logprobs.tokens) for c in sorted(out.choices, key=lambda c: c.index)]
        assert got == expected[name], model
    assert expected["a1"] != expected[None] and expected["a2"] != expected[None]
    metrics = http.get("/metrics").text
    assert metric_value(metrics, "kiln:request_success_total", model_name="a1") >= len(PROMPTS)
    assert metric_value(metrics, "kiln:request_prompt_tokens_count", model_name="a2") >= len(PROMPTS)


def test_chat_and_responses_run_on_the_adapter(client, http, loras):
    base, paths = loras
    messages = [{"role": "user", "content": "Hello there"}]
    ids = http.post("/tokenize", json={"model": "a2", "messages": messages}).json()["tokens"]
    reference = hf_lora_greedy(base, paths["a2"], [ids], NEW_TOKENS)[0]
    chat = client.chat.completions.create(
        model="a2", messages=messages, max_tokens=NEW_TOKENS, temperature=0, logprobs=True, extra_body=AS_IDS
    )
    assert chat.model == "a2"
    assert token_ids([t.token for t in chat.choices[0].logprobs.content]) == reference
    chunks = list(client.chat.completions.create(model="a2", messages=messages, max_tokens=4, stream=True))
    assert {chunk.model for chunk in chunks} == {"a2"}
    response = client.responses.create(model="a2", input="Hello there", max_output_tokens=4, temperature=0)
    assert response.model == "a2" and response.output_text is not None


def test_unknown_model_and_pooling_on_an_adapter_are_refused(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="LoRA adapters apply to generation"):
        client.embeddings.create(model="a1", input="Hi")


# ------------------------------------------------------------------ runtime updates
def test_load_and_unload_at_run_time(client, http, loras, expected):
    _, paths = loras
    load = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": paths["a3"]})
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'a3' added successfully."
    assert http.get("/v1/models/a3").json()["parent"] == "tiny"
    out = client.completions.create(model="a3", prompt=PROMPTS, extra_body=AS_IDS, **GREEDY)
    assert [token_ids(c.logprobs.tokens) for c in sorted(out.choices, key=lambda c: c.index)] == expected["a3"]
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": paths["a3"]})
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]

    # A request running on the adapter when it is unloaded finishes normally.
    body = {"model": "a3", "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True, **AS_IDS,
            "logprobs": 0, "ignore_eos": True}  # fmt: skip
    tokens, finish = [], None
    with http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                tokens += token_ids(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                break
        unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'a3' removed successfully."
        for line in lines:
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                tokens += token_ids(choice["logprobs"]["tokens"])
                finish = choice["finish_reason"] or finish
    assert finish == "length" and len(tokens) == 200 and tokens[:NEW_TOKENS] == expected["a3"][0]

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a3", prompt="Hi", max_tokens=2)
    assert "a3" not in [m.id for m in client.models.list()]
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert missing.status_code == 404 and "cannot be found" in missing.json()["error"]["message"]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": paths["a1"]}).status_code == 200
    out = client.completions.create(model="a3", prompt=PROMPTS, extra_body=AS_IDS, **GREEDY)
    assert [token_ids(c.logprobs.tokens) for c in sorted(out.choices, key=lambda c: c.index)] == expected["a1"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200


def broken_adapter(good: str, path, kind: str) -> str:
    """A copy of a good adapter, broken one way."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, path)
    weights, config_path = path / "adapter_model.safetensors", path / "adapter_config.json"
    if kind == "corrupt":
        weights.write_bytes(weights.read_bytes()[:100])
    elif kind == "unknown-target":
        config = json.loads(config_path.read_text())
        config["target_modules"] = ["q_proj", "fc1"]
        config_path.write_text(json.dumps(config))
    elif kind == "unknown-tensor":
        tensors = load_file(weights)
        tensors["base_model.model.model.layers.0.mlp.fc1.lora_A.weight"] = next(iter(tensors.values())).clone()
        save_file(tensors, weights)
    return str(path)


BAD = {
    "missing": r"is not a folder",
    "corrupt": r"cannot read its weights",
    "unknown-target": r"targets \['fc1'\], which the model lacks",
    "unknown-tensor": r"fc1.lora_A.weight.*adapts a module the model lacks",
    "rank": r"rank 16 .* over --max-lora-rank 8",
    "served-name": r"the name is a served model name",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_adapters_are_refused_at_load(client, http, loras, expected, tmp_path, kind):
    _, paths = loras
    name, path = f"bad-{kind}", str(tmp_path / "nothing")
    if kind == "rank":
        path = paths["r16"]
    elif kind == "served-name":
        name, path = "tiny-alias", paths["a1"]
    elif kind != "missing":
        path = broken_adapter(paths["a1"], tmp_path / kind, kind)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError"
    assert re.search(BAD[kind], error["message"]), error["message"]
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias", "a1", "a2"]
    out = client.completions.create(model="a1", prompt=PROMPTS[:1], extra_body=AS_IDS, **GREEDY)
    assert token_ids(out.choices[0].logprobs.tokens) == expected["a1"][0]  # still serving


# ------------------------------------------------------------------ gating and start-up
def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    apply_config_file(parser, list(argv))
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("enable_lora", [False, True])
def test_runtime_updates_are_gated(loras, monkeypatch, enable_lora):
    base, paths = loras
    llm = LLMEngine(EngineConfig.create(model=base, max_model_len=128, dtype="float32", enable_lora=enable_lora))
    engine = AsyncEngine(llm, log_stats_interval=None)
    options = ServerOptions(served_model_names=["tiny"], disable_log_requests=True)
    body = {"lora_name": "x", "lora_path": paths["a1"]}
    with TestClient(build_app(engine, options, serve_args())) as client:
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 404
    for env in ("KILN_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        monkeypatch.setenv(env, "true")
        models = ServingModels(engine, options.served_model_names)
        with TestClient(build_app(engine, options, serve_args(), models)) as client:
            r = client.post("/v1/load_lora_adapter", json=body)
            if not enable_lora:
                assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
                continue
            assert r.status_code == 200
            first = models.loras["x"].lora_int_id
            assert client.post("/v1/unload_lora_adapter", json={"lora_int_id": first}).status_code == 200
            assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
            assert models.loras["x"].lora_int_id > first  # a fresh id: no prefix-cache entry is shared
        monkeypatch.delenv(env)
    if enable_lora:  # --lora-modules at start-up: names must be new
        models = ServingModels(engine, options.served_model_names)
        with pytest.raises(ValueError, match="--lora-modules: 'a' is given twice"):
            models.add_static([LoRAModulePath("a", paths["a1"]), LoRAModulePath("a", paths["a2"])])
        with pytest.raises(ValueError, match="--lora-modules: LoRA adapter 'tiny': the name is a served model name"):
            models.add_static([LoRAModulePath("tiny", paths["a1"])])
    monkeypatch.setenv("KILN_ALLOW_RUNTIME_LORA_UPDATING", "maybe")
    with pytest.raises(ValueError, match="KILN_ALLOW_RUNTIME_LORA_UPDATING: expected true or false"):
        runtime_updates_enabled(False)


def test_lora_modules_flag_forms(tmp_path, loras):
    ns = serve_args("--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}')
    assert ns.lora_modules == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    assert not ns.enable_lora_runtime_updates and serve_args().lora_modules is None
    for bad in ("a", "=/x", '{"name": "a"}', '{"name": "a", "path": "/x", "rank": 8}', "{not json"):
        with pytest.raises(SystemExit):
            serve_args("--lora-modules", bad)
    path = tmp_path / "kiln.yaml"
    path.write_text("lora-modules:\n  - a=/x\n  - {name: b, path: /y}\nenable-lora-runtime-updates: true\n")
    ns = serve_args("--config", str(path))
    assert ns.lora_modules == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y")]
    assert ns.enable_lora_runtime_updates


def test_lora_modules_without_enable_lora_fail_start_up(loras):
    """Refused before the model loads (bad adapters fail after it, as ``add_static`` above shows)."""
    base, paths = loras
    cmd = [sys.executable, "-m", "kiln.cli", "serve", base, "--port", "0", "--lora-modules", f"a1={paths['a1']}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "kiln: error: --lora-modules: needs --enable-lora" in done.stderr, done.stderr
