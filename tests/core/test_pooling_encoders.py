"""Pooling through the engine on tiny random BERT / XLM-RoBERTa encoders (kiln.models.bert): embeddings
against Hugging Face transformers with sentence-transformers' pooling (CLS by default, mean from the
model's sentence-transformers files), cross-encoder scores against the model's logits (BERT segment
ids included), class probabilities, and ``--task auto`` on each architecture."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from tests.core.test_pooling_engine import assert_same_direction, write_sentence_transformers

from kiln import LLM, PoolingParams
from kiln.testing.encoders import hf_encoder_outputs

ENGINE = dict(dtype="float32", max_model_len=512)
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "a", "what is the capital of france?"]
QUERY = "where do foxes live"
DOCUMENTS = ["the fox lives in the forest", "paris is the capital of france", "foxes", "x " * 40]


def cross_encoder(tiny_model_dir, model_type: str = "bert", num_labels: int = 1) -> str:
    architecture = {"bert": "BertForSequenceClassification", "xlm-roberta": "XLMRobertaForSequenceClassification"}
    return tiny_model_dir(model_type, architectures=architecture[model_type], num_labels=num_labels)


def pair_logits(model_dir: str, pairs: list[tuple[str, str]], segments: bool = True) -> torch.Tensor:
    """Reference: the cross-encoder's logits of each pair as its tokenizer encodes them (``segments``
    False: without BERT's segment ids, all 0)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    encoded = [tok(a, b) for a, b in pairs]
    types = [e["token_type_ids"] for e in encoded] if segments and "token_type_ids" in encoded[0] else None
    return torch.stack(
        [logits for _, logits in hf_encoder_outputs(model_dir, [e["input_ids"] for e in encoded], types)]
    )


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_cls_embeddings_match_transformers(tiny_model_dir, model_type):
    path = tiny_model_dir(model_type)
    llm = LLM(path, **ENGINE)
    assert llm.engine.config.task == "embed"  # auto: a bare encoder embeds
    assert not llm.engine.config.enable_prefix_caching and not llm.engine.config.enable_chunked_prefill
    outs = llm.embed(TEXTS)
    tok = llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in TEXTS]
    reference = hf_encoder_outputs(path, [o.prompt_token_ids for o in outs])
    for out, (hidden, _) in zip(outs, reference):
        assert_same_direction(out.outputs.embedding, F.normalize(hidden[0], dim=-1))


