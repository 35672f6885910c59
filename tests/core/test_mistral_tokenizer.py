"""``--tokenizer-mode mistral``: a model whose tokenizer is mistral_common's — tekken's
``tekken.json``, or a SentencePiece ``tokenizer.model.v3`` — serves with it: prompts encoded and
outputs decoded by mistral_common, chat conversations encoded by its instruct requests (no
template), guided decoding over its vocabulary; and it generates transformers' tokens for the
same ids. mistral_common's own tokenizer files (shipped in its wheel) are the tokenizers of tiny
random Mistrals. And a tool parser's markup that a tokenizer holds as a special token
(Mistral's ``[TOOL_CALLS]``) stays in the text the parser reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tests.core.test_server_app import serve_args

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.detokenizer import DecodeWindow, IncrementalDetokenizer
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.tokenizer import load_tokenizer, markup_token_ids
from kiln.entrypoints.openai.api_server import build_app
from kiln.entrypoints.openai.serving import ServerOptions
from kiln.interfaces.tokenizer import is_mistral, is_mistral_sentencepiece
from kiln.plugins import get_plugin_manager
from kiln.registry import load_ref
from kiln.testing.models import hf_greedy

mistral_common = pytest.importorskip("mistral_common")
DATA = Path(mistral_common.__file__).parent / "data"
TEKKEN = DATA / "tekken_240911.json"
# Per kind: mistral_common's file, its name in a model folder, and the vocabulary's size.
KINDS = {
    "tekken": (TEKKEN, "tekken.json", 131072),
    "sentencepiece": (DATA / "mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3", 32768),
}
TEXT = "Kiln serves naïve café menus: 你好, 世界 🙂 — ¿qué tal? ∑x² 🦀"
HELLO = [{"role": "user", "content": "Hello there"}]
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=KINDS)
def model_dir(request, tmp_path_factory) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source, name, vocab_size = KINDS[request.param]
    path = tmp_path_factory.mktemp(f"{request.param}-mistral")
    shutil.copy(source, path / name)
    config = AutoConfig.for_model(
        "mistral", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, sliding_window=None,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, tokenizer_mode="mistral", dtype="float32", max_model_len=256)


def test_generates_transformers_tokens_and_decodes_them(llm, model_dir):
    tok = llm.get_tokenizer()
    assert is_mistral(tok)
    prompt = tok.encode(TEXT)  # with mistral_common's BOS, as Kiln encodes a text prompt
    assert prompt[0] == tok.bos_token_id
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    by_text, by_ids = llm.generate([TEXT, {"prompt_token_ids": prompt}], params)
    expected = hf_greedy(model_dir, [prompt], NEW_TOKENS)[0]
    assert list(by_text.prompt_token_ids) == prompt
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == expected
    # the output's text as it continues the prompt's (SentencePiece drops a text's leading space)
    whole, before = (tok.decode(ids, skip_special_tokens=True) for ids in (prompt + expected, prompt))
    assert by_text.outputs[0].text == whole[len(before) :]


def test_streamed_text_is_the_whole_decode_and_waits_on_split_characters(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    window = DecodeWindow(tok, [])
    pieces = [window.step(None, i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert "" in pieces  # a character split over byte tokens waits for its last byte
    assert all("\ufffd" not in p for p in pieces)


def test_chat_prompt_is_mistral_commons_encoding(llm):
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(HELLO, tokenize=True, return_dict=False)
    assert llm.apply_chat_template(HELLO) == expected
    assert expected[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("[INST]")]
    out = llm.chat(HELLO, SamplingParams(max_tokens=4, temperature=0))[0]
    assert list(out.prompt_token_ids) == expected


def test_folder_with_only_mistral_files_loads_them_by_default(model_dir, tmp_path, tiny_model_dir):
    assert is_mistral(load_tokenizer(model_dir, "auto"))
    both = tmp_path / "both"  # a Mistral repo with Hugging Face tokenizer files beside mistral_common's
    shutil.copytree(tiny_model_dir("mistral"), both)
    for source, name, _ in KINDS.values():
        shutil.copy(source, both / name)
    assert not is_mistral(load_tokenizer(str(both), "auto"))  # transformers alone would pick mistral_common
    assert not is_mistral_sentencepiece(load_tokenizer(str(both), "mistral"))  # tekken.json wins
    (both / "tekken.json").unlink()
    assert is_mistral_sentencepiece(load_tokenizer(str(both), "mistral"))
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(ValueError, match="--tokenizer-mode mistral: .*hf has no tekken.json nor tokenizer.model.v"):
        load_tokenizer(str(hf), "mistral")


def mistral_tool_parser():
    return load_ref(get_plugin_manager().registry.table("tool_parsers")["mistral"])


# maxLength: a random model's string ends within a forced call's max_tokens
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}}}]  # fmt: skip
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.parametrize("kind", ["tekken", "hf"])
def test_a_special_tool_marker_reaches_the_parser(llm, tiny_model_dir, kind):
    if kind == "tekken":
        tok = llm.get_tokenizer()
        marker = [tok.convert_tokens_to_ids("[TOOL_CALLS]")]
    else:  # a Hugging Face tokenizer holding the marker as a special token, as Mistral's HF files do
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
        tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
        marker = tok.encode("[TOOL_CALLS]", add_special_tokens=False)
    parser = mistral_tool_parser()
    kept = markup_token_ids(tok, parser.markup())
    assert kept == set(marker)
    ids = marker + tok.encode(CALL, add_special_tokens=False)
    for keep, expected in ((kept, [("get_weather", '{"city": "Paris"}')]), (frozenset(), [])):
        params = SamplingParams()
        params._kept_special_ids = keep
        detok = IncrementalDetokenizer(tok, [], params)
        detok.update(ids)
        calls = parser(tok, TOOLS).extract_tool_calls(detok.text).tool_calls
        assert [(c.name, c.arguments) for c in calls] == expected, detok.text


@pytest.fixture(scope="module")
def client(model_dir):
    engine = LLMEngine(
        EngineConfig.create(model=model_dir, tokenizer_mode="mistral", max_model_len=256, dtype="float32")
    )
    options = ServerOptions(
        served_model_names=["tekken"], disable_log_requests=True, tool_parser=mistral_tool_parser(),
        enable_auto_tool_choice=True,
    )  # fmt: skip
    with TestClient(build_app(AsyncEngine(engine, log_stats_interval=None), options, serve_args([]))) as c:
        yield c


def test_embedding_a_conversation_keeps_the_tail_of_its_ids(model_dir):
    """``messages`` with ``truncate_prompt_tokens`` under mistral_common: its ids come from the
    conversation, so they are cut as token ids are (their last k, as vLLM does), not refused."""
    engine = LLMEngine(EngineConfig.create(
        model=model_dir, tokenizer_mode="mistral", task="embed", max_model_len=256, dtype="float32"
    ))  # fmt: skip
    ids = engine.model_info.tokenizer.apply_chat_template(HELLO, tokenize=True, return_dict=False)
    with TestClient(
        build_app(AsyncEngine(engine, log_stats_interval=None), ServerOptions(["tekken"]), serve_args([]))
    ) as c:
        cut = c.post("/v1/embeddings", json={"messages": HELLO, "truncate_prompt_tokens": 3})
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] == 3 < len(ids)
        tail = c.post("/v1/embeddings", json={"input": ids[-3:]}).json()["data"][0]["embedding"]
        assert cut.json()["data"][0]["embedding"] == tail
        whole = c.post("/v1/embeddings", json={"messages": HELLO}).json()
        assert whole["usage"]["prompt_tokens"] == len(ids) and whole["data"][0]["embedding"] != tail


def test_server_chat_tokenize_and_guided_json(client, llm):
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(HELLO, tokenize=True, return_dict=False)
    tokenized = client.post("/tokenize", json={"messages": HELLO}).json()
    assert tokenized["tokens"] == expected
    reply = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(expected)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    body = {"messages": HELLO, "max_tokens": 60, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "trip", "schema": schema}}}  # fmt: skip
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"city", "days"} and isinstance(value["days"], int)


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "encodes conversations itself"),
        ({"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages",
         "mistral_common refused the conversation"),
    ],
)  # fmt: skip
def test_what_mistral_common_cannot_encode_is_a_400(client, extra, param, fragment):
    reply = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2, **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_the_server_keeps_the_marker_only_for_the_tool_parser(client, llm):
    marker = llm.get_tokenizer().convert_tokens_to_ids("[TOOL_CALLS]")
    body = {"messages": HELLO, "max_tokens": 1, "temperature": 0, "logit_bias": {str(marker): 100}}
    for extra, content in (({"tools": TOOLS}, "[TOOL_CALLS]"), ({}, "")):
        reply = client.post("/v1/chat/completions", json={**body, **extra})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == content  # an unfinished call is content


def test_a_tool_round_trip_with_the_parsers_ids_encodes(client, llm):
    call_id = mistral_tool_parser()(None, TOOLS).new_call_id()
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"sky": "clear"}'},
    ]
    ids = client.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"]
    tok = llm.get_tokenizer()
    assert ids == tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False)
    assert {tok.convert_tokens_to_ids(t) for t in ("[TOOL_CALLS]", "[TOOL_RESULTS]")} <= set(ids)
    reply = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_reasoning_tokens_count_special_markers_as_the_text_shows_them(tiny_model_dir):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from kiln.engine.detokenizer import detokenized
    from kiln.entrypoints.openai.serving_chat import ChatServing
    from kiln.entrypoints.openai.tool_calling import ToolSetup

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    tok.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})  # as Magistral's tekken has them
    parser = load_ref(get_plugin_manager().registry.table("reasoning_parsers")["mistral"])
    think, end = tok.convert_tokens_to_ids(["[THINK]", "[/THINK]"])
    ids = [
        think,
        *tok.encode("plan it", add_special_tokens=False),
        end,
        *tok.encode("answer", add_special_tokens=False),
    ]
    setup = ToolSetup(make_reasoning_parser=parser, markup=parser.markup())
    params = SamplingParams()
    params._kept_special_ids = markup_token_ids(tok, setup.markup)
    text = detokenized(tok, ids, params)
    assert parser().extract_reasoning(text) == ("plan it", "answer")
    count = ChatServing.reasoning_tokens(SimpleNamespace(tokenizer=tok), setup, [(text, ids)], params)
    assert count == ids.index(end) + 1


def test_a_chat_template_flag_fails_at_start_up(model_dir):
    from kiln.entrypoints.openai.api_server import run_server

    args = serve_args([model_dir, "--tokenizer-mode", "mistral", "--chat-template", "{{ messages }}"])
    with pytest.raises(ValueError, match="--chat-template: the model's mistral_common tokenizer"):
        run_server(args)


def test_forced_tool_calls_take_mistral_ids(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": HELLO, "tools": TOOLS, "tool_choice": choice, "max_tokens": 40, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert len(call["id"]) == 9 and call["id"].isalnum() and call["id"].isascii()


def test_text_keeps_special_tokens_as_their_strings(llm):
    tok = llm.get_tokenizer()
    inst, end = tok.convert_tokens_to_ids(["[INST]", "[/INST]"])
    ids = [tok.bos_token_id, inst, *tok.encode(TEXT, add_special_tokens=False), end]
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert tok.decode(ids) == f"<s>[INST]{TEXT}[/INST]"  # not SentencePiece's raw pieces ("▁Kiln")
