"""Rotary-embedding tables for the rope variants of the decoder families.

Every platform's ``rotary_embedding`` op rotates the halves of a whole head (neox style:
dimension i pairs with i + head_dim/2). Families that rotate only part of a head
(``partial_rotary_factor``: GLM, some Phi) or rotate adjacent pairs (GLM's interleaved
style) get the same op: ``rotary_permutation`` reorders each head's query and key
dimensions once, when the weights load, so that their pairs land at (i, i + head_dim/2),
and the table gives the dimensions that do not rotate cos 1 and sin 0. Attention scores
are sums over a head's dimensions, so reordering queries and keys alike changes nothing.
"""

from __future__ import annotations

import math

import torch

FULL_ATTENTION = "full_attention"


def rope_settings(hf_config, layer_type: str = FULL_ATTENTION) -> tuple[float, dict]:
    """(theta, scaling dict): transformers 5's ``rope_parameters``, else the older ``rope_scaling``
    and ``rope_theta``. Families with a rope per kind of layer (Gemma 3: ``sliding_attention``,
    ``full_attention``) keep one dict per kind; ``layer_type`` picks one."""
    params = dict(getattr(hf_config, "rope_parameters", None) or vars(hf_config).get("rope_scaling") or {})
    if per_layer_type(params):
        params = dict(params.get(layer_type) or params[FULL_ATTENTION])
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    return float(theta), params


def rope_kind(params: dict) -> str:
    """The rope type of a scaling dict: ``rope_type``, or the older ``type`` (``default`` when neither)."""
    return params.get("rope_type", params.get("type", "default"))


def per_layer_type(params: dict) -> bool:
    """Whether rope parameters are kept per kind of layer rather than once for the model."""
    return isinstance(params.get(FULL_ATTENTION), dict)


def rotary_dim(hf_config, head_dim: int) -> int:
    """How many of a head's dimensions rotate (``partial_rotary_factor`` of them)."""
    _, params = rope_settings(hf_config)
    factor = params.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def rotary_permutation(head_dim: int, rotating: int, interleaved: bool) -> list[int] | None:
    """The order of a head's dimensions that puts the rotation pairs of a model that rotates
    ``rotating`` dimensions (adjacent pairs if ``interleaved``, else halves) at (i, i + head_dim/2),
    with the other dimensions in the slots left; None when that is the order they have."""
    if interleaved:
        first, second = list(range(0, rotating, 2)), list(range(1, rotating, 2))
    else:
        first, second = list(range(rotating // 2)), list(range(rotating // 2, rotating))
    rest = list(range(rotating, head_dim))
    order = first + rest[: len(rest) // 2] + second + rest[len(rest) // 2 :]
    return None if order == list(range(head_dim)) else order


def context_limit(hf_config, trained: int) -> int:
    """The positions a model takes: ``trained`` (its ``max_position_embeddings``), times the factor
    of a rope scaling that stretches it (linear, dynamic; YaRN from its original length), as vLLM counts."""
    _, scaling = rope_settings(hf_config)
    kind = rope_kind(scaling)
    if kind in ("linear", "dynamic"):
        return int(trained * scaling["factor"])
    if kind == "yarn" and scaling.get("factor"):
        return max(trained, int((scaling.get("original_max_position_embeddings") or trained) * scaling["factor"]))
    return trained


def _inv_freq(
    head_dim: int, theta: float, scaling: dict, max_positions: int, serving: int, beyond: bool = False
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies over ``head_dim`` rotating dimensions, and the factor cos/sin are
    scaled by (1.0 but for YaRN and LongRoPE). ``max_positions`` is the model's trained context,
    ``serving`` the one Kiln serves; ``beyond``: those of the positions past the context a
    length-dependent rope (``long_context_start``) was trained on."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling, max_positions)
    if kind == "longrope":
        return _longrope(inv_freq, scaling, max_positions, beyond)
    if kind == "dynamic":
        if not beyond:
            return inv_freq, 1.0
        # Dynamic NTK: theta raised for a sequence as long as the context Kiln serves.
        factor = scaling["factor"]
        theta = theta * ((factor * serving / max_positions) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled), 1.0
    raise ValueError(f"rope type {kind!r} is not supported (default, linear, dynamic, llama3, longrope and yarn are)")


def _longrope(inv_freq: torch.Tensor, scaling: dict, max_positions: int, beyond: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency factors, ``long_factor`` beyond
    ``original_max_position_embeddings`` and ``short_factor`` within it; cos/sin scaled by
    ``sqrt(1 + ln(factor) / ln(original))``."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = scaling["long_factor"] if beyond else scaling["short_factor"]
    return inv_freq / torch.tensor(ext, dtype=torch.float64), float(attention)


def _yarn(
    inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict, max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: high frequencies kept, low ones
    interpolated by ``factor``, a linear ramp between the two correction dimensions, and cos/sin
    scaled by ``0.1 ln(factor) + 1`` (or the ratio of the ``mscale`` terms, or ``attention_factor``)."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, float(attention)


def long_context_start(scaling: dict, trained: int) -> int | None:
    """Where a rope whose frequencies depend on the sequence's length (``dynamic``, ``longrope``)
    switches to its long-context ones; None for the others.

    transformers recomputes those frequencies for each sequence from its length, so a sequence
    past the switch rotates even its first positions the long way. One table serves every
    sequence here, so the switch is by position instead: positions before it take the short
    frequencies, positions from it on the long ones (for ``dynamic``, theta raised for the whole
    context Kiln serves). Every sequence within the trained context therefore matches
    transformers, whatever ``--max-model-len``; a longer one keeps its first positions' short
    rotation, as a transformers sequence that grows past the switch during generation keeps its
    cached keys'."""
    kind = rope_kind(scaling)
    if kind == "longrope":
        return scaling["original_max_position_embeddings"]
    return trained if kind == "dynamic" else None


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def cos_sin_cache(
    head_dim: int, max_positions: int, hf_config, rotating: int | None = None, layer_type: str = FULL_ATTENTION
) -> torch.Tensor:
    """(max_positions, head_dim) fp32 table: cos in the first half, sin in the second. Only the
    first ``rotating`` / 2 pairs rotate (all by default); the others get cos 1 and sin 0."""
    rotating = rotating or head_dim
    theta, scaling = rope_settings(hf_config, layer_type)
    if "original_max_position_embeddings" not in scaling and hasattr(hf_config, "original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = hf_config.original_max_position_embeddings
    trained = getattr(hf_config, "max_position_embeddings", None) or max_positions
    inv_freq, attention = _inv_freq(rotating, theta, scaling, trained, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    start = long_context_start(scaling, trained)
    if start is not None and max_positions > start:
        far, _ = _inv_freq(rotating, theta, scaling, trained, max_positions, beyond=True)
        freqs[start:] = torch.outer(torch.arange(start, max_positions, dtype=torch.float64), far)
    still = head_dim // 2 - rotating // 2
    cos = torch.cat((freqs.cos() * attention, freqs.new_ones(max_positions, still)), dim=-1)
    sin = torch.cat((freqs.sin() * attention, freqs.new_zeros(max_positions, still)), dim=-1)
    return torch.cat((cos, sin), dim=-1).float()
