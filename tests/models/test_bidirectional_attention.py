"""Bidirectional attention (an encoder's layer, ``causal=False``) in both backends and in the
cpu_paged kernel itself, against a dense float64 softmax written out here: each request sees
all of its own rows and nothing of the others', or with a window the rows at a distance below
it on either side (Gemma 3's bidirectional overlay); GQA, soft caps, requests of one token and
requests longer than one of the kernel's read groups."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_extension
from pagedllm.layers import Attention, build_attention_metadata, get_attn_backend, set_forward_context
from pagedllm.layers.attention.scratch_kv import ScratchKV

LENS = [1, 5, 37, 70, 16]  # 70 rows: past a read group (8 blocks of 4) of the kernel
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 16, 4


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    return (torch.randn(t, HEADS, HEAD_DIM, generator=gen) * 2, torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen),
            torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen))


def _reference(q, k, v, window, soft_cap, lens=tuple(LENS)):
    """Per request, ``softmax(mask(cap(q k^T * scale))) v`` in float64 -> ``[T, H * D]``."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].double() for x in (q, k, v))
        ks, vs = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * HEAD_DIM ** -0.5
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        if window is not None:
            pos = torch.arange(n)
            scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() >= window, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vs).reshape(n, -1))
        start += n
    return torch.cat(out).float()


def _layer(window=None, soft_cap=None):
    return Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, 0, sliding_window=window,
                     logits_soft_cap=soft_cap, causal=False)


def _step(backend):
    tables, next_block = [], 0
    for n in LENS:  # bookkeeping block ids: a bidirectional layer never reads them
        tables.append(list(range(next_block, next_block + -(-n // BLOCK))))
        next_block += len(tables[-1])
    return build_attention_metadata(LENS, [0] * len(LENS), tables, BLOCK, backend=backend)


@pytest.mark.parametrize("backend_name", ["torch", "cpu_paged"])
@pytest.mark.parametrize(("window", "soft_cap"), [(None, None), (3, None), (10, None), (None, 5.0), (6, 5.0)])
def test_each_request_sees_its_own_rows_both_ways(backend_name, window, soft_cap):
    backend = get_attn_backend(backend_name, "cpu")
    assert backend.name == backend_name
    q, k, v = _inputs()
    layer = _layer(window, soft_cap)
    with torch.inference_mode(), set_forward_context(_step(backend)):
        got = layer(q, k, v)
    torch.testing.assert_close(got, _reference(q, k, v, window, soft_cap), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3, 40])
def test_the_kernel_with_causal_off(window):
    """The kernel's own bidirectional path, without a window too (the backend sends a plain
    layer to SDPA): one call for the whole batch over a scratch cache."""
    op = cpu_extension.load_paged_attention_op()
    assert op is not None
    q, k, v = _inputs(1)
    md = _step(get_attn_backend("torch", "cpu"))
    scratch = ScratchKV(md.query_start_loc, BLOCK, q.device)
    got = op(q, scratch.cache(KV_HEADS, HEAD_DIM, k.dtype), scratch.block_tables, md.query_start_loc_tensor,
             scratch.seq_lens, HEAD_DIM ** -0.5, window, 0.0, None, k, v, scratch.slot_mapping, False)
    want = _reference(q, k, v, window or None, None)
    torch.testing.assert_close(got.flatten(1), want, rtol=1e-4, atol=1e-5)


def test_a_bidirectional_layer_keeps_no_kv_and_attends_both_ways_without_a_step():
    layer = _layer(window=4)
    assert layer.kv_cache_spec(torch.float32) is None and "causal=False" in repr(layer)
    assert Attention(HEADS, KV_HEADS, HEAD_DIM, 1.0, 0).kv_cache_spec(torch.float32) is not None  # causal: keeps KV
    q, k, v = (x[:LENS[0] + LENS[1]][LENS[0]:] for x in _inputs())  # the second request alone
    with torch.inference_mode():
        got = layer(q, k, v)
    torch.testing.assert_close(got, _reference(q, k, v, 4, None, lens=[LENS[1]]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a kernel library per level: minutes on 2 cores
@pytest.mark.parametrize("isa", ["v3", "v4"])
def test_every_level_agrees_with_causal_off(isa):
    if not cpu_extension.can_run(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    ops = cpu_extension.load_cpu_ops(isa)
    assert ops is not None, f"the {isa} build failed"
    q, k, v = _inputs(2)
    md = _step(get_attn_backend("torch", "cpu"))
    scratch = ScratchKV(md.query_start_loc, BLOCK, q.device)
    args = (q, scratch.cache(KV_HEADS, HEAD_DIM, k.dtype), scratch.block_tables, md.query_start_loc_tensor,
            scratch.seq_lens, HEAD_DIM ** -0.5, 5, 0.0, None, k, v, scratch.slot_mapping, False)
    torch.testing.assert_close(ops.paged_attention(*args).flatten(1), _reference(q, k, v, 5, None),
                               rtol=1e-4, atol=1e-5)
