"""Quantized models: which method a checkpoint uses (``config``, torch-free), its tensors
in Kiln's canonical form (``checkpoint``), the layers models build (``layers``), and the
``kiln quantize`` tool (``tool``) with its algorithms (``smoothquant``, ``awq``, ``gptq``)."""
