"""The scenarios of ``pagedllm explain``: small, fixed workloads on the real Scheduler.

Numbers are tiny on purpose (block_size 4, a handful of blocks) so that every block id and every
token count can be checked by hand against the lessons' rules. Each scenario prints a setup, then
each step (replay.py), then what to take away; tests/explain/ keeps their output as goldens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table

from pagedllm.explain.replay import Replay, tokens
from pagedllm.explain.two_phase import two_phase_step


@dataclass(frozen=True)
class Scenario:
    title: str
    play: Callable[[Console], None]


def _intro(console: Console, title: str, text: str) -> None:
    console.rule(title, characters="=")
    console.print(text)


def lesson_exercise(console: Console) -> None:
    _intro(console, "lesson exercise: one step, two rules",
           "block_size 4, 2 free blocks. Running: A (length 8: 7 tokens in the cache, the 8th "
           "just sampled) and B (length 5). Waiting: C (length 20). What does the next step do, "
           "and why?")
    # nano-vllm's default budget (16384): the lesson's C is stopped by blocks, not by tokens.
    result = two_phase_step(4, 2, [("A", 8), ("B", 5)], [("C", 20)], max_num_batched_tokens=16384)
    t = Table(box=box.SIMPLE_HEAD, title="nano-vllm: two phases (prefill OR decode)",
              title_justify="left", pad_edge=False)
    t.add_column("#", justify="right")
    t.add_column("reasoning")
    for i, reason in enumerate(result.reasons, 1):
        t.add_row(str(i), reason)
    console.print(t)
    console.print(f"nano-vllm answer: a {result.phase} step of [{', '.join(result.scheduled)}]; "
                  f"{result.free_blocks_after} block left free; C is not even considered for a "
                  "chunk.")
    console.print()
    console.print("pagedllm: one rule (running first, then waiting, in one mixed batch), computed "
                  "by the real Scheduler. Cache of 5 blocks, budget 16 tokens; the setup step "
                  "prefills A's 7 and B's 4 prompt tokens and each samples one token, which "
                  "leaves exactly the exercise's state.")
    r = Replay(console, num_blocks=5, max_num_batched_tokens=16)
    r.add("A", tokens(100, 7), max_tokens=5)
    r.add("B", tokens(200, 4), max_tokens=5)
    r.step("setup: reach the exercise's state")
    r.add("C", tokens(300, 20), max_tokens=1)
    r.step("the exercise's step: C has just arrived")
    console.print("pagedllm answer: A and B decode (B takes 1 of the 2 free blocks); C is "
                  "considered in the same step, but the chunk the budget allows (14 tokens, 4 "
                  "blocks) does not fit the 1 free block, so it waits, and a waiting request "
                  "never preempts anyone. Same batch as nano-vllm here, for a different reason.")
    console.print()
    console.print("What if one request's share of a step is capped (long_prefill_token_threshold"
                  "=4)? Then C's chunk is 4 tokens, one block: it fits, and the step mixes two "
                  "decodes with C's first prefill chunk, which nano-vllm's two phases cannot do.")
    r = Replay(console, num_blocks=5, max_num_batched_tokens=16, long_prefill_token_threshold=4)
    r.add("A", tokens(100, 7), max_tokens=5)
    r.step("setup: A's first chunk of 4", show=False)
    r.add("B", tokens(200, 4), max_tokens=5)
    r.step("setup: A's last 3 prompt tokens, B's 4: the exercise's state again", show=False)
    r.add("C", tokens(300, 20), max_tokens=1)
    r.step("the exercise's step with long_prefill_token_threshold=4 (setup steps not shown)")


def chunked_prefill(console: Console) -> None:
    _intro(console, "chunked prefill: a long prompt beside decodes",
           "Budget 8 tokens per step, 16 blocks. A and B are decoding when L (a 22-token prompt) "
           "arrives. Running requests go first (1 token each), and L takes the rest of the "
           "budget as a prefill chunk each step until its prompt is in; decodes never stall.")
    r = Replay(console, num_blocks=16, max_num_batched_tokens=8)
    r.add("A", tokens(100, 3), max_tokens=8)
    r.add("B", tokens(200, 3), max_tokens=8)
    r.step("A and B prefill")
    r.add("L", tokens(300, 22), max_tokens=2)
    r.run({2: "L arrives: 2 tokens go to decodes, 6 to L's first chunk"})


def prefix_cache(console: Console) -> None:
    _intro(console, "prefix cache: a shared system prompt",
           "Three requests start with the same 8-token system prompt (2 full blocks of 4). S1 "
           "computes it; its full blocks are published under their chained hashes as soon as "
           "they are allocated. S2 and S3 arrive later and hit them: those tokens are not "
           "computed again, and the blocks are shared (ref count > 1).")
    system = tokens(500, 8)
    r = Replay(console, num_blocks=12, max_num_batched_tokens=32)
    r.add("S1", system + tokens(600, 3), max_tokens=3)
    r.step("S1 computes the system prompt and its own question")
    r.add("S2", system + tokens(700, 2), max_tokens=2)
    r.add("S3", system + tokens(800, 5), max_tokens=2)
    r.run({2: "S2 and S3 arrive with the same system prompt"})
    r.show_blocks("after the last step")
    console.print("After the last step the system prompt's blocks are free but still cached "
                  "(marked c): a fourth request would hit them until they are evicted (LRU).")


def preemption(console: Console) -> None:
    _intro(console, "preemption and recompute",
           "7 blocks of 4 tokens. A and B (7-token prompts, 10 tokens each to generate) both fit "
           "at first, but as they grow the cache runs out. When a running request needs a block "
           "and none is free, the most recently admitted running request is preempted (here B, "
           "which needed the block itself): it frees its blocks, goes to the head of the waiting "
           "queue, and later recomputes what it had (its full blocks may still hit the prefix "
           "cache).")
    r = Replay(console, num_blocks=7, max_num_batched_tokens=32)
    r.add("A", tokens(100, 7), max_tokens=10)
    r.add("B", tokens(200, 7), max_tokens=10)
    r.run()


def parallel_sampling(console: Console) -> None:
    _intro(console, "parallel sampling: n = 3 with copy-on-write",
           "One request P with n = 3 (a 6-token prompt: one full block and a partial one). The "
           "first sample (0_P) prefills the prompt once. When it has sampled, samples 1_P and "
           "2_P fork from it: they share every prompt block, the partial one included, and "
           "recompute only the last prompt token. The first write into the shared partial block "
           "copies it (copy-on-write), so each sample gets its own copy.")
    r = Replay(console, num_blocks=12, max_num_batched_tokens=32)
    r.add("P", tokens(100, 6), max_tokens=4, n=3)
    r.run({1: "0_P prefills the prompt; the other samples exist only above the scheduler",
           2: "1_P and 2_P forked from 0_P after its first token"})


def skip_ahead(console: Console) -> None:
    _intro(console, "skip-ahead past a head-of-line request",
           "10 blocks, max_skip_ahead 2. R runs and holds most of the cache; H waits at the head "
           "of the queue and needs more blocks than are free. Short requests behind H (X, Y, Z) "
           "may be admitted past it, but only twice: then admission waits for H, so H is not "
           "starved; and H never preempts R.")
    r = Replay(console, num_blocks=10, max_num_batched_tokens=64, max_skip_ahead=2)
    r.add("R", tokens(100, 22), max_tokens=4)
    r.step("R prefills and holds 6 of the 10 blocks")
    r.add("H", tokens(200, 20), max_tokens=2)
    r.add("X", tokens(300, 2), max_tokens=2)
    r.add("Y", tokens(400, 2), max_tokens=2)
    r.add("Z", tokens(500, 2), max_tokens=2)
    r.run({2: "H needs 5 blocks, 3 are free: X and Y are admitted past it (the bound is 2), "
              "Z waits behind H",
           3: "H has been passed twice (max_skip_ahead 2): Z is not tried past it, although it "
              "would fit; admission waits for H"})


SCENARIOS: dict[str, Scenario] = {
    "lesson-exercise": Scenario("the scheduling lesson's exercise, in nano-vllm's rule and ours",
                                lesson_exercise),
    "chunked-prefill": Scenario("a long prompt chunked beside decodes", chunked_prefill),
    "prefix-cache": Scenario("a shared system prompt hitting the prefix cache", prefix_cache),
    "preemption": Scenario("a preemption and its recompute", preemption),
    "parallel-sampling": Scenario("n = 3 with copy-on-write", parallel_sampling),
    "skip-ahead": Scenario("skip-ahead past a head-of-line request", skip_ahead),
}


def run_scenario(name: str, console: Console) -> None:
    SCENARIOS[name].play(console)
