"""Kiln's CUDA platform: Triton kernels written for Kiln (attention, KV write, fused ops)."""
