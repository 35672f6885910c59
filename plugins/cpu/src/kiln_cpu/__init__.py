"""Kiln's CPU platform: fp32 by default, a batched SDPA attention backend over the paged cache."""
