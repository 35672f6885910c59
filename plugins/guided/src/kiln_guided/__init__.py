"""Guided decoding backends for Kiln (xgrammar, lm-format-enforcer)."""
