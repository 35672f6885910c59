"""The pooling endpoints in-process (FastAPI TestClient): ``/v1/embeddings`` (texts, token ids, chat
messages, base64, dimensions, truncation), ``/pooling``, ``/score`` and ``/v1/score``, the three
``/rerank`` paths and ``/classify``, on a decoder served with ``--task embed`` and on a BERT
cross-encoder; results against Hugging Face transformers, and the 400s: wrong task either way, empty
input, input over the context."""

from __future__ import annotations

import base64
from contextlib import ExitStack

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from tests.core.test_pooling_encoders import DOCUMENTS, QUERY, cross_encoder, pair_logits
from tests.core.test_pooling_engine import assert_same_direction, hf_hidden_states
from tests.core.test_server_app import engine, make_app  # noqa: F401  (engine is a fixture)

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def pooling_clients(tiny_model_dir):
    """TestClients by served task: "embed" (a tiny Llama with --task embed) and "score" (a tiny BERT
    cross-encoder); each serves the model as "tiny"."""
    models = {
        "embed": dict(model=tiny_model_dir("llama"), task="embed", max_model_len=256, block_size=16),
        "score": dict(model=cross_encoder(tiny_model_dir), max_model_len=512),
    }
    with ExitStack() as stack:
        clients = {}
        for task, args in models.items():
            _, app = make_app(LLMEngine(EngineConfig.create(dtype="float32", max_num_seqs=8, **args)))
            clients[task] = stack.enter_context(TestClient(app, raise_server_exceptions=False))
        yield clients


@pytest.fixture(scope="module")
def embed(pooling_clients):
    return pooling_clients["embed"]


@pytest.fixture(scope="module")
def scorer(pooling_clients):
    return pooling_clients["score"]


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def refused(r, param: str | None, *words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def vectors(body: dict) -> list[list[float]]:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [d["embedding"] for d in body["data"]]


def test_embeddings_match_transformers_in_order(embed, tiny_model_dir):
    prompts = [[5, 6, 7, 8], list(range(100, 140)), [42] * 20]
    body = ok(embed.post("/v1/embeddings", json={"model": "tiny", "input": prompts}))
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("embd-")
    assert all(d["object"] == "embedding" for d in body["data"])
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 64
    for got, hidden in zip(vectors(body), hf_hidden_states(tiny_model_dir("llama"), prompts)):
        assert_same_direction(got, F.normalize(hidden[-1], dim=-1))
    (single,) = vectors(ok(embed.post("/v1/embeddings", json={"input": prompts[1]})))  # one token list
    assert single == vectors(body)[1]


def test_texts_base64_dimensions_and_chat_messages(embed):
    texts = ["hello there", "the quick brown fox", "hello there"]
    floats = vectors(ok(embed.post("/v1/embeddings", json={"input": texts})))
    assert floats[0] == floats[2] and floats[0] != floats[1]
    encoded = ok(embed.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}))
    decoded = [np.frombuffer(base64.b64decode(e), dtype="<f4").tolist() for e in vectors(encoded)]
    assert decoded == floats  # the same float32 values, bit for bit
    (cut,) = vectors(ok(embed.post("/v1/embeddings", json={"input": texts[0], "dimensions": 16})))
    assert_same_direction(cut, F.normalize(torch.tensor(floats[0][:16]), dim=-1))
    messages = [{"role": "user", "content": "hello there"}]
    (chat,) = vectors(ok(embed.post("/v1/embeddings", json={"messages": messages})))
    tok_ids = embed.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    (same,) = vectors(ok(embed.post("/v1/embeddings", json={"input": tok_ids})))
    assert chat == same
    pooled = ok(embed.post("/pooling", json={"input": texts[:2]}))
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert [d["data"] for d in pooled["data"]] == floats[:2]


