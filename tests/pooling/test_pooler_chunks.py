"""Pooler.carry: an input pooled from chunks (what the earlier ones kept, then the last) gives
the vector of the whole input, for every pooling type."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm.models.pooler import Pooler
from pagedllm.pooler_config import PoolerConfig
from pagedllm.pooling_params import PoolingParams


@pytest.mark.parametrize("pooling_type", ["CLS", "MEAN", "LAST"])
def test_chunks_pool_to_the_whole_input(pooling_type):
    pooler = Pooler(PoolerConfig(pooling_type=pooling_type, normalize=True, hidden_size=8), nn.Module(),
                    torch.float32, torch.device("cpu"))
    hidden = torch.randn(20, 8, generator=torch.Generator().manual_seed(0))
    params = [PoolingParams(task="embed")]
    carried = [pooler.carry(hidden[a:b]) for a, b in ((0, 7), (7, 15))]
    assert sum(len(c) for c in carried) == {"CLS": 2, "MEAN": 15, "LAST": 0}[pooling_type]
    chunked = pooler([torch.cat([*carried, hidden[15:20]])], params)[0]
    whole = pooler([hidden], params)[0]
    assert torch.allclose(torch.tensor(chunked), torch.tensor(whole), atol=1e-6)
    want = {"CLS": hidden[0], "MEAN": hidden.mean(dim=0), "LAST": hidden[-1]}[pooling_type]
    assert torch.allclose(torch.tensor(whole), nn.functional.normalize(want, dim=0), atol=1e-6)
