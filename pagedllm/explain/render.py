"""Render step-trace records (docs/trace_schema.md) as rich tables and plain sentences.

Everything shown comes from the record itself (plus, for a live scenario, the queues read from
the scheduler), so ``--from-trace`` and the shipped scenarios share one renderer. No colour and
a fixed width when asked: the scenario goldens compare this text byte for byte.
"""
from __future__ import annotations

from typing import IO, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

Record = dict[str, Any]
_KIND_WORDS = {"prefill": "prefill", "decode": "decode", "draft": "decode + verify drafts",
               "recompute": "recompute after preemption"}


def make_console(width: int | None = None, file: IO[str] | None = None) -> Console:
    """A plain console: no colour, no emoji, no highlighting (stable goldens)."""
    return Console(width=width, file=file, color_system=None, force_terminal=False,
                   highlight=False, emoji=False, markup=False, soft_wrap=False)


def explain_record(rec: Record) -> list[str]:
    """What happened in the step, and why, one sentence per event."""
    lines: list[str] = []
    cached = rec.get("cached_tokens", {})
    for rid in rec["admitted"]:
        hit = cached.get(rid, 0)
        why = (f"; prefix cache hit: its first {hit} tokens are already in the cache and are not "
               "computed again") if hit else ""
        lines.append(f"{rid} admitted (sent to the runner whole){why}.")
    for rid in rec["resumed"]:
        lines.append(f"{rid} resumed after preemption: its tokens so far are computed again "
                     "(recompute); full blocks still in the prefix cache are reused.")
    for r in rec["reqs"]:
        lines.append(_req_sentence(r))
    for p in rec["preempted"]:
        who = ("it needed a block itself, none was free, and it is the most recently admitted "
               "running request" if p["needed_by"] == p["id"] else
               f"{p['needed_by']} is running and needed a block, none was free")
        lines.append(f"{p['id']} preempted: {who}; {p['id']} gives all its blocks back and goes "
                     "to the head of the waiting queue (it recomputes later).")
    if rec["preempted"]:
        lines.append("This step preempted, so no waiting request is admitted (memory is tight).")
    for rid in rec["skipped"]:
        lines.append(f"{rid} waits: it needs more free blocks than there are; requests behind it "
                     "may be admitted past it (bounded skip-ahead), and it never preempts anyone.")
    for src, dst in rec["blocks"].get("copies", []):
        lines.append(f"copy-on-write: block {src} is shared and is about to be written, so it is "
                     f"copied into block {dst} first.")
    for f in rec["finished"]:
        lines.append(f"{f['id']} finished ({f['reason']}); its blocks are freed (full ones stay "
                     "in the prefix cache until reused).")
    budget = rec["budget"]
    if budget["used"] >= budget["max"]:
        lines.append(f"The token budget is spent: {budget['used']} of {budget['max']}.")
    return lines


def _req_sentence(r: Record) -> str:
    rid, n, start, kind = r["id"], r["n"], r["start"], r["kind"]
    if kind == "prefill":
        prompt = r.get("prompt", 0)
        end = start + n
        if prompt and end < prompt:
            return (f"{rid}: prefill chunk, prompt tokens {start}..{end - 1} of {prompt} (the rest "
                    "in later steps; a partial prefill samples nothing).")
        return f"{rid}: prefill of prompt tokens {start}..{end - 1}, then samples its first token."
    if kind == "recompute":
        hit = f"; tokens 0..{start - 1} were still in the prefix cache" if start else ""
        return f"{rid}: recompute tokens {start}..{start + n - 1} (lost when it was preempted){hit}."
    if kind == "draft":
        return f"{rid}: decode 1 token and verify {r.get('drafts', 0)} draft tokens in the same pass."
    return f"{rid}: decode 1 token (position {start})."


def budget_bar(rec: Record, width: int = 24) -> Text:
    """The budget as a bar: P prefill, D decode, d drafts, R recompute, . unused."""
    b = rec["budget"]
    scale = width / max(b["max"], 1)
    text = Text()
    used_chars = 0
    for kind, ch in (("prefill", "P"), ("decode", "D"), ("draft", "d"), ("recompute", "R")):
        num = max(round(b[kind] * scale), 1) if b[kind] else 0  # a nonzero share stays visible
        text.append(ch * num)
        used_chars += num
    text.append("." * max(width - used_chars, 0))
    return text


def _scheduled_table(rec: Record) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title="scheduled this step", title_justify="left", pad_edge=False)
    for col, justify in (("request", "left"), ("why", "left"), ("tokens", "right"),
                         ("positions", "right"), ("prompt", "right")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rec["reqs"]:
        end = r["start"] + r["n"] - 1
        t.add_row(r["id"], _KIND_WORDS[r["kind"]], str(r["n"]), f"{r['start']}..{end}",
                  str(r.get("prompt", "")))
    if not rec["reqs"]:
        t.add_row("(none)", "", "", "", "")
    return t


def _blocks_table(bm: Record) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title="block tables", title_justify="left", pad_edge=False)
    t.add_column("request")
    refs = bm["ref_cnt"]

    def cells(table: list[int]) -> str:
        # -1: a sliding-window group's null block (a slot that left the window).
        return " ".join("_" if b < 0 else f"{b}*{refs[b]}" if refs[b] > 1 else str(b)
                        for b in table) or "-"

    group_tables = bm.get("group_tables")
    if group_tables is None:  # one KV cache group: its table is everything the request holds
        t.add_column("blocks")
        for rid, table in bm["tables"].items():
            t.add_row(rid, cells(table))
        free_row = ["(free)"]
    else:  # one row per group (full attention, or a sliding window of w tokens)
        t.add_column("group")
        t.add_column("blocks")
        names = ["full" if w is None else f"window {w}" for w in bm["sliding_windows"]]
        for rid, tables in group_tables.items():
            for g, table in enumerate(tables):
                t.add_row(rid if g == 0 else "", names[g], cells(table))
        free_row = ["(free)", ""]
    free = [i for i, r in enumerate(refs) if r == 0]
    cached = set(bm["cached_free"])
    t.add_row(*free_row, " ".join(f"{b}c" if b in cached else str(b) for b in free) or "-")
    return t


