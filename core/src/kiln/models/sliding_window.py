"""Which layers of a Hugging Face config attend through a sliding window, and how wide it is.

Follows transformers' reading of each family's config:

* ``mistral``, ``mixtral``, ``phi3``, ``qwen3_moe``: every layer uses ``sliding_window`` when it is
  set (Mistral-7B-v0.1: 4096, Phi-3-mini-4k: 2047; Qwen3-MoE's config keeps it only with
  ``use_sliding_window``).
* ``qwen2`` / ``qwen3`` / ``qwen2_moe``: only with ``use_sliding_window``, and only the layers
  ``layer_types`` marks ``"sliding_attention"`` (by default those from
  ``max_window_layers`` on).
* ``gemma2`` / ``gemma3_text`` / ``ministral``: the layers ``layer_types`` marks (Gemma 2 every
  other one, Gemma 3 five of every six; Ministral's config says, every layer by default).
* ``llama`` and anything else: full attention (transformers ignores the key there).

A query at position p then sees keys at positions k with ``p - k < window``.
"""

from __future__ import annotations

EVERY_LAYER = ("mistral", "mixtral", "phi3", "qwen3_moe")
# Families whose config picks sliding layers by use_sliding_window / layer_types.
LAYER_TYPED = ("qwen2", "qwen3", "qwen2_moe")
ALWAYS_LAYER_TYPED = ("gemma2", "gemma3_text", "ministral")  # layer_types alone
SLIDING = "sliding_attention"


def layer_types(cfg) -> list[str]:
    """Each layer's kind as transformers names them: ``sliding_attention`` or ``full_attention``
    (Gemma 3's kinds also differ in their rope)."""
    layers = cfg.num_hidden_layers
    if cfg.model_type in ALWAYS_LAYER_TYPED + LAYER_TYPED:
        default = [SLIDING if i >= getattr(cfg, "max_window_layers", 0) else "full_attention" for i in range(layers)]
        return list(getattr(cfg, "layer_types", None) or default)
    return [SLIDING if cfg.model_type in EVERY_LAYER else "full_attention"] * layers


def sliding_windows(cfg, max_positions: int) -> list[int | None]:
    """The window of each layer (None: full attention). A window of at least
    ``max_positions`` cannot cut anything off in a sequence Kiln serves, so it is None too."""
    layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type in LAYER_TYPED and not getattr(cfg, "use_sliding_window", False):
        window = None
    if window is None or window >= max_positions:
        return [None] * layers
    return [window if kind == SLIDING else None for kind in layer_types(cfg)]


def check_backend(windows: list[int | None], backend) -> None:
    """Refuse, at start-up, an attention backend that cannot apply the model's window."""
    used = sorted({w for w in windows if w is not None})
    if used and not backend.supports_sliding_window:
        raise ValueError(
            f"model: {sum(w is not None for w in windows)} of its {len(windows)} layers attend through a "
            f"sliding window of {used[0]} tokens, which attention backend {backend.name!r} cannot apply; "
            "choose one that can (--attention-backend, e.g. torch_ref) or a --max-model-len of at most the window"
        )
