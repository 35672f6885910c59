"""``kiln serve --task embed`` on the default model, end to end through the official ``openai`` client:
embeddings equal transformers' last-token states (normalised), base64 (the client's default) and
float agree, order and indices are kept, and generation endpoints are refused naming the task."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from tests.core.test_pooling_engine import assert_same_direction, hf_hidden_states
from tests.e2e.conftest import API_KEY

from kiln.testing.server import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "smollm2-embed"
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]


@pytest.fixture(scope="module")
def embed_server(default_model_dir):
    # --quantization none: the exact products, to compare with transformers (the GGUF default
    # multiplies in int8, as llama.cpp: tests/core/test_pooling_engine.py bounds that path)
    args = ["--task", "embed", "--quantization", "none", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--api-key", API_KEY]
    with RemoteServer([*args, "--served-model-name", MODEL, "--disable-log-stats"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def embed_client(embed_server):
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_openai_client_embeddings_match_transformers(embed_client, default_model_dir):
    response = embed_client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL
    floats = embed_client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [list(map(float, d.embedding)) for d in response.data]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, prompts))
    for data, hidden in zip(response.data, hf_hidden_states(default_model_dir, prompts)):
        assert len(data.embedding) == 576
        assert_same_direction(data.embedding, F.normalize(hidden[-1], dim=-1))
    short = embed_client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64)
    assert_same_direction(short.data[0].embedding, F.normalize(torch.tensor(floats.data[0].embedding[:64]), dim=-1))


def test_token_id_inputs_and_errors(embed_client, embed_server):
    by_text = embed_client.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    ids = httpx.post(
        embed_server.url + "/tokenize", json={"prompt": "hello world"}, headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()["tokens"]
    by_ids = embed_client.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == by_text.data[0].embedding
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        embed_client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        embed_client.embeddings.create(model=MODEL, input="")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        embed_client.embeddings.create(model=MODEL, input=[list(range(100, 700))])
    assert [m.id for m in embed_client.models.list().data] == [MODEL]
