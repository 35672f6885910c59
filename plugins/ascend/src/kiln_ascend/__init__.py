"""Kiln's Ascend NPU platform; torch_npu is imported only when the platform is chosen."""
