"""The step trace: records built from each step's own reports, on an LLMEngine over the
FakeRunner (no model, no torch), and the Chrome trace-event conversion."""
from __future__ import annotations

import json

from pagedllm import SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig, SchedulerConfig
from pagedllm.core.block_pool import NULL_BLOCK_ID
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.step_trace import KINDS, SCHEMA_VERSION, block_map, read_trace
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.explain.chrome_trace import to_chrome
from pagedllm.runner.fake import FakeRunner

VOCAB = 50


def make_engine(trace_file: str | None, num_blocks: int = 12, budget: int = 8,
                **spec) -> LLMEngine:
    config = EngineConfig(ModelConfig(model="unused", max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
                          SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4),
                          spec.get("speculative_config"), observability_config=ObservabilityConfig(trace_file))
    return LLMEngine(config, runner=FakeRunner(vocab_size=VOCAB),
                     model_info=ModelInfo(vocab_size=VOCAB, max_position_embeddings=64,
                                          eos_token_ids=frozenset({0})), load_tokenizer=False)


def run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()


def test_off_by_default_adds_no_observer():
    engine = make_engine(None)
    assert engine.step_observers == []
    assert EngineConfig.from_kwargs("m", trace_file="x.jsonl").observability_config.trace_file == "x.jsonl"


def test_records_account_for_every_scheduled_token(tmp_path):
    path = tmp_path / "t.jsonl"
    engine = make_engine(str(path))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request("long", list(range(1, 20)), sp)  # 19 tokens, chunked at budget 8
    engine.add_request("short", [5, 6, 7], sp)
    run(engine)
    header, steps = read_trace(str(path))
    assert header is not None and header["num_blocks"] == 12 and header["max_num_batched_tokens"] == 8
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    for rec in steps:
        assert rec["v"] == SCHEMA_VERSION
        budget = rec["budget"]
        assert budget["used"] == sum(r["n"] for r in rec["reqs"]) == sum(budget[k] for k in KINDS)
        assert budget["used"] <= budget["max"] == 8
    first = steps[0]
    assert first["admitted"] == ["long"] and first["reqs"] == [
        {"id": "long", "n": 8, "start": 0, "prompt": 19, "kind": "prefill"}]
    kinds = {(r["id"], r["kind"]) for rec in steps for r in rec["reqs"]}
    assert kinds == {("long", "prefill"), ("long", "decode"), ("short", "prefill"), ("short", "decode")}
    finished = [f for rec in steps for f in rec["finished"]]
    assert sorted(f["id"] for f in finished) == ["long", "short"]
    assert all(f["reason"] == "length" for f in finished)
    assert sum(rec["tokens"]["generation"] for rec in steps) == 12
    assert "block_map" in steps[0]  # the first step always carries a snapshot
    bm = steps[0]["block_map"]
    assert bm["num_blocks"] == 12 and len(bm["ref_cnt"]) == 12 and bm["tables"]["long"] == [0, 1]
    assert "group_tables" not in bm and "sliding_windows" not in bm  # one KV cache group


def test_preemption_victim_needed_by_and_recompute(tmp_path):
    path = tmp_path / "t.jsonl"
    engine = make_engine(str(path), num_blocks=6, budget=32)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.add_request("a", list(range(1, 8)), sp)  # 7 + 10 tokens: 5 blocks at the end
    engine.add_request("b", list(range(11, 18)), sp)
    run(engine)
    _, steps = read_trace(str(path))
    preempted = [p for rec in steps for p in rec["preempted"]]
    assert preempted and preempted[0] == {"id": "b", "needed_by": "a"}
    resumed_at = next(rec for rec in steps if rec["resumed"])
    assert resumed_at["resumed"] == ["b"]
    assert [r["kind"] for r in resumed_at["reqs"] if r["id"] == "b"] == ["recompute"]
    assert sum(rec["budget"]["recompute"] for rec in steps) > 0


