"""The dashboard's feed when the engine core runs in another process: it tails the core's
--trace-file, with exact totals and sampled records."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from pagedllm.entrypoints.openai.trace_file_feed import TraceFileFeed


def _record(step: int, gen: int, finished: list | None = None, with_map: bool = False) -> dict:
    rec = {"v": 1, "step": step, "t": 0.0, "ms": {"schedule": 0, "execute": 0, "update": 0},
           "budget": {"max": 8, "used": gen, "prefill": 0, "decode": gen, "draft": 0, "recompute": 0},
           "reqs": [], "admitted": [], "resumed": [], "skipped": [], "preempted": [],
           "finished": finished or [], "cached_tokens": {}, "queues": {"running": 1, "waiting": 0},
           "kv_usage": 0.5, "tokens": {"prompt": 0, "generation": gen},
           "prefix_cache": {"queries": 4, "hits": 2}, "spec": {}, "blocks": {"copies": []}}
    if with_map:
        rec["block_map"] = {"num_blocks": 4, "block_size": 4, "ref_cnt": [1, 0, 0, 0],
                            "tables": {"a": [0]}, "cached_free": []}
    return rec


def test_tail_counts_every_line_and_streams_new_ones(tmp_path):
    path = tmp_path / "t.jsonl"
    header = {"v": 1, "header": True, "max_num_batched_tokens": 8, "num_blocks": 4, "block_size": 4}
    lines = [header, _record(1, 3, with_map=True), _record(2, 1, [{"id": "a", "reason": "length"}]),
             _record(3, 1, [{"id": "b", "reason": "external"}])]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    feed = TraceFileFeed(SimpleNamespace(errored=False), str(path))

    async def scenario() -> tuple[dict, dict]:
        stream = feed.stream()
        hello = json.loads((await stream.__anext__()).split("data: ", 1)[1])
        with open(path, "a") as f:  # the core appends a step, the second half of a line later
            line = json.dumps(_record(4, 2))
            f.write(line[:20])
            f.flush()
            await asyncio.sleep(0.25)
            f.write(line[20:] + "\n")
        event = await asyncio.wait_for(stream.__anext__(), 5)
        await stream.aclose()
        return hello, json.loads(event.split("data: ", 1)[1])

    hello, step = asyncio.run(scenario())
    assert hello["num_blocks"] == 4 and hello["block_map"]["tables"] == {"a": [0]}
    assert hello["totals"]["generation_tokens"] == 5 and hello["totals"]["finished"] == 1
    assert hello["totals"]["prefix_hits"] == 6 and hello["totals"]["steps"] == 3
    assert step["step"] == 4 and step["totals"]["generation_tokens"] == 7
