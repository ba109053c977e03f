"""The README and docs/ stay true where a test can tell: every relative link points at a file
that exists, and every CLI flag they show exists in the CLI's --help.

Flags are read from fenced command lines (``pagedllm SUBCOMMAND ...``, checked against that
subcommand's --help) and from inline code in the prose of the pages about pagedllm's own
commands (checked against ``pagedllm serve --help``, whose engine flags are generate's too),
except spans quoting a benchmark's command line (its own options).
docs/benchmarks.md and its log quote the benchmarks' own flags, as they were run: only their links
count. The README's tables stay a front page: short cells, one date at most a row."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
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


# A comment narrating a measurement: a speedup, a rate, a share, a time or a date. Figures live in
# docs/ (docs/cpu_kernels.md#the-measurements-behind-the-kernels-choices); a comment keeps the
# decision, its reason and a pointer there.
FIGURE = re.compile(r"\b\d+(\.\d+)?x\b|GB/s|tok/s|GFLOP/s|GOP/s|\d%|\b20\d\d-\d\d-\d\d\b"
                    r"|\d\s?(ms|us|ns)\b|\d\s*->\s*\d")
NARRATION_BUDGET = 100  # comment lines with a figure, all of pagedllm/ (issue 54)
SOURCES = ("*.py", "*.h", "*.cpp")


def _python_comments(text: str) -> dict[int, list[str]]:
    """Line number -> the comment and docstring text on it."""
    found: dict[int, list[str]] = {}
    previous = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found.setdefault(tok.start[0], []).append(tok.string)
        elif tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT,
                                                          tokenize.DEDENT):
            for i, line in enumerate(tok.string.splitlines()):  # a string statement: a docstring
                found.setdefault(tok.start[0] + i, []).append(line)
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return found


def _cpp_comments(text: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    in_block = False
    for number, rest in enumerate(text.splitlines(), 1):
        while rest:
            if in_block:
                end = rest.find("*/")
                found.setdefault(number, []).append(rest if end < 0 else rest[:end])
                rest, in_block = ("", True) if end < 0 else (rest[end + 2:], False)
                continue
            line_at, block_at = rest.find("//"), rest.find("/*")
            if line_at >= 0 and (block_at < 0 or line_at < block_at):
                found.setdefault(number, []).append(rest[line_at + 2:])
                rest = ""
            elif block_at >= 0:
                rest, in_block = rest[block_at + 2:], True
            else:
                rest = ""
    return found


def narrating_lines(text: str, suffix: str) -> list[int]:
    comments = _python_comments(text) if suffix == ".py" else _cpp_comments(text)
    return sorted(n for n, parts in comments.items() if any(FIGURE.search(p) for p in parts))


def narration_counts(root: Path = ROOT / "pagedllm") -> dict[str, int]:
    counts = {}
    for pattern in SOURCES:
        for path in root.rglob(pattern):
            lines = narrating_lines(path.read_text(), path.suffix)
            if lines:
                counts[str(path.relative_to(root))] = len(lines)
    return counts


def test_comments_keep_figures_in_docs():
    counts = narration_counts()
    assert sum(counts.values()) < NARRATION_BUDGET, sorted(counts.items(), key=lambda kv: -kv[1])


def test_the_narration_count_can_fail():
    cpp = ("// Tiles of 6 rows: the FMAs bound them.\n"
           "int x = 2;  // measured 1.2x faster on 2026-12-01\n"
           "/* 40 GB/s\n   and 3 us a call */\n")
    assert narrating_lines(cpp, ".cpp") == [2, 3, 4]
    py = ('"""Docstring: 12.5 tok/s."""\n'
          'x = "1.5x"  # a string that is not a comment\n'
          '# 95% of a step\n'
          'def f():\n    """fine"""\n')
    assert narrating_lines(py, ".py") == [1, 3]


def test_docs_pointers_in_the_code_name_headings():
    """A comment's "docs/X.md#section" names a heading of that page."""
    pointer = re.compile(r"docs/([\w-]+\.md)#([\w-]+)")
    slugs = {page.name: {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                         for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}
             for page in PAGES if page.parent.name == "docs"}
    bad = []
    for pattern in SOURCES:
        for path in (ROOT / "pagedllm").rglob(pattern):
            bad += [(path.name, f, a) for f, a in pointer.findall(path.read_text())
                    if a not in slugs.get(f, ())]
    assert not bad, bad


if __name__ == "__main__":  # python tests/test_docs.py: the narrating comment lines per file
    counts = narration_counts()
    for name, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(count, name)
    print("total", sum(counts.values()))