def block_symbols(bm: Record, memo: dict[str, str]) -> dict[str, str]:
    """One character per request for the block map: its id when that is one character, else
    the next free letter; ``memo`` keeps the choice for the rest of a replay."""
    for rid in bm["tables"]:
        if rid in memo:
            continue
        if len(rid) == 1:
            memo[rid] = rid
            continue
        used = set(memo.values())
        memo[rid] = next(c for c in "abcdefghijklmnopqrstuvwxyz0123456789?" if c not in used or c == "?")
    return {rid: memo[rid] for rid in bm["tables"]}


def block_grid(bm: Record, symbols: dict[str, str]) -> str:
    """One character per block: its owner's symbol, + when shared, c cached-free, . free."""
    owner: dict[int, str] = {}
    for rid, table in bm["tables"].items():
        for b in table:
            owner.setdefault(b, symbols.get(rid, "?"))
    cached = set(bm["cached_free"])
    cells = []
    for b, ref in enumerate(bm["ref_cnt"]):
        if ref > 1:
            cells.append("+")
        elif ref == 1:
            cells.append(owner.get(b, "?"))
        else:
            cells.append("c" if b in cached else ".")
    return "".join(cells)


def render_blocks(console: Console, bm: Record, memo: dict[str, str] | None = None) -> None:
    """The block tables and a one-line map of the whole cache."""
    console.print(_blocks_table(bm))
    symbols = block_symbols(bm, {} if memo is None else memo)
    used = sum(1 for r in bm["ref_cnt"] if r > 0)
    legend = ", ".join(f"{sym}={rid}" for rid, sym in symbols.items() if sym != rid)
    console.print(f"block map [{block_grid(bm, symbols)}]  {used} of {bm['num_blocks']} blocks "
                  f"in use{'  (' + legend + ')' if legend else ''}")
    if bm["cached_free"] or any(r > 1 for r in bm["ref_cnt"]):
        console.print("(b*r: block b in r block tables, + in the map; bc, c: free, still cached)")
    if "group_tables" in bm:
        console.print("(_: a slot that left the sliding window, its block given back)")


def is_plain(rec: Record) -> bool:
    """Only decodes, nothing admitted, preempted, skipped, finished or copied: a step that a
    replay can show in one line."""
    return (all(r["kind"] == "decode" for r in rec["reqs"]) and not rec["blocks"]["copies"]
            and not any(rec[k] for k in ("admitted", "resumed", "skipped", "preempted", "finished")))


def render_plain_step(console: Console, rec: Record) -> None:
    ids = ", ".join(r["id"] for r in rec["reqs"])
    console.rule(f"step {rec['step']}", characters="-")
    console.print(f"decode {ids} (1 token each); nothing else happened; KV usage "
                  f"{rec['kv_usage']:.0%}")


def render_step(console: Console, rec: Record, note: str | None = None,
                queues: tuple[dict[str, list[str]], dict[str, list[str]]] | None = None,
                show_times: bool = False, symbols: dict[str, str] | None = None) -> None:
    console.rule(f"step {rec['step']}", characters="-")
    if note:
        console.print(note)
    if queues is not None:
        before, after = queues
        console.print(f"queues before: running [{', '.join(before['running'])}]  "
                      f"waiting [{', '.join(before['waiting'])}]")
        console.print(f"queues after:  running [{', '.join(after['running'])}]  "
                      f"waiting [{', '.join(after['waiting'])}]")
    else:
        q = rec["queues"]
        console.print(f"queues after: {q['running']} running, {q['waiting']} waiting")
    b = rec["budget"]
    line = Text(f"budget {b['used']}/{b['max']} [")
    line.append_text(budget_bar(rec))
    line.append(f"] prefill {b['prefill']}, decode {b['decode']}, drafts {b['draft']}, "
                f"recompute {b['recompute']}")
    console.print(line)
    if show_times:
        ms = rec["ms"]
        console.print(f"time: schedule {ms['schedule']} ms, execute {ms['execute']} ms, "
                      f"update {ms['update']} ms")
    console.print(_scheduled_table(rec))
    bm = rec.get("block_map")
    if bm is not None:
        render_blocks(console, bm, symbols)
    console.print(f"KV usage after the step {rec['kv_usage']:.0%}")
    for sentence in explain_record(rec):
        console.print(f"- {sentence}")


def render_trace(console: Console, header: Record | None, steps: list[Record], title: str) -> None:
    console.rule(f"trace {title}")
    if header:
        console.print(f"budget {header['max_num_batched_tokens']} tokens/step, "
                      f"{header['num_blocks']} KV blocks of {header['block_size']} tokens")
    symbols: dict[str, str] = {}
    for rec in steps:
        render_step(console, rec, show_times=True, symbols=symbols)
