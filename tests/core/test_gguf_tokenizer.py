"""GGUF files' tokenizers (``kiln.models.gguf_tokenizer``) tokenize as llama.cpp does: on llama.cpp's
own vocabularies and test texts where its source is at hand, and on small vocabularies built here
for what transformers' conversion alone got wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFValueType, GGUFWriter, TokenType

from kiln.models.gguf_reader import FastGGUFReader
from kiln.models.gguf_tokenizer import gguf_tokenizer
from kiln.models.loader import default_model_path
from kiln.testing.models import llama_cpp_source

SOURCE = llama_cpp_source()
# llama.cpp's vocabularies with test texts that Kiln's architectures (and the transformers fallback's
# GGUF families) use; Falcon, MPT and BERT's are left out: they still part from llama.cpp.
CHECKED = ["llama-spm", "llama-bpe", "phi-3", "qwen2", "qwen35", "gpt-2", "gemma-4", "deepseek-llm",
           "deepseek-coder", "starcoder", "refact", "command-r"]  # fmt: skip


@pytest.mark.skipif(
    SOURCE is None, reason="llama.cpp's source is not at hand: ../shared/peers/llama_server.sh setup fetches it"
)
@pytest.mark.parametrize("vocab", CHECKED)
def test_llama_cpp_test_texts_tokenize_as_llama_cpp_expects(vocab):
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    path = f"{SOURCE}/models/ggml-vocab-{vocab}.gguf"
    arch = FastGGUFReader(path).fields["general.architecture"].contents()
    # As the conversion builds it: through the model's config where transformers reads it (not
    # from Gemma 4's vocabulary-only file, whose config transformers refuses).
    tokenizer = gguf_tokenizer(path, fast_only=arch not in GGUF_SUPPORTED_ARCHITECTURES or arch == "gemma4")
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = [[int(i) for i in line.split()] for line in Path(f"{path}.out").read_text().split("\n")]
    got = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    assert [(t, g) for t, g, e in zip(texts, got, expected) if g != e] == []


def _vocab_file(path: Path, tokens: list[str], **fields: object) -> str:
    """A vocabulary-only GGUF: ``tokens``, SentencePiece scores by rank, and ``fields``
    (``tokenizer.ggml.*`` values) over the default's."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(
        [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.NORMAL] * (len(tokens) - 3)
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for key, value in fields.items():
        writer.add_string(f"tokenizer.ggml.{key}", value) if isinstance(value, str) else writer.add_bool(
            f"tokenizer.ggml.{key}", value
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


SPM_TOKENS = ["<unk>", "<s>", "</s>", "\u2581", "\u2581Hello", "\u2581world", "H", "e", "l", "o",
              "w", "r", "d", "\u2581H", "\u2581w", "ll", "llo", "ello", "\u2581He", "\u2581Hel", "\u2581Hell", "wo",
              "wor", "worl", "\u2581wo", "\u2581wor", "\u2581worl", "\u2581\u2581"]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Hello world", ["\u2581Hello", "\u2581world"]),
        (" Hello world", ["\u2581", "\u2581Hello", "\u2581world"]),  # transformers' conversion: no first piece
        ("<s>Hello", ["<s>", "\u2581Hello"]),  # a chat template's BOS, then text: it had split "Hello" to letters
    ],
)
def test_sentencepiece_vocabularies_prefix_a_space_as_llama_cpp_does(tmp_path, text, pieces):
    tokenizer = gguf_tokenizer(_vocab_file(tmp_path / "spm.gguf", SPM_TOKENS, model="llama"), fast_only=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert [SPM_TOKENS[i] for i in ids] == pieces
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removeprefix("<s>")


def test_a_vocabulary_that_asks_for_no_prefix_gets_none(tmp_path):
    path = _vocab_file(tmp_path / "spm.gguf", SPM_TOKENS, model="llama", add_space_prefix=False)
    tokenizer = gguf_tokenizer(path, fast_only=True)
    assert tokenizer.backend_tokenizer.normalizer is None  # transformers' conversion as it is


def _default_vocab_as(tmp_path: Path, pre: str, renamed: dict[int, str] | None = None, without: tuple = ()) -> str:
    """The default model's BPE vocabulary, its pre-tokenizer type replaced, the tokens of
    ``renamed``'s ids spelled as it says, and the fields ``without`` names left out."""
    source = FastGGUFReader(default_model_path())
    writer = GGUFWriter(str(tmp_path / f"{pre}.gguf"), "llama")
    for field in source.fields.values():
        if field.name.startswith("tokenizer.") and field.name not in ("tokenizer.ggml.pre", *without):
            types, value = field.types, field.contents()
            if field.name == "tokenizer.ggml.tokens":
                value = [(renamed or {}).get(i, token) for i, token in enumerate(value)]
            writer.add_key_value(field.name, value, types[0],
                                 sub_type=types[-1] if types[0] == GGUFValueType.ARRAY else None)  # fmt: skip
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(tmp_path / f"{pre}.gguf")


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("deepseek-v3", ["ied", "Ġ", "123", "45", "Ġ", "ä½łå¥½", "Ġmonths"]),  # digits three at a time
        ("deepseek-llm", ["ied", "Ġ", "12345", "Ġ", "ä½łå¥½", "Ġmonths"]),  # digits and CJK apart
        ("smollm", ["ied", "Ġ12345", "Ġä½łå¥½", "Ġmonths"]),  # the default's, as its tokenizer.json splits
    ],
)
def test_pre_tokenizers_transformers_does_not_know_split_as_their_models_do(tmp_path, pre, pieces):
    tokenizer = gguf_tokenizer(_default_vocab_as(tmp_path, pre), fast_only=True)
    split = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("ied 12345 你好 months")
    assert [piece for piece, _ in split] == pieces


