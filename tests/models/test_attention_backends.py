"""The cpu_paged kernel against the torch reference backend: decode, prefill chunks over a
cached prefix, fresh prompts, mixed batches; GQA and MHA; block sizes 1, 4, 16; ragged lengths;
float32 and bfloat16. Plus the choice of backend and the fallback when the kernel cannot build."""
from __future__ import annotations

import logging
import random

import pytest
import torch

from pagedllm.config import ModelConfig
from pagedllm.errors import ValidationError
from pagedllm.kernels import cpu_extension
from pagedllm.layers import (
    Attention,
    bind_kv_caches,
    build_attention_metadata,
    get_attn_backend,
    kv_cache_shape,
    set_forward_context,
)
from pagedllm.layers.attention import selector


@pytest.fixture(scope="module")
def cpu_paged():
    backend = get_attn_backend("cpu_paged", "cpu")
    # Not a skip: CI has a compiler, and a kernel that stopped building must fail loudly here.
    assert backend.name == "cpu_paged", "the cpu_paged kernel did not build (see the warning)"
    return backend


def _run(backend, batch, *, heads, kv_heads, head_dim, block_size, dtype=torch.float32,
         num_blocks=None, poison=False, seed=0):
    """``batch``: (cached prefix length, new tokens) per request. Writes random K/V for the
    prefixes, then runs one step with ``backend``; returns the layer's output ``[T, H * D]``.
    ``poison``: every slot no request may read holds NaN (the torch reference needs zeros
    there, so the caller compares against an unpoisoned run)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(c + n) // block_size) for c, n in batch]
    num_blocks = num_blocks or sum(need) + 3
    cache = torch.zeros(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), dtype=dtype)
    if poison:
        cache.fill_(float("nan"))
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous block tables
    tables = [[ids.pop() for _ in range(k)] for k in need]
    for (computed, _), table in zip(batch, tables):  # the cached prefix
        for pos in range(computed):
            slot = cache[:, table[pos // block_size], pos % block_size]
            slot.copy_(torch.randn(slot.shape, generator=gen))
    layer = Attention(heads, kv_heads, head_dim, scale=head_dim ** -0.5, layer_idx=0)
    bind_kv_caches(torch.nn.ModuleList([layer]), [cache])
    num_tokens = sum(n for _, n in batch)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    md = build_attention_metadata([n for _, n in batch], [c for c, _ in batch], tables, block_size,
                                  backend=backend)
    with torch.inference_mode(), set_forward_context(md):
        return layer(q, k, v).float()


BATCHES = {
    "decode": [(7, 1), (0, 1), (33, 1), (130, 1)],
    "prefix_chunks": [(5, 9), (16, 16), (47, 3)],
    "fresh_prompts": [(0, 1), (0, 17), (0, 40)],
    "mixed": [(12, 1), (0, 23), (30, 6), (3, 1), (64, 1), (0, 2)],
}


@pytest.mark.parametrize("shape", [(4, 2, 8), (8, 8, 16), (32, 8, 128), (14, 2, 64), (6, 1, 12)],
                         ids=["gqa2", "mha", "gqa4_d128", "gqa7", "mqa_d12"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_cpu_paged_matches_torch(cpu_paged, kind, block_size, shape):
    heads, kv_heads, head_dim = shape
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)
    ours = _run(cpu_paged, BATCHES[kind], **kw)
    ref = _run(get_attn_backend("torch"), BATCHES[kind], **kw)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("seed", range(4))
def test_cpu_paged_random_ragged_batches(cpu_paged, seed):
    rng = random.Random(seed)
    batch = [(rng.choice([0, rng.randint(1, 90)]), rng.choice([1, 1, rng.randint(2, 20)]))
             for _ in range(rng.randint(1, 9))]
    kw = dict(heads=8, kv_heads=2, head_dim=32, block_size=rng.choice([1, 2, 4, 16]), seed=seed)
    torch.testing.assert_close(_run(cpu_paged, batch, **kw), _run(get_attn_backend("torch"), batch, **kw),
                               rtol=1e-5, atol=2e-6)


def test_cpu_paged_bfloat16(cpu_paged):
    kw = dict(heads=8, kv_heads=2, head_dim=64, block_size=4, dtype=torch.bfloat16)
    ours = _run(cpu_paged, BATCHES["mixed"], **kw)
    ref = _run(get_attn_backend("torch"), BATCHES["mixed"], **kw)
    # Both accumulate in float32; bf16 rounding of the output dominates.
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])  # 300: more than one thread's share
def test_cpu_paged_writes_kv_as_the_torch_backend_does(cpu_paged, dtype, num_tokens):
    """The kernel's store of a step's K/V (before it attends) leaves the cache bit for bit as
    index_copy_ does, for k/v that are strided views of a fused qkv output (as the model passes
    them); a slot outside the cache is an error that writes nothing."""
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 24, 4, 100
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(num_tokens, kv_heads, head_dim)
    assert num_tokens == 1 or not k.is_contiguous()  # a single row is contiguous either way
    # One request whose context is the whole cache (every block in its table), past the step's
    # own tokens: the kernel attends (its output is not compared), so the store runs inside a
    # call that also reads.
    md = build_attention_metadata([num_tokens], [num_blocks * block_size - num_tokens],
                                  [list(range(num_blocks))], block_size, backend=cpu_paged)
    md.slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    start = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype)
    layer = Attention(heads, kv_heads, head_dim, scale=1.0, layer_idx=0)
    bind_kv_caches(torch.nn.ModuleList([layer]), [start.clone()])
    cpu_paged.forward(layer, q, k, v, md)
    ref = start.clone()
    reference_layer = Attention(heads, kv_heads, head_dim, scale=1.0, layer_idx=0)
    bind_kv_caches(torch.nn.ModuleList([reference_layer]), [ref])
    get_attn_backend("torch").write_kv(reference_layer, k, v, md)
    assert not torch.equal(ref, start)
    assert torch.equal(layer.kv_cache, ref)
    before = layer.kv_cache.clone()
    md.slot_mapping[-1] = num_blocks * block_size  # one past the end
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_paged.forward(layer, q, k, v, md)
    assert torch.equal(layer.kv_cache, before)


def test_cpu_paged_reads_only_the_requests_own_positions(cpu_paged):
    """Every slot outside the requests' contexts (other blocks, the unused tail of a last
    block, block-table padding) holds NaN: reading any of them, even with weight 0, would
    turn the output into NaN (0 * NaN)."""
    kw = dict(heads=4, kv_heads=2, head_dim=16, block_size=16)
    batch = BATCHES["mixed"]
    ours = _run(cpu_paged, batch, poison=True, num_blocks=40, **kw)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, _run(get_attn_backend("torch"), batch, num_blocks=40, **kw),
                               rtol=1e-5, atol=2e-6)


def test_backend_choice_and_validation():
    assert get_attn_backend("torch", "cpu").name == "torch"
    assert get_attn_backend("auto", "cpu").name in ("cpu_paged", "torch")
    assert get_attn_backend("auto", "cuda").name == "torch"  # nothing CUDA-specific is imported
    with pytest.raises(ValueError, match="CPU only"):
        get_attn_backend("cpu_paged", "cuda")
    with pytest.raises(ValidationError, match="auto, torch, cpu_paged") as info:
        ModelConfig(attention_backend="flash")
    assert info.value.param == "attention_backend"


def test_a_failed_build_falls_back_to_torch_with_one_warning(monkeypatch, caplog):
    def broken_build(isa):
        raise RuntimeError("c++: error: no such compiler")

    monkeypatch.setattr(cpu_extension, "_build", broken_build)
    cpu_extension.load_cpu_ops.cache_clear()
    selector.get_attn_backend.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert get_attn_backend("cpu_paged", "cpu").name == "torch"
            assert get_attn_backend("auto", "cpu").name == "torch"
        warnings = [r for r in caplog.records if "cpu_paged" in r.getMessage()]
        assert len(warnings) == 1 and "no such compiler" in warnings[0].getMessage()
    finally:  # the real kernel for the tests after this one
        cpu_extension.load_cpu_ops.cache_clear()
        selector.get_attn_backend.cache_clear()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (32, 8, 128), (4, 2, 12), (8, 8, 8)])
@pytest.mark.parametrize("block_size,seq_len", [(4, 77), (16, 300)])
def test_a_query_gets_the_same_bits_as_a_decode_and_inside_any_chunk(cpu_paged, heads, kv_heads, head_dim,
                                                                      block_size, seq_len):
    """The kernel scores a decode's few rows one way (8 keys at a time) and a prefill chunk's
    many rows another (keys transposed), and reads the keys of 8-block read groups side by side;
    a row's keys, tiles and sums depend only on its position, so a token attended in a decode
    and again in a chunk (recomputed after a preemption, or chunked differently by another
    schedule) gets the same output, bit for bit. The chunks' rows straddle read groups (32 and
    128 positions here)."""
    op = cpu_extension.load_paged_attention_op()
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    num_blocks = -(-seq_len // block_size) + 5
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:-(-seq_len // block_size)][None]
    q = torch.randn(100, heads, head_dim, generator=gen)
    decodes = {}  # position -> the output of a decode of the token at that position
    for rows in (2, 5, 8, 17, 32, 70, 100):  # non-transposed and transposed chunks ending at one token
        if rows > seq_len:
            continue
        chunk_q = q[-rows:]
        chunk = op(chunk_q, cache, table, torch.tensor([0, rows]), torch.tensor([seq_len]), 0.3)
        for i in range(rows):
            pos = seq_len - rows + i
            if pos not in decodes:
                decodes[pos] = op(chunk_q[i:i + 1], cache, table, torch.tensor([0, 1]),
                                  torch.tensor([pos + 1]), 0.3)[0]
            assert torch.equal(chunk[i], decodes[pos]), (rows, pos)


@pytest.mark.parametrize("isa", ["v3", "v4"])
def test_every_level_computes_the_same_attention(isa):
    """The x86-64-v3 build keeps fewer rows in registers per pass than the v4 one (16 vector
    registers, not 32): every level this CPU can run agrees with the engine's build (which the
    tests above hold to the torch backend), on decodes, a fresh prompt and a chunk. (Not bit
    for bit: -march=native and -march=x86-64-v3 may vectorise the scalar tails differently.)"""
    if not cpu_extension.can_run(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    ops = cpu_extension.load_cpu_ops(isa)
    assert ops is not None, f"the {isa} build failed"
    native = cpu_extension.load_paged_attention_op()
    gen = torch.Generator().manual_seed(7)
    for heads, kv_heads, head_dim, block_size in [(8, 4, 64, 16), (32, 8, 128, 4), (6, 1, 12, 1)]:
        lens, news = [300, 17, 64, 1], [1, 17, 20, 1]  # decodes, a fresh prompt, a chunk
        num_blocks = sum(-(-n // block_size) for n in lens) + 2
        cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen)
        perm = torch.randperm(num_blocks, generator=gen)
        width = max(-(-n // block_size) for n in lens)
        tables = torch.zeros(len(lens), width, dtype=torch.long)
        used = 0
        for b, n in enumerate(lens):
            k = -(-n // block_size)
            tables[b, :k] = perm[used:used + k]
            used += k
        qsl = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
        q = torch.randn(int(qsl[-1]), heads, head_dim, generator=gen)
        args = (q, cache, tables, qsl, torch.tensor(lens), head_dim ** -0.5)
        torch.testing.assert_close(ops.paged_attention(*args), native(*args), rtol=1e-5, atol=2e-6)


def test_auto_is_the_torch_backend_on_a_cpu_nobody_tuned_for(monkeypatch):
    monkeypatch.setattr(cpu_extension, "native_isa", lambda: None)
    selector.get_attn_backend.cache_clear()
    try:
        assert get_attn_backend("auto", "cpu").name == "torch"
        assert get_attn_backend("cpu_paged", "cpu").name == "cpu_paged"  # asked for: still there
    finally:
        selector.get_attn_backend.cache_clear()


MODEL_WINDOW = 200  # a model's sliding window, shorter than the startup check's contexts


def test_the_startup_check_measures_the_kernel_against_the_torch_backend(monkeypatch, caplog):
    from pagedllm.runner import attention_choice as choice

    layer = Attention(8, 2, 32, scale=32 ** -0.5, layer_idx=0)
    monkeypatch.setattr(choice, "_MEASURED", {})
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "auto")
    with caplog.at_level(logging.INFO, logger="pagedllm.runner.attention_choice"):
        backend = choice.choose_cpu_attention(layer)
    (line,) = [r.getMessage() for r in caplog.records if "attention on" in r.getMessage()]
    ((key, speedup),) = choice._MEASURED.items()
    assert key == (torch.float32, torch.float32, (((8, 2, 32, None, None, False), 1),))
    assert speedup > 0 and f"{speedup:.2f}x" in line and backend.name in line
    assert backend.name == ("cpu_paged" if speedup * choice.TORCH_MARGIN >= 1 else "torch")
    monkeypatch.setattr(choice, "_MEASURED", {key: 0.5})  # torch clearly faster
    assert choice.choose_cpu_attention(layer).name == "torch"
    monkeypatch.setattr(choice, "_MEASURED", {key: 0.9})  # a near tie: the kernel
    assert choice.choose_cpu_attention(layer).name == "cpu_paged"
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
    assert choice.choose_cpu_attention(layer).name == "torch"
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "pagedllm")
    monkeypatch.setattr(choice, "_MEASURED", {key: 0.1})  # not consulted when forced
    assert choice.choose_cpu_attention(layer).name == "cpu_paged"


def test_the_startup_check_times_the_models_own_layers_and_cache(monkeypatch):
    """Each kind of layer the model has (window, soft-cap, sinks) is timed over a cache of its
    KV dtype, and the kinds weigh by their layer counts; the features run in both backends."""
    from pagedllm.runner import attention_choice as choice

    layers = [Attention(8, 2, 32, 32 ** -0.5, i, sliding_window=MODEL_WINDOW if i % 2 == 0 else None,
                        logits_soft_cap=30.0, has_sinks=True) for i in range(3)]
    timed = []
    real_time = choice._time

    def spy(layer, batch, dtype, cache_dtype, *rest):
        ratio = real_time(layer, batch, dtype, cache_dtype, *rest)  # the real thing runs
        timed.append((layer.sliding_window, layer.logits_soft_cap, layer.sinks is not None,
                      layer.kv_cache.dtype, q_len := sum(n for _, n in batch),
                      max(c + n for c, n in batch)))
        assert ratio > 0 and q_len > 0
        return {MODEL_WINDOW: 4.0, None: 0.25}[layer.sliding_window]  # kernel 4x faster on windows

    monkeypatch.setattr(choice, "_time", spy)
    monkeypatch.setattr(choice, "_MEASURED", {})
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "auto")
    backend = choice.choose_cpu_attention(layers, kv_cache_dtype=torch.float8_e4m3fn)
    assert {t[:4] for t in timed} == {(MODEL_WINDOW, 30.0, True, torch.float8_e4m3fn),
                                      (None, 30.0, True, torch.float8_e4m3fn)}
    # a windowed layer is timed past its window; a full one over the usual context
    assert {t[5] for t in timed if t[0]} == {MODEL_WINDOW + choice._CHUNK}
    assert {t[5] for t in timed if not t[0]} == {choice._CONTEXT}
    # two windowed layers at 4x, one full at 1/4x: the geometric mean leans to the kernel
    (speedup,) = choice._MEASURED.values()
    assert speedup == pytest.approx(4.0 ** (1 / 3))
    assert backend.name == "cpu_paged"
    timed.clear()  # measured once per model shape and cache: not again
    choice.choose_cpu_attention(layers, kv_cache_dtype=torch.float8_e4m3fn)
    assert not timed
