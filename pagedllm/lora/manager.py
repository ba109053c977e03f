"""LoRAManager: the worker's adapters. Up to ``max_loras`` sit in slots the wrapped layers read
(least recently used evicted first, never one the step needs); up to ``max_cpu_loras`` stay
loaded beyond them (an LRU too); any other known adapter is read from its folder again when a
step needs it. Adding an adapter loads and checks it in full first: a refused one leaves no trace.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.errors import ValidationError
from pagedllm.hf_config import is_gguf_path
from pagedllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.kv_cache import attention_layers
from pagedllm.lora.expert_format import LoRAExperts
from pagedllm.lora.expert_loader import expert_targets
from pagedllm.lora.gguf_adapter import load_gguf_adapter
from pagedllm.lora.graph_weights import LoRAGraphInputs, SlotWeights
from pagedllm.lora.lora_format import LoRAFormat
from pagedllm.lora.mapping import LoRAMapping, build_lora_mapping
from pagedllm.lora.peft_loader import LoRAModel, load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.targets import lora_targets, vocab_target
from pagedllm.lora.vocab_format import LoRAEmbeddingFormat, LoRAHeadFormat

logger = logging.getLogger("pagedllm")


class LoRAManager:
    def __init__(self, model: nn.Module, lora_config: LoRAConfig, dtype: torch.dtype,
                 graph_inputs: LoRAGraphInputs | None = None) -> None:
        """``graph_inputs``: set when the forward is compiled (each layer then holds its slots in
        static shapes too, lora/graph_weights.py)."""
        self.max_loras = lora_config.max_loras
        self.max_lora_rank = lora_config.max_lora_rank
        self.max_cpu_loras = lora_config.max_cpu_loras or lora_config.max_loras
        self.dtype = dtype
        self.targets = lora_targets(model)
        attention = attention_layers(model)
        self.head_dim = attention[0].head_dim if attention else 0  # a GGUF adapter's q/k row order
        modules = dict(model.named_modules())
        self.layers: dict[str, LoRAFormat] = {}
        for name in sorted({t.layer_name for t in self.targets.values()}):
            layer = modules[name]
            fmt = LoRAFormat(layer.weight_format, layer.weight, self.max_loras)
            layer.weight_format = self.layers[name] = fmt
            if graph_inputs is not None:
                spans = sorted({(t.out_offset, t.out_size, t.in_size) for t in self.targets.values()
                                if t.layer_name == name})
                fmt.graph = SlotWeights(graph_inputs, [(o, n) for o, n, _ in spans], spans[0][2],
                                        self.max_loras, self.max_lora_rank, dtype,
                                        graph_inputs.token_lora_indices.device)
        self.graph_inputs = graph_inputs
        self.expert_targets = expert_targets(model)
        self.expert_layers: dict[str, LoRAExperts] = {}
        for target in self.expert_targets.values():
            layer = modules[target.layer_name]
            if isinstance(layer, FusedMoE) and target.layer_name not in self.expert_layers:
                layer.lora = self.expert_layers[target.layer_name] = LoRAExperts(layer, self.max_loras)
        # A trained embedding or head (modules_to_save) replaces the base's for its adapter's rows.
        self.vocab_target = vocab_target(model)
        self.vocab_layers: dict[str, LoRAEmbeddingFormat | LoRAHeadFormat] = {}
        for module in model.modules():
            for cls, name, wrapper in ((VocabParallelEmbedding, "embed_tokens", LoRAEmbeddingFormat),
                                       (ParallelLMHead, "lm_head", LoRAHeadFormat)):
                if isinstance(module, cls) and name not in self.vocab_layers:
                    fmt = wrapper(module.weight_format, module.weight, self.max_loras)
                    module.weight_format = self.vocab_layers[name] = fmt
        self.requests: dict[int, LoRARequest] = {}  # every adapter added and not removed
        self.loaded: OrderedDict[int, LoRAModel] = OrderedDict()  # LRU of loaded adapters
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident id -> slot, LRU first
        # (its key, the mapping) of the forward pass's rows and of the logits rows.
        self._last_mapping: dict[str, tuple[tuple, LoRAMapping | None]] = {}

    def add_lora(self, request: LoRARequest) -> None:
        """Load and check ``request``'s adapter (ValidationError, nothing kept, if it does not fit
        the base); again for a known id only if its name or path changed."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known == request:
            return
        if known is not None:
            raise ValidationError(f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} "
                                  f"({known.lora_path}); give {request.lora_name!r} another id",
                                  "lora_request")
        model = self._load(request)
        self.requests[request.lora_int_id] = request
        self._keep_loaded(model)
        logger.info("LoRA adapter %r: rank %d on %d layers, %.2f MiB", request.lora_name, model.rank,
                    len(model.layers), model.nbytes / (1 << 20))

    def remove_lora(self, lora_int_id: int) -> bool:
        if self.requests.pop(lora_int_id, None) is None:
            return False
        self.loaded.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._fill_slot(slot, None)
        return True

    def list_loras(self) -> list[int]:
        return sorted(self.requests)

    def activate(self, lora_int_ids: set[int]) -> dict[int, int]:
        """Make the step's adapters resident; their slots (id -> slot)."""
        if len(lora_int_ids) > self.max_loras:
            raise RuntimeError(f"a step uses {len(lora_int_ids)} adapters, above max_loras "
                               f"{self.max_loras} (the scheduler caps them)")
        for lora_int_id in lora_int_ids:
            if lora_int_id in self.slot_of:
                self.slot_of.move_to_end(lora_int_id)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:  # evict the least recently used adapter this step does not need
                victim = next(i for i in self.slot_of if i not in lora_int_ids)
                slot = self.slot_of.pop(victim)
            self._fill_slot(slot, self._model(lora_int_id))
            self.slot_of[lora_int_id] = slot
        return {i: self.slot_of[i] for i in lora_int_ids}

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the adapters hold: the loaded ones and the slots' stacked copies
        (each storage once)."""
        held = [t for m in self.loaded.values() for t in m.tensors()]
        for fmt in (*self.layers.values(), *self.vocab_layers.values(), *self.expert_layers.values()):
            held += fmt.lora_tensors()
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}.values())

    def _model(self, lora_int_id: int) -> LoRAModel:
        model = self.loaded.get(lora_int_id)
        if model is None:  # fell out of the CPU LRU: read again (it was checked when added)
            model = self._load(self.requests[lora_int_id])
        self._keep_loaded(model)
        return model

    def _load(self, request: LoRARequest) -> LoRAModel:
        if is_gguf_path(request.lora_path):
            return load_gguf_adapter(request, self.targets, self.max_lora_rank, self.dtype, self.head_dim)
        return load_peft_adapter(request, self.targets, self.max_lora_rank, self.dtype, self.vocab_target,
                                 self.expert_targets)

    def _keep_loaded(self, model: LoRAModel) -> None:
        self.loaded[model.lora_int_id] = model
        self.loaded.move_to_end(model.lora_int_id)
        while len(self.loaded) > self.max_cpu_loras:
            self.loaded.popitem(last=False)

    def _fill_slot(self, slot: int, model: LoRAModel | None) -> None:
        for name, fmt in self.layers.items():
            fmt.set_slot(slot, None if model is None else model.layers.get(name))
        for name, vocab in self.vocab_layers.items():
            vocab.set_slot(slot, None if model is None else model.vocab.get(name))
        for name, experts in self.expert_layers.items():
            experts.set_slot(slot, None if model is None else model.experts.get(name))

    def step_mapping(self, rows: list[tuple[LoRARequest | None, int]], device: torch.device
                     ) -> LoRAMapping | None:
        """The step's mapping from each request's (adapter or None, rows), in batch order, its
        adapters made resident first."""
        ids = {r.lora_int_id for r, _ in rows if r is not None}
        slots = self.activate(ids) if ids else {}
        key = tuple((None if r is None else slots[r.lora_int_id], n) for r, n in rows)
        if self.graph_inputs is not None:
            self.graph_inputs.write(key)
        return self._mapping("forward", key, device) if ids else None

    @property
    def eager_only(self) -> bool:
        """A resident adapter trained the embedding (its rows are looked up eagerly only) or MoE
        experts (their update joins the experts' products outside the graph)."""
        embed = self.vocab_layers.get("embed_tokens")
        return (embed is not None and embed.in_use) or any(any(e.slots) for e in self.expert_layers.values())

    def logits_mapping(self, requests: list[LoRARequest | None], device: torch.device) -> LoRAMapping | None:
        """The mapping of the logits rows (one adapter or None each, made resident by this step's
        ``step_mapping``); None unless a resident adapter trained the head."""
        head = self.vocab_layers.get("lm_head")
        if head is None or not head.in_use:
            return None
        key = tuple((None if r is None else self.slot_of.get(r.lora_int_id), 1) for r in requests)
        return self._mapping("logits", key, device)

    def _mapping(self, purpose: str, key: tuple, device: torch.device) -> LoRAMapping | None:
        last = self._last_mapping.get(purpose)
        if last is None or last[0] != key:
            # Decode steps repeat their batch: its index tensors are built once, not per step.
            last = self._last_mapping[purpose] = (key, build_lora_mapping(list(key), device))
        return last[1]
