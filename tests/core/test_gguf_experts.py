"""Mixtures of experts from GGUF files (``kiln.models.gguf_cache``): llama.cpp's Mixtral (written
as ``llama`` with an expert count, which transformers reads as a dense Llama), Qwen2-MoE and
Qwen3-MoE, with each layer's experts stacked in one tensor per projection or, in older files,
one tensor per expert. The conversion writes them one expert at a time; Kiln then serves
exactly the values the file holds, and the CPU plugin keeps the experts in their blocks."""

from __future__ import annotations

import pytest
from gguf import GGUFWriter

from kiln.models import gguf_cache
from kiln.models.gguf_reader import FastGGUFReader
from kiln.testing.models import hf_as_gguf, hf_greedy

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 100, 7]]
# family, llama.cpp architecture, tiny-model overrides: what llama.cpp's architectures fix
# (Qwen2-MoE: no dense layers, top-k weights as routed; Qwen3-MoE: top-k weights renormalised).
FAMILIES = {
    "mixtral": ("mixtral", "llama", {}),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", {"mlp_only_layers": [], "norm_topk_prob": False}),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", {"norm_topk_prob": True}),
}


def _gguf(tiny_model_dir, tmp_path, family: str, quant_type: str, **kwargs) -> str:
    model_type, arch, overrides = FAMILIES[family]
    return hf_as_gguf(tiny_model_dir(model_type, **overrides), str(tmp_path / "model.gguf"), arch, quant_type, **kwargs)


@pytest.fixture
def whole_model_loading_refused(monkeypatch):
    def refuse(*args):
        raise AssertionError("the whole model was loaded through transformers")

    monkeypatch.setattr(gguf_cache, "_write_whole", refuse)


@pytest.mark.parametrize(
    ("family", "stacked"),
    [("mixtral", True), ("mixtral", False), ("qwen2_moe", True), ("qwen3_moe", True)],
    ids=["mixtral", "mixtral-one-tensor-per-expert", "qwen2_moe", "qwen3_moe"],
)
def test_moe_gguf_serves_the_values_it_holds(
    tiny_model_dir, tmp_path, monkeypatch, whole_model_loading_refused, family, stacked
):
    from kiln import LLM, SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    reference = str(tmp_path / "reference")
    gguf = _gguf(tiny_model_dir, tmp_path, family, "Q8_0", stacked_experts=stacked, reference=reference)
    llm = LLM(gguf, max_model_len=256, quantization="none", dtype="float32")  # the exact products of the file's values
    model = llm.engine.executor.runner.model
    assert type(model).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                    "qwen3_moe": "Qwen3MoeForCausalLM"}[family]  # fmt: skip
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(reference, PROMPTS, 16)


def test_moe_gguf_experts_stay_in_their_blocks(tiny_model_dir, tmp_path, monkeypatch, whole_model_loading_refused):
    from kiln import LLM, SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    _gguf(tiny_model_dir, tmp_path, "mixtral", "Q4_0")
    monkeypatch.chdir(tmp_path)  # a bare file name (transformers had taken it for a Hub repo id)
    llm = LLM("model.gguf", max_model_len=256)
    moe = next(m for m in llm.engine.executor.runner.model.modules() if hasattr(m, "load_expert"))
    assert {w.fmt for w in moe.w13.experts + moe.w2.experts} == {4}  # Q4_0: 4-bit codes, a scale and offset
    assert moe.w13.int8_activations  # multiplied in integers, as GGUF models' other layers are
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8


def _copy_without(src: str, dst: str, tensor: str = "", fields: tuple[str, ...] = ()) -> str:
    """The GGUF file ``src`` without the tensor and metadata fields named."""
    full = FastGGUFReader(src)
    cut = GGUFWriter(dst, full.fields["general.architecture"].contents())
    for field in full.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")) and field.name not in fields:
            cut.add_key_value(field.name, field.contents(), field.types[0],
                              sub_type=field.types[-1] if len(field.types) > 1 else None)  # fmt: skip
    for t in full.tensors:
        if t.name != tensor:
            cut.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    cut.write_header_to_file()
    cut.write_kv_data_to_file()
    cut.write_tensors_to_file()
    cut.close()
    return dst


def test_expert_sizes_missing_from_the_metadata_come_from_the_tensors(tiny_model_dir, tmp_path, monkeypatch):
    """As llama.cpp reads such a file; transformers took its Qwen2-MoE defaults (1408, 5632)."""
    from kiln import LLM, SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    reference = str(tmp_path / "reference")
    full = _gguf(tiny_model_dir, tmp_path, "qwen2_moe", "F32", reference=reference)
    sizes = ("qwen2moe.expert_feed_forward_length", "qwen2moe.expert_shared_feed_forward_length")
    llm = LLM(
        _copy_without(full, str(tmp_path / "bare.gguf"), fields=sizes),
        max_model_len=256,
        quantization="none",
        dtype="float32",
    )
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(reference, PROMPTS, 16)


def test_a_moe_gguf_missing_an_expert_tensor_is_an_error(tiny_model_dir, tmp_path, monkeypatch):
    from kiln import LLM

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    full = _gguf(tiny_model_dir, tmp_path, "mixtral", "F32")
    cut = _copy_without(full, str(tmp_path / "cut.gguf"), tensor="blk.1.ffn_down_exps.weight")
    # Before: served as a dense Llama whose MLPs transformers had filled with random values.
    missing = r"has no tensor for 4 of the model's weights, e.g. \['model.layers.1.mlp.experts.0.down_proj.weight'"
    with pytest.raises(ValueError, match=missing):
        LLM(cut, max_model_len=256)
    no_count = _copy_without(full, str(tmp_path / "no-count.gguf"), fields=("llama.expert_used_count",))
    with pytest.raises(ValueError, match="has 4 experts but no llama.expert_used_count"):
        LLM(no_count, max_model_len=256)


def test_an_architecture_transformers_cannot_read_says_so(tiny_model_dir, tmp_path, monkeypatch):
    from kiln import LLM

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    full = FastGGUFReader(_gguf(tiny_model_dir, tmp_path, "mixtral", "F32"))
    other = GGUFWriter(str(tmp_path / "other.gguf"), "glm4moe")  # llama.cpp's GLM-4.5
    for field in full.fields.values():
        if field.name.startswith("tokenizer."):
            other.add_key_value(field.name, field.contents(), field.types[0],
                                sub_type=field.types[-1] if len(field.types) > 1 else None)  # fmt: skip
    other.add_tensor("token_embd.weight", full.tensors[1].data)
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    with pytest.raises(ValueError, match="architecture glm4moe is not supported yet") as raised:
        LLM(str(tmp_path / "other.gguf"), max_model_len=256)
    assert "is the file complete" not in str(raised.value)  # it was: the damaged-file hint
