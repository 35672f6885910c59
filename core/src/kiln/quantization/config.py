"""Which quantization a model uses: from its ``quantization_config`` or ``--quantization``.

Imports no torch: the engine resolves the method before any tensor code runs, so a
method the checkpoint or the device cannot serve is a start-up error.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

# --quantization values; aliases on the right map to the names on the left.
METHODS = ("awq", "gptq", "compressed-tensors", "smoothquant", "weight_only_int8", "fp8", "gguf", "none")
ALIASES = {"smooth_quant": "smoothquant", "w8a8": "smoothquant", "gpt": "gptq", "None": "none"}
FLAG_CHOICES = (*METHODS, *ALIASES)


@dataclass(frozen=True)
class QuantScheme:
    """What one quantized linear layer stores and how it computes.

    Weights are integers ``q`` with a scale per ``group_size`` inputs of each output
    feature (one per feature when ``group_size`` is None) and, unless ``symmetric``, a
    zero point: ``w = (q - zero) * scale``. With ``activation_bits`` 8 the layer's input is
    quantized to int8 per token at run time (W8A8) and the product is an integer GEMM.
    ``float_weights``: ``q`` is float8 (e4m3) rather than an integer (fp8 checkpoints)."""

    weight_bits: int
    group_size: int | None
    symmetric: bool
    activation_bits: int | None = None
    float_weights: bool = False

    @property
    def name(self) -> str:
        return f"{'fp' if self.float_weights else 'w'}{self.weight_bits}a{self.activation_bits or 16}"

    def describe(self) -> str:
        groups = f"group {self.group_size}" if self.group_size else "per channel"
        return f"{self.name} ({groups}, {'symmetric' if self.symmetric else 'with zero points'})"


W8A8 = QuantScheme(8, None, True, activation_bits=8)
W8A16 = QuantScheme(8, None, True)


def fp8_scheme(layout: Fp8Layout) -> QuantScheme:
    """fp8 weights with a scale per output feature (a per-tensor scale repeats down them), or per
    block: a group of ``block[1]`` inputs (the block's rows repeat its scale)."""
    return QuantScheme(8, layout.block[1] if layout.block else None, True, float_weights=True)


@dataclass(frozen=True)
class QuantConfig:
    """A model's quantization: the checkpoint ``method`` (``compressed-tensors``, ``awq``,
    ``gptq``, ``fp8``, or ``online`` for weights quantized at load), the scheme of its linear
    layers, and the layers it leaves alone (``ignore``: names or ``re:`` patterns, as
    compressed-tensors writes them). ``packed``: compressed-tensors' ``pack-quantized``
    format (codes packed into int32) rather than plain int8."""

    method: str
    scheme: QuantScheme
    ignore: tuple[str, ...] = ("lm_head",)
    desc_act: bool = False  # GPTQ act-order: each input column names its group (g_idx)
    packed: bool = False

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer ``module`` (a Hugging Face name) is quantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern) or fnmatch.fnmatch(module, pattern):
                return False
            elif module.startswith(pattern + "."):  # a whole block or attention left alone, as transformers reads it
                return False
        return True

    @property
    def label(self) -> str:
        return f"{self.method} {self.scheme.describe()}"


@dataclass(frozen=True)
class Fp8Layout:
    """An fp8 checkpoint: each quantized linear layer ``X`` stores ``X.weight`` in float8 (e4m3)
    and ``X.<scale_name>``, one fp32 scale per tensor, per output feature or per ``block`` of
    (rows, columns): ``w = fp8 * scale``. Platforms with an fp8 kernel (``linear_method`` of
    ``fp8_scheme``) keep them; on others they are widened once at load (``kiln.quantization.fp8``).
    ``ignore``: the linear layers the checkpoint left unquantized."""

    scale_name: str
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ("lm_head",)


def fp8_layout(qc: dict | None) -> Fp8Layout | None:
    """The layout of an fp8 ``quantization_config`` (``quant_method: fp8``, as DeepSeek-V3 and
    Qwen3-FP8 ship, or compressed-tensors with float weights); None for any other."""
    method = (qc or {}).get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8: format {qc.get('fmt')!r} (Kiln reads e4m3 checkpoints)")
        block = qc.get("weight_block_size")
        ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()) + ("lm_head",)
        return Fp8Layout("weight_scale_inv", tuple(block), ignore) if block else Fp8Layout("weight_scale", None, ignore)
    if method != "compressed-tensors":
        return None
    groups = list((qc.get("config_groups") or {}).values())
    weights = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
    if weights.get("type") != "float":
        return None
    strategy = weights.get("strategy")
    if weights.get("num_bits") != 8 or strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"compressed-tensors: float weights {weights} (Kiln reads 8-bit per tensor, channel or block)")
    block = weights.get("block_structure") if strategy == "block" else None
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2 and all(type(n) is int for n in block)):
        raise ValueError(f"compressed-tensors: block strategy needs block_structure [rows, columns], got {block!r}")
    return Fp8Layout("weight_scale", tuple(block) if block else None, tuple(qc.get("ignore") or ("lm_head",)))


def normalize_flag(flag: str | None) -> str | None:
    """``--quantization``'s canonical name (None when not given or ``none``)."""
    if flag is None:
        return None
    name = ALIASES.get(flag, flag)
    if name not in METHODS:
        raise ValueError(f"--quantization: unknown method {flag!r}; choose from {', '.join(METHODS)}")
    return None if name == "none" else name