def test_drafts_are_counted_as_draft_tokens(tmp_path):
    path = tmp_path / "t.jsonl"
    engine = make_engine(str(path), num_blocks=40, budget=64,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    engine.add_request("r", [3, 4, 3, 4, 3, 4, 3, 4], SamplingParams(max_tokens=20, ignore_eos=True))
    run(engine)
    _, steps = read_trace(str(path))
    draft_reqs = [r for rec in steps for r in rec["reqs"] if r.get("drafts")]
    assert draft_reqs and all(r["kind"] == "draft" for r in draft_reqs)
    assert sum(rec["budget"]["draft"] for rec in steps) == sum(r["drafts"] for r in draft_reqs)
    assert sum(rec["spec"]["draft_tokens"] for rec in steps) == sum(r["drafts"] for r in draft_reqs)


def test_abort_is_reported_as_external_finish(tmp_path):
    path = tmp_path / "t.jsonl"
    engine = make_engine(str(path))
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.abort_request("x")
    engine.step()
    engine.shutdown()
    _, steps = read_trace(str(path))
    assert steps[-1]["finished"] == [{"id": "x", "reason": "external"}]


def test_chrome_conversion_tracks_and_cli(tmp_path):
    path, out = tmp_path / "t.jsonl", tmp_path / "chrome.json"
    engine = make_engine(str(path))
    engine.add_request("p", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    run(engine)
    _, steps = read_trace(str(path))
    events = to_chrome(steps)["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"steps", "p"}
    assert sum(1 for e in events if e["ph"] == "X" and e["name"].startswith("step ")) == len(steps)
    assert cli_main(["trace", "convert", str(path), "--chrome", str(out)]) == 0
    assert json.loads(out.read_text())["traceEvents"]


def prefill(kv: KVCacheManager, rid: str, prompt: list[int], chunk: int) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=4))
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
    return req


def test_block_map_covers_every_kv_cache_group():
    # Gemma-2-like: a full-attention group and a sliding window of 8 tokens (2 blocks of 4).
    kv = KVCacheManager(20, 4, False, sliding_windows=(None, 8), max_chunk_tokens=8)
    prefill(kv, "a", list(range(1, 25)), chunk=8)  # 24 tokens: the window slid past blocks 2, 3
    prefill(kv, "b", [7, 8, 9, 10, 11], chunk=8)
    kv.check_integrity()
    bm = json.loads(json.dumps(block_map(kv)))  # what a trace file holds
    N = NULL_BLOCK_ID
    assert bm["sliding_windows"] == [None, 8]
    # The window's blocks 2 and 3, given back when it slid past them (no hash: caching is
    # off), were the first handed out again, to a's full-attention group.
    assert bm["group_tables"] == {"a": [[0, 1, 4, 5, 2, 3], [N, N, 6, 7, 8, 9]],
                                  "b": [[10, 11], [12, 13]]}
    assert bm["tables"] == {"a": [0, 1, 4, 5, 2, 3, 6, 7, 8, 9], "b": [10, 11, 12, 13]}
    held = {b for b, ref in enumerate(bm["ref_cnt"]) if ref > 0}
    owned = {b for table in bm["tables"].values() for b in table}
    assert held == owned == set(range(14))


def test_block_map_of_one_window_group_keeps_its_null_slots_apart():
    # A model whose every layer has a 4-token window: one group, its table has null slots.
    kv = KVCacheManager(10, 4, False, sliding_windows=(4,), max_chunk_tokens=4)
    prefill(kv, "a", list(range(1, 13)), chunk=4)
    bm = block_map(kv)
    # block 0, given back when the window slid past it, holds the third chunk
    assert bm["group_tables"] == {"a": [[NULL_BLOCK_ID, 1, 0]]} and bm["sliding_windows"] == [4]
    assert bm["tables"] == {"a": [1, 0]}
    assert {b for b, ref in enumerate(bm["ref_cnt"]) if ref > 0} == {0, 1}
