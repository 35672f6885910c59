"""Pooling through the engine on decoder models (``--task embed``): embeddings against Hugging Face
transformers on the same weights (last token, mean, matryoshka dimensions), batching over several
steps, prefix-cache hits, blocks freed at once, the default model; and the task and pooler
configuration: ``--task`` / ``--runner`` / ``--convert``, ``--override-pooler-config``, the
sentence-transformers files, ``PoolingParams`` checks, and requests of the wrong kind."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kiln import LLM, PoolingParams, SamplingParams
from kiln.config import EngineConfig
from kiln.models.pooler import load_pooler_config, resolve_task

ENGINE = dict(dtype="float32", max_model_len=256, block_size=16)


def hf_hidden_states(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Reference: the base model's last hidden state (tokens, hidden) per prompt, fp32, one at a time."""
    from transformers import AutoModel

    from kiln.models.loader import transformers_model

    model = transformers_model(AutoModel, model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]


def assert_same_direction(got, expected: torch.Tensor) -> None:
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == expected.shape
    assert F.cosine_similarity(got.double(), expected.double(), dim=0) >= 0.9999


def embedder_for(path: str, **overrides) -> LLM:
    return LLM(path, task="embed", **{**ENGINE, **overrides})


@pytest.fixture(scope="module")
def embedder(tiny_model_dir):
    return embedder_for(tiny_model_dir("llama"))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_last_token_embeddings_match_transformers(tiny_model_dir, varied_prompts, model_type):
    path = tiny_model_dir(model_type)
    llm = embedder_for(path)
    outs = llm.embed([{"prompt_token_ids": p} for p in varied_prompts])
    assert [o.prompt_token_ids for o in outs] == varied_prompts  # order kept
    for out, hidden in zip(outs, hf_hidden_states(path, varied_prompts)):
        assert out.outputs.hidden_size == hidden.shape[-1]
        assert_same_direction(out.outputs.embedding, F.normalize(hidden[-1], dim=-1))
        assert abs(torch.tensor(out.outputs.embedding).norm().item() - 1.0) < 1e-5
    assert llm.engine.kv.usage == 0.0 and not llm.engine.has_unfinished_requests()  # blocks freed at once


def test_mean_pooling_and_raw_vectors(tiny_model_dir, varied_prompts):
    path = tiny_model_dir("llama")
    llm = embedder_for(path, override_pooler_config={"pooling_type": "MEAN", "normalize": False})
    assert not llm.engine.config.enable_prefix_caching  # mean pooling needs every position computed
    outs = llm.encode([{"prompt_token_ids": p} for p in varied_prompts])
    for out, hidden in zip(outs, hf_hidden_states(path, varied_prompts)):
        torch.testing.assert_close(out.outputs.data, hidden.mean(0), atol=1e-4, rtol=1e-4)
        assert_same_direction(out.outputs.data, hidden.mean(0))


def test_reward_returns_every_token_state(tiny_model_dir, varied_prompts):
    path = tiny_model_dir("llama")
    llm = LLM(path, task="reward", **ENGINE)
    outs = llm.reward([{"prompt_token_ids": p} for p in varied_prompts[1:3]])
    for out, hidden in zip(outs, hf_hidden_states(path, varied_prompts[1:3])):
        torch.testing.assert_close(out.outputs.data, hidden, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="--task reward: .*cannot answer embed requests"):
        llm.embed("hello")


def test_matryoshka_dimensions_truncate_then_normalise(embedder, tiny_model_dir):
    prompt = [5, 6, 7, 8, 9, 10]
    (hidden,) = hf_hidden_states(tiny_model_dir("llama"), [prompt])
    (cut,) = embedder.embed([prompt], pooling_params=PoolingParams(dimensions=16))
    assert_same_direction(cut.outputs.embedding, F.normalize(hidden[-1][:16], dim=-1))
    (raw,) = embedder.embed([prompt], pooling_params=PoolingParams(dimensions=16, normalize=False))
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), hidden[-1][:16], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions: at most the model's 64"):
        embedder.embed("hello", pooling_params=PoolingParams(dimensions=65))