def test_dense_projection_from_sentence_transformers_files(tiny_model_dir, tmp_path):
    """A Dense module after pooling (as LaBSE-style models have): CLS, then tanh(W x + b), then
    Normalize; ``dimensions`` are counted in the projection's width."""
    import json

    from safetensors.torch import save_file

    path = tmp_path / "st-dense"
    shutil.copytree(tiny_model_dir("bert"), path)
    write_sentence_transformers(path, {"pooling_mode_cls_token": True}, normalize=True)
    modules = json.loads((path / "modules.json").read_text())
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    modules.insert(2, dense)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "2_Dense").mkdir()
    config = {
        "in_features": 64,
        "out_features": 16,
        "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh",
    }
    (path / "2_Dense" / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    weight, bias = torch.randn(16, 64) * 0.3, torch.randn(16) * 0.1
    save_file({"linear.weight": weight, "linear.bias": bias}, str(path / "2_Dense" / "model.safetensors"))

    llm = LLM(str(path), **ENGINE)
    outs = llm.embed(TEXTS)
    reference = hf_encoder_outputs(str(path), [o.prompt_token_ids for o in outs])
    for out, (hidden, _) in zip(outs, reference):
        assert len(out.outputs.embedding) == 16
        assert_same_direction(out.outputs.embedding, F.normalize(torch.tanh(weight @ hidden[0] + bias), dim=-1))
    with pytest.raises(ValueError, match="dimensions: at most the model's 16, got 32"):
        llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=32))
    config["activation_function"] = "my_package.Swish"  # only torch.nn's own classes are built
    (path / "2_Dense" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported Dense activation_function 'my_package.Swish'"):
        LLM(str(path), **ENGINE)


def test_mean_pooling_from_sentence_transformers_files(tiny_model_dir, tmp_path):
    """The model folder's modules.json and 1_Pooling/config.json say mean pooling, then Normalize:
    what sentence-transformers computes (mean over the tokens, L2-normalised)."""
    path = tmp_path / "st-model"
    shutil.copytree(tiny_model_dir("xlm-roberta"), path)
    write_sentence_transformers(path, {"pooling_mode_mean_tokens": True}, normalize=True)
    llm = LLM(str(path), **ENGINE)
    outs = llm.embed(TEXTS)
    reference = hf_encoder_outputs(str(path), [o.prompt_token_ids for o in outs])
    for out, (hidden, _) in zip(outs, reference):
        assert_same_direction(out.outputs.embedding, F.normalize(hidden.mean(0), dim=-1))
    (cut,) = llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=8))
    assert_same_direction(cut.outputs.embedding, F.normalize(reference[0][0].mean(0)[:8], dim=-1))


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_equal_its_logits(tiny_model_dir, model_type):
    path = cross_encoder(tiny_model_dir, model_type)
    llm = LLM(path, **ENGINE)
    assert llm.engine.config.task == "score"  # auto: a one-label sequence classifier scores
    logits = pair_logits(path, [(QUERY, d) for d in DOCUMENTS])[:, 0]
    scores = llm.score(QUERY, DOCUMENTS)  # 1-to-N, every pair in one step
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), torch.sigmoid(logits))
    raw = llm.score([QUERY] * 2, DOCUMENTS[:2], pooling_params=PoolingParams(use_activation=False))  # N-to-N
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in raw]), logits[:2])
    if model_type == "bert":  # segment ids matter here, so the pairs carried them into the step
        assert not torch.allclose(pair_logits(path, [(QUERY, d) for d in DOCUMENTS], segments=False)[:, 0], logits)
    with pytest.raises(ValueError, match="data_2: 3 texts for 2 in data_1"):
        llm.score([QUERY, QUERY], DOCUMENTS[:3])


def test_classifier_probabilities(tiny_model_dir):
    path = cross_encoder(tiny_model_dir, "bert", num_labels=3)
    llm = LLM(path, **ENGINE)
    assert llm.engine.config.task == "classify"
    outs = llm.classify(TEXTS)
    reference = hf_encoder_outputs(path, [o.prompt_token_ids for o in outs])
    for out, (_, logits) in zip(outs, reference):
        assert out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), torch.softmax(logits, -1))
    with pytest.raises(ValueError, match="score: the model classifies into 3 labels"):
        llm.score(QUERY, DOCUMENTS)
    with pytest.raises(ValueError, match="--task classify: .*cannot answer embed requests"):
        llm.embed(TEXTS)
    with pytest.raises(ValueError, match="dimensions: only embedding models"):
        llm.classify(TEXTS, pooling_params=PoolingParams(dimensions=4))


def test_embedding_model_scores_by_cosine_similarity(tiny_model_dir):
    llm = LLM(tiny_model_dir("bert"), **ENGINE)
    embeddings = {t: torch.tensor(o.outputs.embedding) for t, o in zip(DOCUMENTS, llm.embed(DOCUMENTS))}
    (query,) = llm.embed(QUERY)
    scores = llm.score(QUERY, DOCUMENTS)
    for doc, score in zip(DOCUMENTS, scores):
        expected = F.cosine_similarity(torch.tensor(query.outputs.embedding), embeddings[doc], dim=0)
        assert score.outputs.score == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize("model_type,usable", [("bert", 512), ("xlm-roberta", 512)])
def test_max_model_len_defaults_to_the_positions_a_model_embeds(tiny_model_dir, model_type, usable):
    """XLM-R's config says 514 positions, of which the first two belong to padding: it takes 512."""
    llm = LLM(tiny_model_dir(model_type), dtype="float32")
    assert llm.engine.config.max_model_len == usable
    (out,) = llm.embed([list(range(5, 5 + usable))])  # the longest prompt it takes runs
    assert len(out.prompt_token_ids) == usable
