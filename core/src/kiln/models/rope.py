"""Rotary-embedding tables for the rope variants of the Llama family."""

from __future__ import annotations

import math

import torch


def rope_settings(hf_config) -> tuple[float, dict]:
    """(theta, scaling dict) whether the config uses ``rope_theta`` or transformers 5's ``rope_parameters``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or params)
    theta = getattr(hf_config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    return float(theta), scaling


def _inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"rope type {kind!r} is not supported yet")


def cos_sin_cache(head_dim: int, max_positions: int, hf_config) -> torch.Tensor:
    """(max_positions, head_dim) fp32 table: cos in the first half, sin in the second."""
    theta, scaling = rope_settings(hf_config)
    inv_freq = _inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
