"""Which adapters sit in the model's ``--max-loras`` slots, and loaded adapters on the host.

Per step, rank 0 ``assign``s each request's adapter a slot (the scheduler admits at most
``--max-loras`` adapters among running requests, so one is always free or reusable), and
every rank ``apply``s the step: copies newly placed adapters into their slots and sets
the mapping the layers read. Adapters are read from disk when a request is checked, held
while requests run on them, then kept in an LRU of ``--max-cpu-loras``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kiln.interfaces.lora import LoRAMapping
from kiln.lora.adapter import BaseModelShape, LoRAAdapter, load_adapter
from kiln.lora.layers import LoRALinear, LoRAState
from kiln.lora.request import LoRARequest

SlotLoad = tuple[int, LoRAAdapter]  # an adapter to copy into a slot before a step


class AdapterCache:
    """Adapters read from disk (thread-safe: the API reads adapters while the engine steps).

    An adapter with unfinished requests is *held* (``hold``/``release``, by the engine) and
    stays; the others are kept least recently used first, up to ``capacity``. So a step never
    reads a disk: every adapter it places is held."""

    def __init__(self, shape: BaseModelShape, capacity: int, max_rank: int, enable_bias: bool) -> None:
        self.shape, self.capacity, self.max_rank, self.enable_bias = shape, capacity, max_rank, enable_bias
        self._idle: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()
        self._held: dict[LoRARequest, list] = {}  # -> [adapter, number of unfinished requests]
        self._lock = threading.Lock()

    def get(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter, read on first use; ``ValueError`` says what is wrong with it."""
        with self._lock:
            if req in self._held:
                return self._held[req][0]
            if req in self._idle:
                self._idle.move_to_end(req)
                return self._idle[req]
        adapter = load_adapter(req.lora_name, req.lora_path, self.shape, self.max_rank, self.enable_bias)
        with self._lock:
            if req not in self._held:
                self._idle[req] = adapter
                self._trim()
        return adapter

    def hold(self, req: LoRARequest, adapter: LoRAAdapter) -> None:
        """One more unfinished request on ``adapter`` (as ``get`` returned it)."""
        with self._lock:
            self._idle.pop(req, None)
            self._held.setdefault(req, [adapter, 0])[1] += 1

    def release(self, req: LoRARequest) -> None:
        """One request on ``req`` fewer; the last one leaves the adapter idle."""
        with self._lock:
            held = self._held.get(req)
            if held is None:
                return
            held[1] -= 1
            if held[1] == 0:
                del self._held[req]
                self._idle[req] = held[0]
                self._trim()

    def drop(self, lora_int_id: int) -> None:
        """Forget an idle adapter (a held one stays until its requests end)."""
        with self._lock:
            for req in [r for r in self._idle if r.lora_int_id == lora_int_id]:
                del self._idle[req]

    def _trim(self) -> None:
        while len(self._idle) > self.capacity:
            self._idle.popitem(last=False)

    def __len__(self) -> int:
        return len(self._idle) + len(self._held)


class LoRASlots:
    """One rank's LoRA layers, their slots and its adapter cache."""

    def __init__(self, config, shape: BaseModelShape, state: LoRAState, layers: list[LoRALinear]) -> None:
        self.state, self.layers = state, layers
        self.num_slots = config.max_loras
        capacity = config.max_cpu_loras or config.max_loras
        self.cache = AdapterCache(shape, capacity, config.max_lora_rank, config.enable_lora_bias)
        self.slot_adapter: list[LoRARequest | None] = [None] * self.num_slots  # rank 0's placement
        self.slot_weights: list[LoRAAdapter | None] = [None] * self.num_slots  # what each slot was filled with
        self.slot_used = [0] * self.num_slots  # the step each slot last ran
        self.steps = 0
        self.loads = 0  # adapters copied into a slot, for logs and tests

    def assign(self, requests: list[LoRARequest | None]) -> tuple[list[int], list[SlotLoad]]:
        """A slot per request (-1: base model), and the adapters to copy in first (sent whole to
        the other ranks, which read no disk). A slot whose adapter was read again since (an id
        unloaded, then loaded anew) is refilled."""
        wanted = {lora for lora in requests if lora is not None}
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"{len(wanted)} adapters in one step, over --max-loras {self.num_slots}")
        slot_of = {lora: i for i, lora in enumerate(self.slot_adapter) if lora is not None}
        loads = []
        for lora in sorted(wanted, key=lambda r: r.lora_int_id):
            adapter = self.cache.get(lora)  # held by the engine while its requests run: no disk read
            slot = slot_of.get(lora)
            if slot is not None and self.slot_weights[slot] is adapter:
                continue
            if slot is None:
                free = [i for i, held in enumerate(self.slot_adapter) if held is None or held not in wanted]
                slot = min(free, key=lambda i: (self.slot_adapter[i] is not None, self.slot_used[i]))
            self.slot_adapter[slot], self.slot_weights[slot] = lora, adapter
            slot_of[lora] = slot
            loads.append((slot, adapter))
        self.steps += 1
        for lora in wanted:
            self.slot_used[slot_of[lora]] = self.steps
        return [-1 if lora is None else slot_of[lora] for lora in requests], loads

    def apply(
        self, loads: list[SlotLoad], slots: list[int] | None, query_lens: list[int], device
    ) -> LoRAMapping | None:
        """Copy ``loads`` into their slots, then set (and return) the step's mapping."""
        for slot, adapter in loads:
            for layer in self.layers:
                layer.set_slot(slot, adapter)
            self.loads += 1
        mapping = None if slots is None else LoRAMapping.of(slots, query_lens, torch.device(device))
        self.state.mapping = mapping
        return mapping

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: out of the cache once its requests end, so the same id loaded
        again is read again (and its slot refilled)."""
        self.cache.drop(lora_int_id)


LORA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def build_lora_slots(model: torch.nn.Module, config, hf_config, tp, dtype: torch.dtype) -> LoRASlots:
    """``--enable-lora``: slots beside the model's projections (after the platform processed it)."""
    from kiln.lora.layers import add_lora_layers

    shape = BaseModelShape.of(hf_config, model)
    lora_dtype = dtype if config.lora_dtype == "auto" else LORA_DTYPES[config.lora_dtype]
    state, layers = add_lora_layers(model, shape, tp, config, lora_dtype)
    return LoRASlots(config, shape, state, layers)
