"""Pooling models against sentence-transformers itself: models it builds and saves (its own
``modules.json``, pooling and ``Dense`` configs, in the installed version's format) served by Kiln,
embeddings compared with ``SentenceTransformer.encode`` and scores with ``CrossEncoder.predict``."""

from __future__ import annotations

import warnings

import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer

from kiln import LLM

with warnings.catch_warnings():  # the older import path warns; the newer one is what v6 saves
    warnings.simplefilter("ignore")
    from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

ENGINE = dict(dtype="float32", max_model_len=512)
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "a", "what is the capital of france?"]


def saved_sentence_transformer(tmp_path, source: str, pooling: str, dense: bool) -> str:
    modules = [Transformer(source), Pooling(64, pooling_mode=pooling)]
    if dense:
        torch.manual_seed(0)
        modules.append(Dense(64, 16, activation_function=torch.nn.Tanh()))
    folder = str(tmp_path / f"st-{pooling}")
    SentenceTransformer(modules=[*modules, Normalize()], device="cpu").save(folder)
    return folder


@pytest.mark.parametrize(
    ("model_type", "pooling", "dense"),
    [("bert", "mean", False), ("xlm-roberta", "cls", True), ("llama", "lasttoken", False)],
)
def test_embeddings_equal_sentence_transformers(tiny_model_dir, tmp_path, model_type, pooling, dense):
    """Mean and CLS pooling on encoders (then a Dense projection), last-token pooling on a decoder,
    each normalised: Kiln reads the saved files and gives sentence-transformers' vectors."""
    folder = saved_sentence_transformer(tmp_path, tiny_model_dir(model_type), pooling, dense)
    reference = SentenceTransformer(folder, device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True, batch_size=1)
    # Its token ids: sentence-transformers renders a decoder's texts through the chat template.
    prompts = [{"prompt_token_ids": reference.preprocess([t])["input_ids"][0].tolist()} for t in TEXTS]
    llm = LLM(folder, **ENGINE)
    assert llm.engine.config.task == "embed"  # auto: encoders and decoders saved without a head embed
    got = torch.tensor([o.outputs.embedding for o in llm.embed(prompts)])
    assert got.shape == expected.shape == (len(TEXTS), 16 if dense else 64)
    torch.testing.assert_close(got, expected.float(), atol=2e-5, rtol=1e-4)


def test_a_decoder_without_its_head_does_not_generate(tiny_model_dir, tmp_path):
    folder = saved_sentence_transformer(tmp_path, tiny_model_dir("llama"), "lasttoken", dense=False)
    with pytest.raises(ValueError, match="--task generate: LlamaModel has no LM head; serve it with --task embed"):
        LLM(folder, task="generate", **ENGINE)


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_rerank_scores_equal_the_cross_encoder(tiny_model_dir, model_type):
    """A one-label sequence classifier as sentence-transformers' CrossEncoder: ``predict`` (its
    sigmoid of the logit) equals ``LLM.score``, pair by pair."""
    architecture = {"bert": "BertForSequenceClassification", "xlm-roberta": "XLMRobertaForSequenceClassification"}
    folder = tiny_model_dir(model_type, architectures=architecture[model_type], num_labels=1)
    query, documents = "where do foxes live", ["the fox lives in the forest", "paris is in france", "foxes"]
    expected = CrossEncoder(folder, device="cpu").predict([(query, d) for d in documents], convert_to_tensor=True)
    scores = LLM(folder, **ENGINE).score(query, documents)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), expected.float(), atol=1e-5, rtol=1e-4)
