"""The tensor side of the engine: building a rank's model, running steps, sampling.

``executor.Executor`` is what the engine core talks to; it holds rank 0's
``ModelRunner``, the other tensor-parallel ranks (``tp_workers``) and the
``Sampler``. Everything torch-free (requests, scheduling, KV bookkeeping, input
and output processing) lives in ``kiln.engine``.
"""
