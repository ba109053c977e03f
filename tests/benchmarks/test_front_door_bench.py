"""benchmarks/front_door.py run tiny on the demo model: each printed figure parses, each ratio and
difference is the one its printed figures give, and every load/unload cycle ran. Speed is not checked."""
from __future__ import annotations

import json
import re

from pagedllm.config import default_model

_NUM = r"(-?[\d.]+)"
_SWITCH = re.compile(rf"front_door switch \(medians of 2 rounds\): single-model cold start {_NUM} s, model switch "
                     rf"{_NUM} s; switch/cold {_NUM} \(target <= 1.5\)")
_CYCLES = re.compile(rf"front_door cycles: (\d+) load/unload cycles completed; RSS after the first {_NUM} MiB, "
                     rf"after the last {_NUM} MiB, largest {_NUM} MiB; last/first {_NUM} \(target <= 1.05\); a cycle's "
                     rf"median load and answer {_NUM} s, unload {_NUM} s")
_ROUTES = re.compile(rf"front_door routes \(medians of 3 requests each, output tokens \[3\]\): chat direct {_NUM} ms, "
                     rf"chat via the router {_NUM} ms \(([+-][\d.]+) ms\), messages {_NUM} ms \(([+-][\d.]+) ms over "
                     rf"chat\), responses {_NUM} ms \(([+-][\d.]+) ms over chat\) \(target <= 1 ms each\)")


def _ratio_from_printed(ratio: float, num: float, den: float, half_unit: float) -> None:
    """``ratio`` (3 decimals) is num / den within what rounding the printed figures allows."""
    lo, hi = (num - half_unit) / (den + half_unit), (num + half_unit) / (den - half_unit)
    assert lo - 5e-4 <= ratio <= hi + 5e-4, (ratio, num, den)


def test_front_door_prints_each_target_beside_its_peer(tmp_path, capsys):
    from benchmarks import front_door

    out = tmp_path / "door.json"
    front_door.main(["--model", default_model(), "--rounds", "2", "--cycles", "3", "--requests", "3",
                     "--max-tokens", "3", "--json", str(out), "--engine-arg", "enforce_eager=true",
                     "--engine-arg", "kv_cache_memory_bytes=4194304", "--engine-arg", "max_num_seqs=4"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3, lines
    result = json.loads(out.read_text())

    cold, switch, ratio = map(float, _SWITCH.fullmatch(lines[0]).groups())
    assert 0 < cold and 0 < switch
    _ratio_from_printed(ratio, switch, cold, 5e-4)
    assert len(result["switch"]["cold_s"]) == len(result["switch"]["switch_s"]) == 2
    assert result["switch"]["num_switches"] == 2  # each switch unloaded the other model

    cycles, first, last, largest, rss_ratio, load, unload = _CYCLES.fullmatch(lines[1]).groups()
    assert float(load) > 0 and float(unload) > 0
    first, last, largest = float(first), float(last), float(largest)
    assert int(cycles) == 3 and result["cycles"]["num_loads"] == 3 and len(result["cycles"]["rss_bytes"]) == 3
    assert 0 < first <= largest and last <= largest
    _ratio_from_printed(float(rss_ratio), last, first, 0.05)

    direct, chat, router_cost, messages, messages_cost, responses, responses_cost = map(
        float, _ROUTES.fullmatch(lines[2]).groups())
    for cost, route, peer in ((router_cost, chat, direct), (messages_cost, messages, chat),
                              (responses_cost, responses, chat)):
        assert abs(cost - (route - peer)) <= 0.0015, (cost, route, peer)
    times = result["routes"]["times_s"]
    assert sorted(times) == ["chat", "chat_direct", "messages", "responses"]
    assert all(len(v) == 3 for v in times.values())
    # Every route generated the same answer length, so their times compare.
    assert all(v == [3] for v in result["routes"]["output_tokens"].values())
