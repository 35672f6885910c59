"""Multi-LoRA serving: PEFT adapters over one base model, mixed in one batch.

- ``request``: ``LoRARequest``, the adapter a request runs with;
- ``adapter``: reading and checking a PEFT adapter folder;
- ``layers``: ``LoRALinear``, adapter slots beside each target projection;
- ``slots``: which adapter sits in which slot, and the host-side adapter cache.

The per-token op and its tensors are a platform seam: ``kiln.interfaces.lora``.
"""
