"""``pagedllm explain``: every shipped scenario's output is a golden text file, and the answers
the lessons teach are checked in the replay's own records.

Regenerate the goldens after an intended change with ``PAGEDLLM_UPDATE_GOLDENS=1 pytest
tests/explain`` and read the diff."""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from pagedllm import SamplingParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.explain.render import make_console, render_blocks
from pagedllm.explain.replay import Replay, tokens
from pagedllm.explain.scenarios import SCENARIOS, run_scenario
from pagedllm.explain.two_phase import two_phase_step
from pagedllm.runner.fake import FakeRunner

GOLDENS = Path(__file__).parent / "goldens"
WIDTH = 100


def render(name: str) -> str:
    buf = io.StringIO()
    run_scenario(name, make_console(width=WIDTH, file=buf))
    # Trailing blanks are rich's padding: not part of what the golden means.
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario_matches_golden(name):
    got = render(name)
    path = GOLDENS / f"{name}.txt"
    if os.environ.get("PAGEDLLM_UPDATE_GOLDENS"):
        path.write_text(got)
    assert path.is_file(), f"no golden {path}; run with PAGEDLLM_UPDATE_GOLDENS=1"
    assert got == path.read_text(), f"{name} differs from {path} (PAGEDLLM_UPDATE_GOLDENS=1 rewrites it)"


def test_cli_prints_the_same_as_the_golden(capsys):
    assert cli_main(["explain", "lesson-exercise", "--width", str(WIDTH)]) == 0
    out = "\n".join(line.rstrip() for line in capsys.readouterr().out.splitlines()) + "\n"
    assert out == (GOLDENS / "lesson-exercise.txt").read_text()


def test_two_phase_model_gives_the_lessons_answer():
    r = two_phase_step(4, 2, [("A", 8), ("B", 5)], [("C", 20)], max_num_batched_tokens=16384)
    assert (r.phase, r.scheduled, r.preempted, r.free_blocks_after) == ("decode", ["A", "B"], [], 1)
    # With room for C, the step is prefill only and the running sequences wait.
    r = two_phase_step(4, 6, [("A", 8), ("B", 5)], [("C", 20)], max_num_batched_tokens=16384)
    assert (r.phase, r.scheduled) == ("prefill", ["C"])


def test_one_rule_on_the_exercise_state():
    r = Replay(make_console(width=WIDTH, file=io.StringIO()), num_blocks=5, max_num_batched_tokens=16)
    r.add("A", tokens(100, 7), max_tokens=5)
    r.add("B", tokens(200, 4), max_tokens=5)
    r.step(show=False)
    r.add("C", tokens(300, 20), max_tokens=1)
    rec = r.step(show=False)
    assert [(q["id"], q["kind"], q["n"]) for q in rec["reqs"]] == [("A", "decode", 1), ("B", "decode", 1)]
    assert rec["skipped"] == ["C"]
    assert rec["block_map"]["tables"] == {"A": [0, 1], "B": [2, 3]}


def test_unknown_scenario_is_one_line_error(capsys):
    assert cli_main(["explain", "no-such-thing"]) == 2
    assert "unknown scenario" in capsys.readouterr().err


def test_from_trace_renders_every_step(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    config = EngineConfig(ModelConfig(model="unused", max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks_override=12),
                          SchedulerConfig(max_num_batched_tokens=8),
                          observability_config=ObservabilityConfig(str(path)))
    engine = LLMEngine(config, runner=FakeRunner(vocab_size=50), load_tokenizer=False,
                       model_info=ModelInfo(vocab_size=50, max_position_embeddings=64,
                                            eos_token_ids=frozenset({0})))
    engine.add_request("a", list(range(1, 12)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    assert cli_main(["explain", "--from-trace", str(path), "--width", str(WIDTH)]) == 0
    out = capsys.readouterr().out
    assert "step 1" in out and "a: prefill chunk, prompt tokens 0..7 of 11" in out
    assert "a finished (length)" in out


def test_block_tables_show_each_kv_cache_group():
    # A two-group block map (docs/trace_schema.md): one row per group, null slots as "_".
    bm = {"num_blocks": 8, "block_size": 4, "ref_cnt": [1, 1, 0, 0, 1, 1, 1, 0],
          "tables": {"a": [0, 1, 4, 5, 6]}, "cached_free": [2],
          "group_tables": {"a": [[0, 1, 4], [-1, 5, 6]]}, "sliding_windows": [None, 8]}
    buf = io.StringIO()
    render_blocks(make_console(width=WIDTH, file=buf), bm)
    rows = [line.split() for line in buf.getvalue().splitlines()]
    assert ["a", "full", "0", "1", "4"] in rows
    assert ["window", "8", "_", "5", "6"] in rows
    assert ["(free)", "2c", "3", "7"] in rows
    assert any(line.startswith("block map [aac.aaa.]") for line in buf.getvalue().splitlines())
