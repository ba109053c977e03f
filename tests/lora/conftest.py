"""Fixtures of the LoRA tests: one thread for the tiny models, a base of each family with the
eight PEFT adapters of ``ADAPTER_SPECS`` on it."""
from __future__ import annotations

import pytest
from lora_helpers import ADAPTER_SPECS, build_adapter, build_base


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Module scope: the PEFT models it holds go with the module, not kept alive for later tests.
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def lora_family(request, tmp_path_factory):
    """(arch, base folder, [(adapter folder, PEFT model)] for every spec)."""
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = build_base(request.param, root / "base")
    adapters = [(root / f"adapter{i}", build_adapter(base, root / f"adapter{i}", r, alpha, targets,
                                                     rslora, seed=i + 1))
                for i, (r, alpha, targets, rslora) in enumerate(ADAPTER_SPECS)]
    return request.param, base, adapters
