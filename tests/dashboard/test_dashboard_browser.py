"""The dashboard in a real browser: headless Chromium (Debian's package; .ci/run installs it)
driven by Selenium through the system chromedriver, against a live ``pagedllm serve`` of the
demo model with traffic on 127.0.0.1.

Checks: every chart draws (non-empty canvas), the page's counts equal /metrics, the block map
has a cell per KV block, and a saved --trace-file loads. ``PAGEDLLM_DASHBOARD_SCREENSHOT=PATH``
also saves the screenshot there (docs/dashboard.png is made this way).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from ci_support import free_port, skip_unless_ci
from dash_helpers import send_completions

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
NUM_BLOCKS = 64
CANVASES = ("c-queues", "c-budget", "c-hits", "c-preempt", "c-blocks")
_PAINTED = """const c = document.getElementById(arguments[0]);
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;"""


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


@pytest.fixture(scope="module")
def browser():
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        # .ci/run installs both: in CI their absence fails the test instead of skipping it.
        skip_unless_ci("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,1000", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def server():
    tmp = Path(tempfile.mkdtemp(prefix="pagedllm-dash-"))
    port = free_port()
    trace = tmp / "trace.jsonl"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--port", str(port),
           "--block-size", "4", "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "8",
           "--max-num-batched-tokens", "48", "--max-model-len", "256", "--trace-file", str(trace),
           "--uvicorn-log-level", "warning", "--shutdown-timeout", "1"]
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (log.seek(0), log.read())[1]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "pagedllm serve did not come up"
        time.sleep(0.2)
    yield url, trace, tmp
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)


def _wait(driver, script: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {script}")


def test_live_dashboard_and_saved_trace(browser, server):
    url, trace, tmp = server
    browser.get(f"{url}/dashboard")
    _wait(browser, "return document.getElementById('status').textContent === 'live'")
    # 8 concurrent streams of 60 tokens in 64 blocks of 4: the cache runs out (preemptions), and
    # the prompts share a prefix (prefix-cache hits).
    senders = [threading.Thread(target=send_completions, args=(url, 2, 60)) for _ in range(8)]
    for t in senders:
        t.start()
    # The screenshot (docs/dashboard.png) while the cache is busy: blocks owned and shared.
    shot = tmp / "dashboard.png"
    try:
        _wait(browser, "const S = window.pagedllmDashboard; return S.records.length >= 20 &&"
                       " S.map && S.map.ref_cnt.filter((r) => r > 0).length > 20", timeout=60)
    except AssertionError:
        pass  # a slow machine: the screenshot shows less, the checks below still hold
    browser.save_screenshot(str(shot))
    for t in senders:
        t.join()
    metrics = httpx.get(f"{url}/metrics").text
    finished = int(_metric(metrics, "vllm:request_success_total"))
    assert finished == 16
    _wait(browser, f"return document.getElementById('t-finished').textContent === '{finished}'"
                   " && document.getElementById('t-running').textContent === '0'")
    time.sleep(2.5)  # one more /metrics poll of the page (TTFT / ITL tiles)
    if os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["PAGEDLLM_DASHBOARD_SCREENSHOT"])
    text = {tid: browser.find_element("id", tid).text for tid in
            ("t-finished", "t-preempted", "t-generation", "t-hit-rate", "t-waiting", "t-ttft")}
    assert int(text["t-preempted"]) == int(_metric(metrics, "vllm:num_preemptions_total")) > 0
    assert int(text["t-generation"]) == int(_metric(metrics, "vllm:generation_tokens_total")) == 16 * 60
    hits, queries = (_metric(metrics, "vllm:prefix_cache_hits_total"),
                     _metric(metrics, "vllm:prefix_cache_queries_total"))
    assert hits > 0 and text["t-hit-rate"] == f"{100 * hits / queries:.1f}%"
    assert text["t-waiting"] == "0" and text["t-ttft"].endswith(" ms")
    for canvas in CANVASES:
        assert browser.execute_script(_PAINTED, canvas) > 0, f"{canvas} is blank"
    assert browser.execute_script("return document.getElementById('c-blocks').dataset.cells") == str(NUM_BLOCKS)

    # A saved trace (the server's --trace-file) opened through the file field.
    num_steps = sum(1 for line in trace.read_text().splitlines() if '"header"' not in line)
    browser.get(f"{url}/dashboard")
    browser.find_element("id", "trace-file").send_keys(str(trace))
    status = _wait(browser, "const s = document.getElementById('status').textContent;"
                            " return s.startsWith('trace ') && s")
    assert status.endswith(f"{num_steps} steps") and num_steps > 0
    _wait(browser, f"return document.getElementById('t-generation').textContent === '{16 * 60}'")
    assert browser.find_element("id", "t-preempted").text == text["t-preempted"]
    for canvas in CANVASES:
        assert browser.execute_script(_PAINTED, canvas) > 0, f"{canvas} is blank with the trace"
    assert browser.execute_script("return document.getElementById('c-blocks').dataset.cells") == str(NUM_BLOCKS)
    browser.get("about:blank")  # close the stream before the server stops