def _compressed_tensors(qc: dict) -> QuantConfig:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors: {len(groups)} config groups; Kiln serves checkpoints with one")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    fmt = groups[0].get("format") or qc.get("format")
    if fmt not in ("int-quantized", "naive-quantized", "pack-quantized"):
        raise ValueError(f"compressed-tensors: format {fmt!r} (Kiln reads int-, naive- and pack-quantized)")
    if weights.get("actorder"):
        raise ValueError("compressed-tensors: act-order (weight_g_idx) checkpoints are not supported")
    if weights.get("type", "int") != "int" or weights.get("num_bits") not in (4, 8):
        raise ValueError(f"compressed-tensors: weights {weights} are not 4- or 8-bit integers")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "group"):
        raise ValueError(f"compressed-tensors: weight strategy {strategy!r} (Kiln reads channel and group)")
    group = weights.get("group_size") if strategy == "group" else None
    act_bits = None
    if acts:
        if not (acts.get("type", "int") == "int" and acts.get("num_bits") == 8 and acts.get("dynamic")):
            raise ValueError(f"compressed-tensors: activations {acts} (Kiln reads dynamic int8 per token)")
        act_bits = 8
    scheme = QuantScheme(weights["num_bits"], group, bool(weights.get("symmetric", True)), act_bits)
    if act_bits and (scheme.weight_bits != 8 or group or not scheme.symmetric):
        raise ValueError(f"compressed-tensors: int8 activations need symmetric per-channel int8 weights, not {weights}")
    packed = fmt == "pack-quantized"
    if (scheme.weight_bits == 4 and not packed) or (packed and act_bits) or (packed and not scheme.symmetric):
        raise ValueError(f"compressed-tensors: {scheme.describe()} stored {fmt} is not supported")
    return QuantConfig("compressed-tensors", scheme, tuple(qc.get("ignore") or ()), packed=packed)


def from_hf(qc: dict) -> QuantConfig:
    """The ``QuantConfig`` of a checkpoint's ``quantization_config``."""
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method in ("awq", "gptq"):
        bits, group = qc.get("bits", 4), qc.get("group_size", 128)
        if bits != 4:
            raise ValueError(f"{method}: {bits}-bit weights (Kiln reads 4-bit)")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"awq: version {qc.get('version')!r} (Kiln reads AutoAWQ's GEMM layout)")
        symmetric = method == "gptq" and bool(qc.get("sym", True))
        ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
        group = None if group in (-1, None) else group
        return QuantConfig(method, QuantScheme(4, group, symmetric), ignore, bool(qc.get("desc_act", False)))
    raise ValueError(
        f"quantization method {method!r} in config.json is not supported; "
        "Kiln serves awq, gptq and compressed-tensors checkpoints"
    )


def for_model_file(flag: str | None, gguf: bool) -> str | None:
    """``--quantization`` for a model read from a GGUF file (``gguf``) or not: a GGUF file is
    ``gguf`` unless the flag says otherwise (``none``: its weights widened to the exact
    floats); ``gguf`` for any other model is refused."""
    if gguf and flag is None:
        return "gguf"
    if normalize_flag(flag) == "gguf" and not gguf:
        raise ValueError("--quantization gguf: the model is not a .gguf file")
    return flag


# --quantization name -> checkpoint methods it accepts
_FLAG_MATCHES = {
    "awq": ("awq",),
    "gptq": ("gptq",),
    "compressed-tensors": ("compressed-tensors",),
    "smoothquant": ("compressed-tensors",),
    "weight_only_int8": ("compressed-tensors",),
}


def resolve(flag: str | None, hf_quant_config: dict | None) -> QuantConfig | None:
    """The model's quantization from ``--quantization`` and the checkpoint's config (None: unquantized).

    A checkpoint's method is auto-detected; a flag that names another one is refused.
    On an unquantized checkpoint ``weight_only_int8`` quantizes weights at load (per
    channel); other methods need a quantized checkpoint (``kiln quantize`` makes one)."""
    name = normalize_flag(flag)
    if name == "gguf":  # the GGUF file's own blocks, which the platform keeps (``Platform.process_weights``)
        return None
    if flag is not None and name is None:  # --quantization none
        if hf_quant_config:
            raise ValueError("--quantization none: the checkpoint is quantized; serve it with its own method")
        return None
    fp8 = fp8_layout(hf_quant_config)
    if fp8 is not None:  # kept in fp8 where the platform has a kernel for it, else widened at load
        if name not in (None, "fp8", "compressed-tensors"):
            raise ValueError(f"--quantization {flag}: the checkpoint's weights are fp8 (--quantization fp8)")
        return QuantConfig("fp8", fp8_scheme(fp8), fp8.ignore)
    if name == "fp8":
        raise ValueError(
            "--quantization fp8: needs an fp8 checkpoint (quant_method fp8, or compressed-tensors float8 weights); "
            "Kiln does not quantize other weights to fp8: use weight_only_int8 or smoothquant"
        )
    if not hf_quant_config:
        if name is None:
            return None
        if name == "weight_only_int8":
            return QuantConfig("online", W8A16)
        hint = {"smoothquant": "smooth_quant", "compressed-tensors": "smooth_quant"}.get(name, name)
        raise ValueError(
            f"--quantization {flag}: the checkpoint is not quantized; make a quantized copy first with "
            f"`kiln quantize -i MODEL -o OUT -quant_type {hint}`"
        )
    config = from_hf(hf_quant_config)
    if name is not None:
        wanted = {"smoothquant": W8A8, "weight_only_int8": W8A16}.get(name)
        if config.method not in _FLAG_MATCHES[name] or (wanted and config.scheme != wanted):
            raise ValueError(f"--quantization {flag}: the checkpoint is quantized with {config.label}")
    return config
