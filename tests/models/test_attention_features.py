"""Sliding windows, logit soft-capping and attention sinks (issue 31), in both backends (torch
reference, cpu_paged kernel) against a dense float64 masked softmax written out here from the
full K/V: decodes, fresh prompts and chunks over a cached prefix in one flat batch, windows
smaller than a block and not a multiple of it, chunks crossing the window's edge, GQA. Plus: a
windowed decode reads nothing before its window, a row gets the same bits in a decode and in a
chunk, and the AVX-512 build of the kernel compiles (this CPU may not run it)."""
from __future__ import annotations

import random

import pytest
import torch
from paged_helpers import check_isa_builds_compile

from pagedllm.errors import ModelLoadError
from pagedllm.kernels import cpu_extension
from pagedllm.layers import (
    Attention,
    bind_kv_caches,
    build_attention_metadata,
    get_attn_backend,
    kv_cache_shape,
    set_forward_context,
)


@pytest.fixture(scope="module")
def cpu_paged():
    backend = get_attn_backend("cpu_paged", "cpu")
    assert backend.name == "cpu_paged", "the cpu_paged kernel did not build (see the warning)"
    return backend


class Case:
    """One flat step: ``batch`` = (cached prefix length, new tokens) per request, random K/V for
    the prefixes in a paged cache with shuffled blocks, random q/k/v for the new tokens."""

    def __init__(self, batch, *, heads, kv_heads, head_dim, block_size, seed=0, q_gain=1.0):
        gen = torch.Generator().manual_seed(seed)
        self.batch, self.block_size = batch, block_size
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        need = [-(-(c + n) // block_size) for c, n in batch]
        num_blocks = sum(need) + 3
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        self.tables = [[ids.pop() for _ in range(k)] for k in need]
        # Every position's K/V, prefix and new tokens alike: [len, Hkv, D] per request.
        self.keys = [torch.randn(c + n, kv_heads, head_dim, generator=gen) for c, n in batch]
        self.values = [torch.randn(c + n, kv_heads, head_dim, generator=gen) for c, n in batch]
        self.cache = torch.zeros(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim))
        for (computed, _), table, k, v in zip(batch, self.tables, self.keys, self.values):
            for pos in range(computed):
                self.cache[0, table[pos // block_size], pos % block_size] = k[pos]
                self.cache[1, table[pos // block_size], pos % block_size] = v[pos]
        num_tokens = sum(n for _, n in batch)
        # q_gain: scores large enough that a soft cap bends them (tanh far from linear).
        self.q = torch.randn(num_tokens, heads, head_dim, generator=gen) * q_gain
        self.sinks = torch.randn(heads, generator=gen) * 2

    def new_kv(self):
        k = torch.cat([k[c:] for (c, _), k in zip(self.batch, self.keys)])
        v = torch.cat([v[c:] for (c, _), v in zip(self.batch, self.values)])
        return k, v

    def layer(self, window=None, soft_cap=None, sinks=False, cache=None):
        layer = Attention(self.heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5, 0,
                          sliding_window=window, logits_soft_cap=soft_cap, has_sinks=sinks)
        if sinks:
            with torch.no_grad():
                layer.sinks.copy_(self.sinks)
        bind_kv_caches(torch.nn.ModuleList([layer]), [self.cache.clone() if cache is None else cache])
        return layer

    def run(self, backend, layer):
        md = build_attention_metadata([n for _, n in self.batch], [c for c, _ in self.batch],
                                      self.tables, self.block_size, backend=backend)
        k, v = self.new_kv()
        with torch.inference_mode(), set_forward_context(md):
            return layer(self.q, k, v)  # [T, H * D]

    def reference(self, window=None, soft_cap=None, sinks=False):
        """Dense, float64: per query row, scores against every key of its request, soft cap,
        mask (causal, window), the sink column, softmax, values."""
        out, row = [], 0
        group = self.heads // self.kv_heads
        for (computed, n), keys, values in zip(self.batch, self.keys, self.values):
            k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
            v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
            q = self.q[row:row + n].double().transpose(0, 1)  # [H, n, D]
            row += n
            scores = q @ k.transpose(1, 2) * self.head_dim ** -0.5  # [H, n, L]
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            query_pos = torch.arange(computed, computed + n)[:, None]
            key_pos = torch.arange(computed + n)[None, :]
            seen = key_pos <= query_pos
            if window is not None:
                seen &= key_pos > query_pos - window
            scores = scores.masked_fill(~seen, float("-inf"))
            if sinks:
                sink = self.sinks.double()[:, None, None].expand(-1, n, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out.append((probs @ v).transpose(0, 1).reshape(n, -1))  # [n, H * D]
        return torch.cat(out).float()


# Each batch mixes decodes, fresh prompts and chunks over a cached prefix; with windows of 3,
# 10 and 40 some requests sit inside the window, others far past it, and chunks start before
# the window's edge and end after it.
BATCHES = {
    "mixed": [(12, 1), (0, 23), (30, 6), (3, 1), (64, 1), (0, 2), (20, 12), (130, 1)],
    "chunks": [(5, 9), (16, 16), (47, 3), (9, 40)],
    "decodes": [(0, 1), (2, 1), (9, 1), (39, 1), (40, 1), (100, 1), (257, 1)],
}
FEATURES = {  # (sliding_window, logits_soft_cap, has_sinks)
    "window": (10, None, False),
    "window_lt_block": (3, None, False),
    "soft_cap": (None, 2.0, False),
    "sinks": (None, None, True),
    "gemma2": (40, 2.0, False),       # window + soft cap
    "gpt_oss": (10, None, True),      # window + sinks
    "all": (3, 5.0, True),
}


@pytest.mark.parametrize("backend_name", ["torch", "cpu_paged"])
@pytest.mark.parametrize("shape", [(8, 2, 32, 4), (4, 4, 16, 16), (6, 1, 12, 4)],
                         ids=["gqa4_block4", "mha_block16", "mqa_d12_block4"])
@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("features", sorted(FEATURES))
def test_features_match_a_dense_float64_reference(request, features, kind, shape, backend_name):
    if backend_name == "cpu_paged":
        request.getfixturevalue("cpu_paged")
    heads, kv_heads, head_dim, block_size = shape
    window, soft_cap, sinks = FEATURES[features]
    case = Case(BATCHES[kind], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, seed=block_size + heads, q_gain=3.0)
    ours = case.run(get_attn_backend(backend_name, "cpu"), case.layer(window, soft_cap, sinks))
    ref = case.reference(window, soft_cap, sinks)
    assert not torch.allclose(ref, case.reference(), atol=1e-3)  # the features change the result
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("features", ["window", "gemma2", "gpt_oss", "all"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_windowed_decode_reads_nothing_before_its_window(cpu_paged, features, block_size):
    """Decodes far past their window, and a chunk: every position before the window of the
    request's first query row holds NaN (whole blocks and the head of the window's first
    block); reading any of them, even with weight 0, would make the output NaN (0 * NaN). A
    long context also shows the blocks before the window are skipped, not masked."""
    window, soft_cap, sinks = FEATURES[features]
    batch = [(300, 1), (97, 1), (window + 1, 1), (60, 7)]
    case = Case(batch, heads=8, kv_heads=2, head_dim=16, block_size=block_size, q_gain=3.0)
    cache = case.cache.clone()
    for (computed, _), table in zip(batch, case.tables):
        for pos in range(max(0, computed - window + 1)):  # before the first query row's window
            cache[:, table[pos // block_size], pos % block_size] = float("nan")
    ours = case.run(cpu_paged, case.layer(window, soft_cap, sinks, cache=cache))
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, case.reference(window, soft_cap, sinks), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("features", ["window", "window_lt_block", "soft_cap", "gpt_oss", "all"])
@pytest.mark.parametrize("block_size,seq_len", [(4, 77), (16, 300)])
def test_a_query_gets_the_same_bits_as_a_decode_and_inside_any_chunk(cpu_paged, features, block_size,
                                                                      seq_len):
    """As for plain layers (test_attention_backends.py): with a window the kernel reads an item's
    keys from a tile-aligned position, so a row's tiles and sums do not depend on where its
    chunk starts, and a token recomputed in a chunk after a preemption gets its decode's bits."""
    window, soft_cap, sinks = FEATURES[features]
    op = cpu_extension.load_paged_attention_op()
    heads, kv_heads, head_dim = 8, 2, 32
    gen = torch.Generator().manual_seed(block_size)
    num_blocks = -(-seq_len // block_size) + 5
    cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:-(-seq_len // block_size)][None]
    q = torch.randn(100, heads, head_dim, generator=gen) * 3
    extra = (window or 0, soft_cap or 0.0, torch.randn(heads, generator=gen) if sinks else None)
    decodes = {}
    for rows in (2, 5, 17, 70, 100):  # non-transposed and transposed chunks ending at one token
        if rows > seq_len:
            continue
        chunk = op(q[-rows:], cache, table, torch.tensor([0, rows]), torch.tensor([seq_len]), 0.3, *extra)
        for i in range(rows):
            pos = seq_len - rows + i
            if pos not in decodes:
                decodes[pos] = op(q[-rows + i:][:1], cache, table, torch.tensor([0, 1]),
                                  torch.tensor([pos + 1]), 0.3, *extra)[0]
            assert torch.equal(chunk[i], decodes[pos]), (rows, pos)


@pytest.mark.slow  # two -O3 compiles of the kernel: ~1-2 minutes on 2 cores
def test_every_level_builds_and_the_runnable_ones_agree(tmp_path):
    """The x86-64-v3 and -v4 builds of the kernel compile (an object file each, not loaded:
    this CPU may lack AVX-512); those this CPU runs agree with the engine's build on a batch
    with every feature."""
    check_isa_builds_compile(tmp_path)
    case = Case(BATCHES["mixed"], heads=8, kv_heads=2, head_dim=64, block_size=4, q_gain=3.0)
    k, v = case.new_kv()
    md = build_attention_metadata([n for _, n in case.batch], [c for c, _ in case.batch],
                                  case.tables, case.block_size, backend=get_attn_backend("torch"))
    layer = case.layer()
    get_attn_backend("torch").write_kv(layer, k, v, md)  # every new token's K/V in the cache
    args = (case.q, layer.kv_cache, md.block_tables, md.query_start_loc_tensor, md.seq_lens_tensor,
            0.125, 10, 5.0, case.sinks)
    native = cpu_extension.load_paged_attention_op()(*args).flatten(1)  # [T, H * D]
    torch.testing.assert_close(native, case.reference(10, 5.0, True), rtol=1e-4, atol=1e-5)
    for isa in ("v3", "v4"):
        if cpu_extension.can_run(isa):
            ops = cpu_extension.load_cpu_ops(isa)
            assert ops is not None, f"the {isa} build failed"
            torch.testing.assert_close(ops.paged_attention(*args).flatten(1), native, rtol=1e-5,
                                       atol=2e-6)


def test_layer_validates_its_features_and_plain_layers_have_none():
    plain = Attention(4, 2, 8, 1.0, 0)
    assert (plain.sliding_window, plain.logits_soft_cap, plain.sinks) == (None, None, None)
    assert dict(plain.named_parameters()) == {}
    layer = Attention(4, 2, 8, 1.0, 3, sliding_window=512, logits_soft_cap=50, has_sinks=True)
    assert layer.sinks.shape == (4,) and "sinks" in dict(layer.named_parameters())
    assert layer.logits_soft_cap == 50.0 and "sliding_window=512" in repr(layer)
    for bad in (dict(sliding_window=0), dict(sliding_window=2.5), dict(logits_soft_cap=0.0),
                dict(logits_soft_cap=-1.0)):
        with pytest.raises(ModelLoadError, match="attention layer 3"):
            Attention(4, 2, 8, 1.0, 3, **bad)


@pytest.mark.parametrize("features", ["window", "gemma2", "gpt_oss"])
def test_without_a_step_the_layer_attends_causally_with_its_features(features):
    """Warm-up and profiling run the model with no step (no cache): the layer's features still
    apply (one sequence from position 0)."""
    window, soft_cap, sinks = FEATURES[features]
    case = Case([(0, 30)], heads=8, kv_heads=2, head_dim=16, block_size=4, q_gain=3.0)
    k, v = case.new_kv()
    with torch.inference_mode():
        ours = case.layer(window, soft_cap, sinks)(case.q, k, v)
    torch.testing.assert_close(ours, case.reference(window, soft_cap, sinks), rtol=1e-4, atol=1e-5)


def test_the_kernel_with_features_is_opaque_to_dynamo(cpu_paged):
    """The kernel's fake implementation takes the feature arguments: a compiled graph holds the
    call as one node (fullgraph) and gives the kernel's own output."""
    case = Case(BATCHES["chunks"], heads=4, kv_heads=2, head_dim=16, block_size=4)
    layer = case.layer()
    md = build_attention_metadata([n for _, n in case.batch], [c for c, _ in case.batch],
                                  case.tables, case.block_size, backend=cpu_paged)

    def attend(q, cache, sinks):
        return torch.ops.pagedllm.paged_attention(q, cache, md.block_tables, md.query_start_loc_tensor,
                                                  md.seq_lens_tensor, 0.25, 10, 5.0, sinks) * 2

    want = attend(case.q, layer.kv_cache, case.sinks)
    torch._dynamo.reset()
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(case.q, layer.kv_cache, case.sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
