"""Rotary-embedding tables for the rope variants of the Llama family."""

from __future__ import annotations

import math

import torch


def rope_settings(hf_config) -> tuple[float, dict]:
    """(theta, scaling dict): transformers 5's ``rope_parameters``, else the older ``rope_scaling``
    and ``rope_theta``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or vars(hf_config).get("rope_scaling") or {})
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    return float(theta), params


def context_limit(hf_config, trained: int) -> int:
    """The positions a model takes: ``trained`` (its ``max_position_embeddings``), times the factor
    of a rope scaling that stretches it (linear; YaRN from its original length), as vLLM counts."""
    _, scaling = rope_settings(hf_config)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return int(trained * scaling["factor"])
    if kind == "yarn" and scaling.get("factor"):
        return max(trained, int((scaling.get("original_max_position_embeddings") or trained) * scaling["factor"]))
    return trained


def _inv_freq(head_dim: int, theta: float, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies, and the factor cos/sin are scaled by (1.0 but for YaRN)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling, max_positions)
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
    raise ValueError(
        f"rope type {kind!r} is not supported yet (default, linear, llama3 and yarn are); "
        "dynamic and longrope scale by each sequence's length"
    )


def _yarn(
    inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict, max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: high frequencies kept, low ones
    interpolated by ``factor``, a linear ramp between the two correction dimensions, and cos/sin
    scaled by ``0.1 ln(factor) + 1`` (or the ratio of the ``mscale`` terms, or ``attention_factor``)."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

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


def cos_sin_cache(head_dim: int, max_positions: int, hf_config) -> torch.Tensor:
    """(max_positions, head_dim) fp32 table: cos in the first half, sin in the second."""
    theta, scaling = rope_settings(hf_config)
    trained = getattr(hf_config, "max_position_embeddings", None) or max_positions
    inv_freq, attention = _inv_freq(head_dim, theta, scaling, trained)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention).float()
