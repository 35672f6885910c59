"""Mistral's own layout (``params.json`` + ``consolidated.safetensors``, ``--config-format mistral
--load-format mistral``): a tiny Mistral and a tiny Mixtral written in that layout from their
Hugging Face checkpoints (names renamed, q/k rows back in Mistral's interleaved rotary order, as
Mistral publishes them) serve transformers' tokens of the Hugging Face originals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams
from kiln.models.mistral_format import rotary_halves
from kiln.quantization.fp8 import widen
from kiln.testing.models import hf_greedy
from kiln.testing.quantization import fp8_quantize

PROMPTS = [[1, 5, 9, 200, 31, 7], list(range(40, 75))]
NEW_TOKENS = 10
TO_MISTRAL = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2", "mlp.up_proj": "feed_forward.w3",
}  # fmt: skip


def interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """``rotary_halves`` undone: Hugging Face's rows back in Mistral's order."""
    rows, cols = weight.shape
    out = weight.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)
    assert torch.equal(rotary_halves(out, heads), weight)
    return out


def mistral_layout(hf_dir: str, out: Path, tensors: dict | None = None, **extra_params) -> Path:
    """``hf_dir``'s model (or its config with ``tensors``, Hugging Face's names) as Mistral publishes
    its own: params.json, consolidated.safetensors and the tokenizer files, no config.json."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    params = {
        "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"], "head_dim": config["head_dim"],
        "hidden_dim": config["intermediate_size"], "n_heads": heads, "n_kv_heads": kv_heads,
        "norm_eps": config["rms_norm_eps"], "vocab_size": config["vocab_size"],
        "rope_theta": config["rope_parameters"]["rope_theta"], "tied_embeddings": config["tie_word_embeddings"],
        **extra_params,
    }  # fmt: skip
    if "num_local_experts" in config:
        params["moe"] = {
            "num_experts": config["num_local_experts"],
            "num_experts_per_tok": config["num_experts_per_tok"],
        }
    weights = {}
    scales = {"weight": "weight", "weight_scale": "qscale_weight", "input_scale": "qscale_act"}
    for name, tensor in (tensors or load_file(str(Path(hf_dir) / "model.safetensors"))).items():
        top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
               "lm_head.weight": "output.weight"}  # fmt: skip
        if name in top:
            weights[top[name]] = tensor
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if module.startswith("block_sparse_moe."):  # Mixtral's checkpoint names: experts.E.w1..w3 and gate
            weights[f"layers.{layer}.feed_forward.{module.removeprefix('block_sparse_moe.')}.{kind}"] = tensor
            continue
        if module in ("self_attn.q_proj", "self_attn.k_proj") and tensor.numel() > 1:  # weights; scales per row
            rows = interleaved(tensor.reshape(tensor.shape[0], -1), heads if module.endswith("q_proj") else kv_heads)
            tensor = rows.reshape(tensor.shape)
        weights[f"layers.{layer}.{TO_MISTRAL[module]}.{scales[kind]}"] = tensor.contiguous()
    out.mkdir()
    (out / "params.json").write_text(json.dumps(params))
    save_file(weights, str(out / "consolidated.safetensors"))
    for f in Path(hf_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.parametrize("family", ["mistral", "mixtral"])
def test_mistral_layout_serves_the_hugging_face_models_tokens(tiny_model_dir, tmp_path, family):
    hf_dir = tiny_model_dir(family)
    folder = mistral_layout(hf_dir, tmp_path / "consolidated")
    expected = hf_greedy(hf_dir, PROMPTS, NEW_TOKENS)
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    llm = LLM(str(folder), config_format="mistral", load_format="mistral", dtype="float32", max_model_len=128)
    assert [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    ] == expected
    auto = LLM(str(folder), dtype="float32", max_model_len=128)  # found by its params.json alone
    assert [
        o.outputs[0].token_ids for o in auto.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    ] == expected


def test_unknown_params_are_named(tiny_model_dir, tmp_path):
    folder = mistral_layout(tiny_model_dir("mistral"), tmp_path / "odd", moe_router="sinkhorn")
    with pytest.raises(ValueError, match=r"params.json has \['moe_router'\], which Kiln does not read"):
        LLM(str(folder), max_model_len=128)


@pytest.mark.parametrize("per_row", [False, True], ids=["per tensor, static", "per row, dynamic"])
def test_fp8_releases_serve_as_their_widened_weights(tiny_model_dir, tmp_path, per_row):
    """params.json's fp8 quantization: every projection in float8 e4m3 with its qscale_weight, one per
    tensor, or one per row (reordered with wq's and wk's rows), and under a static activation scheme
    the (unused) qscale_act of its input and of the KV cache's quantizer, as Mistral's fp8 releases
    carry them; served as transformers serves the widened weights."""
    hf_dir = tiny_model_dir("mistral")
    fp8, widened = {}, {}
    for name, tensor in load_file(str(Path(hf_dir) / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            fp8[name] = widened[name] = tensor
            continue
        q, scale = fp8_quantize(tensor.float(), None, per_row=per_row)
        layer = name.removesuffix(".weight")
        fp8[name], fp8[f"{layer}.weight_scale"], widened[name] = q, scale.reshape(-1), widen(q, scale, None)
        if not per_row:
            fp8[f"{layer}.input_scale"] = torch.tensor(0.02)
    quantization = {"qformat_weight": "fp8_e4m3", "qscheme_act": "NO_SCALES" if per_row else "TENSOR"}
    folder = mistral_layout(hf_dir, tmp_path / "fp8", fp8, quantization=quantization)
    if not per_row:
        stored = load_file(str(folder / "consolidated.safetensors"))
        save_file(stored | {"layers.0.attention.kv_fake_quantizer.qscale_act": torch.tensor(0.1)},
                  str(folder / "consolidated.safetensors"))  # fmt: skip
    reference = Path(hf_folder(hf_dir, tmp_path / "widened"))
    (reference / "model.safetensors").unlink()
    save_file(widened, str(reference / "model.safetensors"))
    expected = hf_greedy(str(reference), PROMPTS, NEW_TOKENS)
    assert expected != hf_greedy(hf_dir, PROMPTS, NEW_TOKENS)  # fp8 moved the outputs
    assert served(folder) == expected


def test_quantization_kiln_cannot_read_is_named(tiny_model_dir, tmp_path):
    folder = mistral_layout(tiny_model_dir("mistral"), tmp_path / "fp4", quantization={"qformat_weight": "nvfp4"})
    with pytest.raises(ValueError, match=r"params.json's quantization \{'qformat_weight': 'nvfp4'\} is not one"):
        LLM(str(folder), max_model_len=128)


def hf_folder(hf_dir: str, out: Path, **config) -> str:
    """A copy of ``hf_dir`` (its weights linked) whose config.json takes ``config``'s entries."""
    out.mkdir()
    for f in Path(hf_dir).iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    original = json.loads((Path(hf_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(original | config))
    return str(out)


def served(folder: Path) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def test_a_window_per_layer_serves_as_transformers_ministral(tiny_model_dir, tmp_path):
    """params.json's window per layer (a pattern; None is full attention) is transformers'
    Ministral: the 35-token prompt reaches past the 8-token window of the first layer only."""
    hf_dir = tiny_model_dir("mistral")
    folder = mistral_layout(hf_dir, tmp_path / "ministral", sliding_window=[8, None])
    ministral = hf_folder(
        hf_dir, tmp_path / "hf", model_type="ministral", architectures=["MinistralForCausalLM"], sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    expected = hf_greedy(ministral, PROMPTS, NEW_TOKENS)
    assert expected != hf_greedy(hf_dir, PROMPTS, NEW_TOKENS)  # the window changes the tokens
    assert served(folder) == expected


@pytest.mark.parametrize("apply_scale", [True, False])
def test_yarn_serves_as_transformers_reads_it(tiny_model_dir, tmp_path, apply_scale):
    """params.json's yarn section as vLLM reads it: beta is transformers' beta_fast, alpha its
    beta_slow, and apply_scale false an attention factor of 1."""
    hf_dir = tiny_model_dir("mistral")
    yarn = {"factor": 4.0, "original_max_position_embeddings": 16, "beta": 8.0, "alpha": 2.0}
    folder = mistral_layout(hf_dir, tmp_path / "yarn", yarn=yarn | {"apply_scale": apply_scale})
    theta = json.loads((Path(hf_dir) / "config.json").read_text())["rope_parameters"]["rope_theta"]
    rope = {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 8.0, "beta_slow": 2.0} | ({} if apply_scale else {"attention_factor": 1.0})  # fmt: skip
    expected = hf_greedy(hf_folder(hf_dir, tmp_path / "hf", rope_parameters=rope), PROMPTS, NEW_TOKENS)
    assert expected != hf_greedy(hf_dir, PROMPTS, NEW_TOKENS)
    assert served(folder) == expected


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (dict(sliding_window=[8, 16]), r"sliding_window \[8, 16\] is not one window size"),
        (dict(sliding_window=[8, None, None]), "in a pattern that repeats over its 2 layers"),
        (dict(yarn={"factor": 4.0}), r"yarn lacks \['original_max_position_embeddings'\]"),
        (dict(yarn={"factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1}), r"yarn has \['mscale'\]"),
    ],
)
def test_windows_and_yarn_kiln_cannot_read_are_named(tiny_model_dir, tmp_path, extra, message):
    folder = mistral_layout(tiny_model_dir("mistral"), tmp_path / "odd", **extra)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), max_model_len=128)
