"""A GGUF file's tokenizer, tokenizing as llama.cpp does (and as the model's own tokenizer, whose
outputs llama.cpp's tokenizer tests hold it to): transformers' conversion, mended where it parts
from them (measured on llama.cpp's vocabularies and their test texts, ``tests/core/test_gguf_tokenizer.py``):

- SentencePiece vocabularies that prefix a space (``llama``, Llama 2 and Mistral files): the space
  goes before the text and after every special token, as llama.cpp puts it. transformers' Metaspace
  put none before text that starts with a space, nor after a special token (a chat template's
  ``<s>[INST]``): 15 of llama.cpp's 47 test texts came out other tokens.
- BPE vocabularies that llama.cpp reads with ``ignore_merges`` (Llama 3 and others): a word that is
  itself in the vocabulary is one token, as Llama 3's own tokenizer says (``Việt``: 3 tokens before).
  Llama 3's files do not say whether to add a BOS (its tokenizer adds one in a post-processor,
  which llama.cpp's converter does not read); llama.cpp adds one, and so does Kiln now.
- Special tokens of BPE vocabularies spelled outside the byte alphabet (DeepSeek's
  ``<｜begin▁of▁sentence｜>``): transformers' conversion respelled them as bytes, skipped them as
  special tokens and then added the file's BOS and EOS again past the vocabulary (DeepSeek LLM's
  BOS came out id 102401 of 102400), so every prompt with a BOS was refused. They keep their ids,
  and no token is added past the vocabulary (Llama 3's had GPT-2's ``<|endoftext|>`` at 128256).
- Pre-tokenizers transformers does not know, and splits as GPT-2 does: DeepSeek's (``deepseek-llm``:
  DeepSeek LLM and V2; ``deepseek-coder``; ``deepseek-v3``: V3 and R1), StarCoder's, Refact's and
  Command R's: their own splits (digits one or three at a time, CJK runs apart), the expressions
  llama.cpp and the models' ``tokenizer.json`` apply one after another.
"""

from __future__ import annotations

import os

from kiln.models.gguf_fields import field as gguf_field

# llama.cpp's pre-tokenizer types (src/llama-vocab.cpp): Llama 3's kin, those read with
# ignore_merges, and those that add a BOS where the file does not say.
LLAMA3 = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"}
IGNORE_MERGES = LLAMA3 | {"minicpm5", "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m"}
BOS_BY_DEFAULT = LLAMA3 | {"tekken", "chameleon"}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# Each pre-tokenizer's expressions, applied in turn to every piece: what one matches is a piece of
# its own, and so is what lies between matches.
SPLITS = {
    "deepseek-llm": [
        "[\r\n]",
        "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
        "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
        "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
        "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
        "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
        "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
        "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
        "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
        "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        _CJK,
        "\\p{N}+",
    ],
    "deepseek-coder": ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", _CJK, "\\p{N}"],
    "deepseek-v3": [
        "\\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ],
}
# Digits one at a time, then GPT-2's split (StarCoder, Refact, Command R).
SPLITS |= dict.fromkeys(
    ("starcoder", "refact", "command-r"),
    ["\\p{N}", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"],
)


def gguf_tokenizer(gguf_path: str, fast_only: bool = False, reader=None):
    """The Hugging Face tokenizer of ``gguf_path`` (transformers' conversion, mended as above).
    ``fast_only``: build it without reading the model's config (``PreTrainedTokenizerFast``), for
    architectures whose config transformers cannot read. ``reader``: the file's ``GGUFReader``,
    where the caller has one."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kiln.models.gguf_reader import FastGGUFReader

    folder, name = os.path.split(gguf_path)
    tokenizer = (PreTrainedTokenizerFast if fast_only else AutoTokenizer).from_pretrained(folder, gguf_file=name)
    reader = reader or FastGGUFReader(gguf_path)

    def field(key: str, default=None):
        return gguf_field(reader, f"tokenizer.ggml.{key}", default)

    backend = tokenizer.backend_tokenizer
    kind, pre = field("model"), field("pre")
    if kind == "llama" and field("add_space_prefix", True) and type(backend.pre_tokenizer) is pre_tokenizers.Metaspace:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer = None
    elif kind == "gpt2":
        if pre in BOS_BY_DEFAULT and field("add_bos_token") is None:
            tokenizer.add_bos_token = True
        if pre in IGNORE_MERGES:
            backend.model.ignore_merges = True
        elif pre in SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(e), behavior="isolated") for e in SPLITS[pre]]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        _keep_special_ids(tokenizer, field("tokens"), field("token_type") or [])
    return tokenizer


def _keep_special_ids(tokenizer, tokens: list[str], types: list[int]) -> None:
    """Give the control and user-defined tokens of a byte-level vocabulary that are spelled
    outside its byte alphabet their own ids back, as added tokens (matched whole in the text, as
    llama.cpp matches them), and drop the tokens the conversion added past the vocabulary."""
    import json

    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    kept = {
        token: i
        for i, (token, kind) in enumerate(zip(tokens, types))
        if kind in (CONTROL, USER_DEFINED) and not set(token) <= alphabet
    }
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    # e.g. GPT-2's "<|endoftext|>", which transformers adds to a Llama 3 vocabulary: past the model's
    # embeddings, a prompt spelling it out would be refused.
    past = [a for a in state["added_tokens"] if a["id"] >= len(tokens)]
    if not kept and not past:
        return
    vocab = state["model"]["vocab"]
    for token, i in kept.items():
        vocab.pop("".join(spelling[b] for b in token.encode("utf-8")), None)
        vocab[token] = i
    state["added_tokens"] = [a for a in state["added_tokens"] if a["id"] < len(tokens) and a["content"] not in kept]
    state["added_tokens"] += [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[i] == CONTROL}
        for token, i in kept.items()
    ]  # fmt: skip
    ids = {**vocab, **{a["content"]: a["id"] for a in state["added_tokens"]}}

    def renumber(node) -> None:  # the post-processor's BOS/EOS entries hold the ids they were added under
        if isinstance(node, dict):
            if "tokens" in node and "ids" in node:
                node["ids"] = [ids[t] for t in node["tokens"]]
            for value in node.values():
                renumber(value)
        elif isinstance(node, list):
            for value in node:
                renumber(value)

    renumber(state.get("post_processor"))
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))