def test_llama3_vocabularies_take_a_word_in_the_vocabulary_whole_and_add_a_bos(tmp_path):
    """The default vocabulary says nothing of a BOS (as Llama 3's files do not), and llama.cpp adds
    one for Llama 3's kind: Kiln too (the completions API; chat templates write their own)."""
    unsaid = ("tokenizer.ggml.add_bos_token",)
    tokenizer = gguf_tokenizer(_default_vocab_as(tmp_path, "llama-bpe", without=unsaid), fast_only=True)
    assert tokenizer.backend_tokenizer.model.ignore_merges
    assert tokenizer("Hi").input_ids == [tokenizer.bos_token_id, *tokenizer("Hi", add_special_tokens=False).input_ids]
    other = gguf_tokenizer(_default_vocab_as(tmp_path, "smollm", without=unsaid), fast_only=True)
    assert other("Hi").input_ids == tokenizer("Hi", add_special_tokens=False).input_ids  # the default's kind: none


BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"  # DeepSeek's, spelled outside the byte alphabet


def test_special_tokens_spelled_outside_the_byte_alphabet_keep_their_ids(tmp_path):
    """The default vocabulary with its BOS (id 1) spelled as DeepSeek spells its own: transformers'
    conversion had respelled it as bytes and added it again, with GPT-2's "<|endoftext|>" (renamed
    away here), past the vocabulary, where the model has no embedding."""
    path = _default_vocab_as(tmp_path, "deepseek-v3", renamed={0: "<pad>", 1: BOS})
    tokenizer = gguf_tokenizer(path, fast_only=True)
    assert len(tokenizer) == 49152 and tokenizer.bos_token == BOS and tokenizer.bos_token_id == 1
    ids = tokenizer(f"{BOS}Hi", add_special_tokens=False).input_ids
    assert ids == [1, *tokenizer("Hi", add_special_tokens=False).input_ids]  # matched whole, as its id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hi"


def test_the_mended_tokenizers_save_and_load_as_they_are(tmp_path):
    """The cache folder's tokenizer is what Kiln loads: AutoTokenizer on the saved files."""
    from transformers import AutoTokenizer

    spm = gguf_tokenizer(_vocab_file(tmp_path / "spm.gguf", SPM_TOKENS, model="llama"), fast_only=True)
    bpe = gguf_tokenizer(_default_vocab_as(tmp_path, "deepseek-v3", renamed={0: "<pad>", 1: BOS}), fast_only=True)
    for name, tokenizer, text in [("spm", spm, "<s> Hello world"), ("bpe", bpe, f"{BOS}ied 12345 months")]:
        tokenizer.save_pretrained(tmp_path / name)
        loaded = AutoTokenizer.from_pretrained(tmp_path / name)
        assert loaded(text).input_ids == tokenizer(text).input_ids and len(loaded) == len(tokenizer)
    assert loaded(f"{BOS}123", add_special_tokens=False).input_ids == [
        1,
        *loaded("123", add_special_tokens=False).input_ids,
    ]
