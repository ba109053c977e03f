"""How many threads the compiled graph's fused loops use: one for a tiny model, else inductor's
default (every thread torch has).

Inductor splits a loop over threads when each thread would get at least ``min_chunk_size``
elements, and it judges that at compile time. The token count is symbolic (one graph for every
step), so it sizes it at its fallback guess of thousands of tokens and opens a parallel region
for every fused loop, whatever the model. For a model whose rows are a few dozen floats a decode
step's loops are far below that threshold, and a region's fork and join costs more than its
loop. The rule: apply inductor's own threshold to a single token's widest row (a linear's output,
the rows the fused loops walk), the step the fixed cost matters for; under it, one thread.
"""
from __future__ import annotations

import torch
from torch import nn


def widest_row(model: nn.Module) -> int:
    """The widest linear output inside the compiled forward (the logits head is outside it)."""
    return max((m.out_features for name, m in model.named_modules()
                if isinstance(m, nn.Linear) and not name.endswith("lm_head")), default=0)


def loop_threads(model: nn.Module) -> int | None:
    """1 when a token's rows are too narrow to share among threads, else None (inductor's default)."""
    from torch._inductor import config

    threads = torch.get_num_threads()
    row = widest_row(model)
    if threads > 1 and 0 < row < config.cpp.min_chunk_size * threads:
        return 1
    return None
