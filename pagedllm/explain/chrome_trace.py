"""Step trace -> Chrome trace-event JSON (opens in Perfetto and chrome://tracing).

Track layout: process 1 "engine" has one track of steps (a slice per step, split into schedule /
execute / update); process 2 "requests" has one track per request, with a slice for every step
that scheduled it (named by why: prefill, decode, draft, recompute) and instant markers for its
admission, preemption, skip and finish. Counters carry the queues and KV usage.
"""
from __future__ import annotations

import json
from typing import Any

_ENGINE, _REQUESTS = 1, 2


def _us(seconds: float, origin: float) -> float:
    return round((seconds - origin) * 1e6, 1)


def to_chrome(steps: list[dict[str, Any]]) -> dict[str, Any]:
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": _ENGINE, "name": "process_name", "args": {"name": "engine"}},
        {"ph": "M", "pid": _ENGINE, "tid": 0, "name": "thread_name", "args": {"name": "steps"}},
        {"ph": "M", "pid": _REQUESTS, "name": "process_name", "args": {"name": "requests"}},
    ]
    if not steps:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    tids: dict[str, int] = {}

    def tid(rid: str) -> int:
        if rid not in tids:
            tids[rid] = len(tids) + 1
            events.append({"ph": "M", "pid": _REQUESTS, "tid": tids[rid], "name": "thread_name",
                           "args": {"name": rid}})
        return tids[rid]

    def first_start(rec: dict[str, Any]) -> float:
        return rec["t"] - sum(rec["ms"].values()) / 1000.0

    origin = first_start(steps[0])
    for rec in steps:
        ms = rec["ms"]
        start = first_start(rec)
        total_us = round(sum(ms.values()) * 1000.0, 1)
        ts = _us(start, origin)
        events.append({"ph": "X", "pid": _ENGINE, "tid": 0, "ts": ts, "dur": total_us,
                       "name": f"step {rec['step']}",
                       "args": {"budget": rec["budget"], "queues": rec["queues"]}})
        offset = ts
        for phase in ("schedule", "execute", "update"):
            dur = round(ms[phase] * 1000.0, 1)
            events.append({"ph": "X", "pid": _ENGINE, "tid": 0, "ts": offset, "dur": dur, "name": phase})
            offset += dur
        for req in rec["reqs"]:
            events.append({"ph": "X", "pid": _REQUESTS, "tid": tid(req["id"]), "ts": ts, "dur": total_us,
                           "name": req["kind"], "args": {"tokens": req["n"], "start": req["start"],
                                                         "step": rec["step"]}})
        marks = ([(rid, "admitted", {}) for rid in rec["admitted"]]
                 + [(rid, "resumed", {}) for rid in rec["resumed"]]
                 + [(rid, "skipped", {}) for rid in rec["skipped"]]
                 + [(p["id"], "preempted", {"needed_by": p["needed_by"]}) for p in rec["preempted"]]
                 + [(f["id"], "finished", {"reason": f["reason"]}) for f in rec["finished"]])
        for rid, name, args in marks:
            events.append({"ph": "i", "s": "t", "pid": _REQUESTS, "tid": tid(rid), "ts": ts,
                           "name": name, "args": args})
        events.append({"ph": "C", "pid": _ENGINE, "ts": ts, "name": "queues", "args": rec["queues"]})
        events.append({"ph": "C", "pid": _ENGINE, "ts": ts, "name": "kv_usage",
                       "args": {"kv_usage": rec["kv_usage"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(steps: list[dict[str, Any]], out_path: str) -> int:
    """Write the converted trace; returns the number of events."""
    data = to_chrome(steps)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return len(data["traceEvents"])