def test_embedding_errors(embed):
    for empty in ("", [], [""], [[]], ["fine", ""]):
        refused(embed.post("/v1/embeddings", json={"input": empty}), "input", "must not be empty")
    refused(embed.post("/v1/embeddings", json={}), "input", "exactly one of input and messages")
    long = list(range(10, 310))
    refused(embed.post("/v1/embeddings", json={"input": long}), "input", "maximum context length is 256")
    refused(embed.post("/v1/embeddings", json={"input": "word " * 400}), "input", "maximum context length")
    assert (
        ok(embed.post("/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 32}))["usage"]["prompt_tokens"]
        == 32
    )
    refused(embed.post("/v1/embeddings", json={"input": "x", "dimensions": 0}), "dimensions", "at least 1")
    refused(embed.post("/v1/embeddings", json={"input": "x", "dimensions": 65}), "dimensions", "at most")
    refused(embed.post("/v1/embeddings", json={"input": [10**6]}), "input", "token ids must be in")
    refused(embed.post("/v1/embeddings", json={"input": "x", "encoding_format": "hex"}), "encoding_format")
    assert embed.post("/v1/embeddings", json={"input": "x", "model": "other"}).status_code == 404


def test_wrong_task_is_a_400_naming_the_task_and_the_flag(embed, scorer, engine):  # noqa: F811
    for path, body in (
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/generate", {"prompt": "hello", "max_tokens": 2}),
        ("/classify", {"input": "hello"}),
    ):
        refused(embed.post(path, json=body), None, "--task embed", "--task ")
    refused(scorer.post("/v1/embeddings", json={"input": "hello"}), None, "--task score", "--task embed")
    _, app = make_app(engine)
    with TestClient(app) as generator:
        for path, body in (
            ("/v1/embeddings", {"input": "hello"}),
            ("/pooling", {"input": "hello"}),
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/v2/rerank", {"query": "a", "documents": ["b"]}),
            ("/classify", {"input": "hello"}),
        ):
            refused(
                generator.post(path, json=body), None, "--task generate", "--task embed" if path != "/classify" else ""
            )
        assert [m["id"] for m in ok(generator.get("/v1/models"))["data"]] == ["tiny"]
    for client in (embed, scorer):
        assert [m["id"] for m in ok(client.get("/v1/models"))["data"]] == ["tiny"]


def test_score_and_rerank_by_embedding_similarity(embed):
    docs = ["the fox lives in the forest", "paris is in france", "foxes"]
    query, *doc_vectors = (
        torch.tensor(v, dtype=torch.float64)
        for v in vectors(ok(embed.post("/v1/embeddings", json={"input": [QUERY, *docs]})))
    )
    expected = [F.cosine_similarity(query, d, dim=0).item() for d in doc_vectors]
    for path in ("/score", "/v1/score"):
        body = ok(embed.post(path, json={"model": "tiny", "text_1": QUERY, "text_2": docs}))  # 1-to-N
        assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["score"] * 3
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    pairs = ok(embed.post("/score", json={"text_1": [QUERY, docs[0]], "text_2": [docs[0], docs[0]]}))  # N-to-N
    assert [d["score"] for d in pairs["data"]] == pytest.approx([expected[0], 1.0], abs=1e-5)
    refused(embed.post("/score", json={"text_1": [QUERY, QUERY], "text_2": docs}), "text_2", "3 texts for 2")
    refused(embed.post("/score", json={"text_1": [], "text_2": docs}), "text_1", "must not be empty")
    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = ok(embed.post(path, json={"query": QUERY, "documents": docs}))
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in order], abs=1e-5)
    top = ok(embed.post("/rerank", json={"query": QUERY, "documents": [{"text": d} for d in docs], "top_n": 2,
                                         "return_documents": False}))  # fmt: skip
    assert [r["index"] for r in top["results"]] == order[:2] and all("document" not in r for r in top["results"])
    assert top["usage"]["total_tokens"] > 0
    refused(embed.post("/rerank", json={"query": QUERY, "documents": []}), "documents", "must not be empty")


def test_cross_encoder_endpoints_equal_its_logits(scorer, tiny_model_dir):
    logits = pair_logits(cross_encoder(tiny_model_dir), [(QUERY, d) for d in DOCUMENTS])[:, 0]
    body = ok(scorer.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}))
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), torch.sigmoid(logits))
    raw = ok(scorer.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": False}))
    torch.testing.assert_close(torch.tensor([d["score"] for d in raw["data"]]), logits)
    ranked = ok(scorer.post("/v2/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3}))["results"]
    assert [r["index"] for r in ranked] == torch.argsort(logits, descending=True)[:3].tolist()
    torch.testing.assert_close(
        torch.tensor([r["relevance_score"] for r in ranked]), torch.sigmoid(logits).sort(descending=True).values[:3]
    )
    classes = ok(scorer.post("/classify", json={"input": ["hello there", "the fox"]}))
    assert classes["id"].startswith("classify-") and classes["usage"]["prompt_tokens"] > 0
    for d in classes["data"]:
        assert d["num_classes"] == 1 and d["label"] == "LABEL_0" and 0.0 < d["probs"][0] < 1.0
    refused(scorer.post("/classify", json={"input": "x", "dimensions": 4}), "dimensions")
    # A cut the tokenizer cannot make (a pair's special tokens alone) or a negative one: 400s, not 500s.
    for cut, words in ((3, ("more than its 3 special tokens",)), (-5, ("-1 or at least 1",))):
        body = {"query": QUERY, "documents": DOCUMENTS, "truncate_prompt_tokens": cut}
        refused(scorer.post("/rerank", json=body), "truncate_prompt_tokens", *words)