def test_prompts_over_several_steps_and_prefix_cache_hits(tiny_model_dir, varied_prompts):
    """A budget of one max-length prompt per step spreads the batch over several steps; the same
    prompt again takes the prefix cache (last-token pooling only needs the last position)."""
    path = tiny_model_dir("llama")
    llm = embedder_for(path, max_model_len=96, max_num_batched_tokens=96)
    outs = llm.embed([{"prompt_token_ids": p} for p in varied_prompts])
    for out, hidden in zip(outs, hf_hidden_states(path, varied_prompts)):
        assert_same_direction(out.outputs.embedding, F.normalize(hidden[-1], dim=-1))
    (again,) = llm.embed([varied_prompts[-1]])  # 53 tokens: its 3 full blocks are cached
    assert outs[-1].num_cached_tokens == 0 and again.num_cached_tokens == 48
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), torch.tensor(outs[-1].outputs.embedding))


def test_truncation_and_length_limits(embedder):
    tok = embedder.get_tokenizer()
    text = "the quick brown fox jumps over the lazy dog " * 4
    ids = tok.encode(text)
    (out,) = embedder.embed(text, truncate_prompt_tokens=5)
    assert out.prompt_token_ids == (ids[:5] if tok.truncation_side == "right" else ids[-5:])  # the tokenizer's way
    (out,) = embedder.embed([list(range(10, 400))], truncate_prompt_tokens=-1)  # to max_model_len
    assert out.prompt_token_ids == list(range(10, 400))[-256:]  # token ids keep their tail, as in generation
    with pytest.raises(ValueError, match="prompt: 390 tokens are more than .* 256"):
        embedder.embed([list(range(10, 400))])
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        embedder.embed([[]])
    with pytest.raises(ValueError, match="truncate_prompt_tokens: at most max_model_len=256"):
        embedder.embed("hello", truncate_prompt_tokens=300)
    assert not embedder.engine.has_unfinished_requests()  # a bad prompt rejects the whole call


def test_wrong_kind_of_request_names_the_task(embedder, tiny_model_dir):
    with pytest.raises(ValueError, match="--task embed: .*--task generate"):
        embedder.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="--task embed: .*cannot answer classify requests"):
        embedder.classify("hello")
    with pytest.raises(ValueError, match="use_activation: only classification models"):
        embedder.embed("hello", pooling_params=PoolingParams(use_activation=True))
    generator = LLM(tiny_model_dir("llama"), **ENGINE)
    assert generator.engine.config.task == "generate"
    with pytest.raises(ValueError, match="--task generate: .*--task embed"):
        generator.embed("hello")


def test_default_model_serves_embeddings(default_model_dir):
    """``kiln serve --task embed`` on the embedded SmolLM2: last-token pooling, normalised."""
    exact = LLM(task="embed", dtype="float32", max_model_len=512, quantization="none")
    texts = ["The capital of France is Paris.", "Embeddings map text to vectors."]
    outs = exact.embed(texts)
    tok = exact.get_tokenizer()
    prompts = [tok.encode(t) for t in texts]
    assert [o.prompt_token_ids for o in outs] == prompts
    expected = [F.normalize(hidden[-1], dim=-1) for hidden in hf_hidden_states(default_model_dir, prompts)]
    for out, want in zip(outs, expected):
        assert out.outputs.hidden_size == 576
        assert_same_direction(out.outputs.embedding, want)
    # The default: the GGUF file's blocks times int8 activations (llama.cpp's scheme), close to exact.
    for out, want in zip(LLM(task="embed", max_model_len=512).embed(texts), expected):
        assert F.cosine_similarity(torch.as_tensor(out.outputs.embedding).double(), want.double(), dim=0) >= 0.999


# --------------------------------------------------------------------------- configuration
class Decoder:
    pass


class Encoder:
    is_encoder = True


class CrossEncoder(Encoder):
    def classify(self, hidden):
        return hidden


@pytest.mark.parametrize(
    "flags, cls, num_labels, task",
    [
        ({}, Decoder, 2, "generate"),
        ({}, Encoder, 2, "embed"),
        ({}, CrossEncoder, 1, "score"),
        ({}, CrossEncoder, 3, "classify"),
        ({"runner": "pooling"}, Decoder, 2, "embed"),  # vLLM turns a causal LM into an embedding model
        ({"runner": "pooling", "convert": "embed"}, Decoder, 2, "embed"),
        ({"convert": "reward"}, Decoder, 2, "reward"),
        ({"runner": "generate"}, Decoder, 2, "generate"),
        ({"task": "embed"}, CrossEncoder, 1, "embed"),
        ({"task": "classify"}, CrossEncoder, 1, "classify"),
    ],
)
def test_task_resolution(flags, cls, num_labels, task):
    config = EngineConfig.create(**flags)
    assert resolve_task(config, "Arch", cls, SimpleNamespace(num_labels=num_labels)) == task


