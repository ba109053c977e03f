"""LoRA adapters on the weight-format seam: PEFT folders loaded and checked against the base
(``peft_loader``), a wrapper around each linear layer's ``apply`` that adds every row's adapter
update (``lora_format``), the per-step row-to-slot mapping (``mapping``) and the worker's
resident slots with an LRU beyond them (``manager``). ``request`` is plain data (no torch): the
engine and the scheduler carry it."""
