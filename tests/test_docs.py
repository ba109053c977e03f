"""The README and docs/ stay true where a test can tell: every relative link points at a file
that exists, and every CLI flag they show exists in the CLI's --help.

Flags are read from fenced command lines (``pagedllm SUBCOMMAND ...``, checked against that
subcommand's --help) and from inline code in the prose of the pages about pagedllm's own
commands (checked against ``pagedllm serve --help``, whose engine flags are generate's too),
except spans quoting a benchmark's command line (its own options).
docs/benchmarks.md and its log quote the benchmarks' own flags, as they were run: only their links
count. The README's tables stay a front page: short cells, one date at most a row."""
from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG_PAGES = [p for p in PAGES if p.name not in ("benchmarks.md", "benchmarks_log.md", "trace_schema.md")]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")
COMMAND = re.compile(r"pagedllm (serve|generate|explain|trace convert)\b(.*)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
MAX_CELL_CHARS = 160  # a front-page cell holds one figure; runs and their history go to docs/


@cache
def help_flags(command: str) -> frozenset[str]:
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *command.split(), "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return frozenset(FLAG.findall(out))


def _norm(flag: str) -> str:
    return flag.replace("_", "-")  # every flag takes dashes or underscores (vLLM's spellings)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files(page):
    text = page.read_text()
    links = [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]
    missing = [link for link in links if not (page.parent / link.split("#")[0]).exists()]
    assert not missing, f"{page.name}: {missing}"
    if page.name == "README.md":
        assert len(links) >= 8  # the Docs list and the picture: the check saw them


def _fenced_commands(text: str) -> list[tuple[str, str]]:
    found = []
    for block in FENCE.findall(text):
        for line in block.splitlines():
            line = line.split("#", 1)[0]  # a comment may name another tool's flags
            m = COMMAND.search(line)
            if m:
                found.append((m.group(1), m.group(2)))
    return found


@pytest.mark.parametrize("page", FLAG_PAGES, ids=lambda p: p.name)
def test_flags_shown_exist_in_the_cli(page):
    text = page.read_text()
    bad = []
    for command, args in _fenced_commands(text):
        known = {_norm(f) for f in help_flags(command)}
        bad += [(command, f) for f in FLAG.findall(args) if _norm(f) not in known]
    serve = {_norm(f) for f in help_flags("serve")}
    prose = FENCE.sub("", text)
    if page.name == "README.md":  # its benchmark table quotes the benchmarks' own flags
        prose = prose.split("## Benchmarks", 1)[0]
    for span in re.findall(r"`([^`]+)`", prose):
        if "bench" in span:  # a benchmark's command line: its own options, not the CLI's
            continue
        bad += [("serve", f) for f in FLAG.findall(span) if _norm(f) not in serve]
    assert not bad, f"{page.name}: flags not in --help: {bad}"


def test_the_flag_check_can_fail():
    assert _fenced_commands("```\npagedllm serve --no-such-flag\n```\n") == [("serve", " --no-such-flag")]
    assert "--no-such-flag" not in help_flags("serve")
    assert "--max-seqs-per-request" in help_flags("serve")


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row outside fenced blocks, separator rows left out."""
    rows = []
    for line in FENCE.sub("", text).splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip("|"))]
        if not all(re.fullmatch(r":?-+:?", c) for c in cells):
            rows.append(cells)
    return rows


def table_problems(text: str) -> list[str]:
    problems = []
    for cells in _table_rows(text):
        problems += [f"cell of {len(c)} chars: {c[:60]}..." for c in cells if len(c) > MAX_CELL_CHARS]
        dates = DATE.findall(" ".join(cells))
        if len(dates) > 1:
            problems.append(f"row with {len(dates)} dates: {cells[0][:60]}")
    return problems


def test_readme_tables_stay_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(_table_rows(text)) >= 10  # the benchmark table was seen
    assert not table_problems(text)


def test_the_table_check_can_fail():
    long_cell = "decode 1.2x " * 20
    bad = ("| benchmark | result |\n|---|---|\n"
           f"| gguf | {long_cell} |\n"
           "| throughput, 2026-12-01 | 1.1x; was 0.9x on 2026-11-30 |\n"
           "| `a | b` | short |\n")
    problems = table_problems(bad)
    assert len(problems) == 2 and "cell of" in problems[0] and "2 dates" in problems[1]
    assert _table_rows(bad)[3] == ["`a | b`", "short"]  # a pipe inside code does not split a cell
    assert table_problems("```\n| " + long_cell + " |\n```\n") == []  # a fenced block is not a table