@pytest.mark.parametrize(
    "flags, cls, message",
    [
        ({"task": "embed", "runner": "pooling"}, Decoder, "--task: give either --task or --runner/--convert"),
        ({"runner": "generate", "convert": "embed"}, Decoder, "--convert embed: needs --runner pooling"),
        ({"task": "generate"}, Encoder, "--task generate: Arch is not a generation model; serve it with --task embed"),
        ({"task": "classify"}, Decoder, "--task classify: Arch has no classification head"),
        ({"convert": "classify"}, Decoder, "--task classify: Arch has no classification head"),
    ],
)
def test_task_conflicts_are_refused(flags, cls, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_task(EngineConfig.create(**flags), "Arch", cls, SimpleNamespace(num_labels=2))


def test_override_pooler_config_from_the_command_line():
    from tests.core.test_server_app import serve_args

    from kiln.engine_args import engine_kwargs

    args = serve_args(["--task", "embed", "--override-pooler-config", '{"pooling_type": "mean", "softmax": false}'])
    config = EngineConfig.create(**engine_kwargs(args))
    assert config.task == "embed"
    assert config.override_pooler_config == {"pooling_type": "MEAN", "use_activation": False}
    for value, message in (
        ('{"pooling": "MEAN"}', "unknown keys \\['pooling'\\]"),
        ('{"pooling_type": "MAX"}', "pooling_type must be one of LAST, MEAN, CLS, ALL"),
        ('{"normalize": "yes"}', "normalize must be true or false"),
        ('{"dimensions": 0}', "dimensions must be a positive integer"),
        ("[1]", "expected a JSON object"),
        ("{nope", "not JSON"),
    ):
        with pytest.raises(ValueError, match="--override-pooler-config: " + message):
            EngineConfig.create(override_pooler_config=value)


def write_sentence_transformers(folder, pooling: dict, normalize: bool, similarity: str | None = None) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    if similarity is not None:
        (folder / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": similarity}))


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    assert load_pooler_config("embed", str(tmp_path), is_encoder=True, overrides=None).pooling_type == "CLS"
    assert load_pooler_config("embed", str(tmp_path), is_encoder=False, overrides=None).pooling_type == "LAST"
    write_sentence_transformers(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=True, similarity="dot")
    config = load_pooler_config("embed", str(tmp_path), is_encoder=True, overrides=None)
    assert (config.pooling_type, config.normalize, config.similarity) == ("MEAN", True, "dot")
    write_sentence_transformers(tmp_path, {"pooling_mode_lasttoken": True}, normalize=False)
    config = load_pooler_config("embed", str(tmp_path), is_encoder=False, overrides={"normalize": True})
    assert (config.pooling_type, config.normalize) == ("LAST", True)  # the flag wins
    assert load_pooler_config("classify", str(tmp_path), is_encoder=True, overrides=None).pooling_type == "CLS"
    assert load_pooler_config("reward", str(tmp_path), is_encoder=False, overrides=None).pooling_type == "ALL"
    write_sentence_transformers(tmp_path, {"pooling_mode_cls_token": False}, normalize=False)  # none on: mean
    assert load_pooler_config("embed", str(tmp_path), is_encoder=True, overrides=None).pooling_type == "MEAN"
    write_sentence_transformers(tmp_path, {"pooling_mode_max_tokens": True}, normalize=False)
    with pytest.raises(ValueError, match=r"pooling \(max\) is not supported.*--override-pooler-config"):
        load_pooler_config("embed", str(tmp_path), is_encoder=True, overrides=None)
    assert load_pooler_config("embed", str(tmp_path), True, {"pooling_type": "CLS"}).pooling_type == "CLS"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"dimensions": 0}, "dimensions must be at least 1"),
        ({"dimensions": 2.5}, "dimensions must be an integer"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 or at least 1"),
        ({"normalize": "yes"}, "normalize must be a boolean"),
        ({"use_activation": 1}, "use_activation must be a boolean"),
        ({"task": "generate"}, "task must be one of embed, classify, score, encode"),
    ],
)
def test_pooling_params_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**values)
