// pagedllm dashboard: step-trace records (docs/trace_schema.md, v1) drawn on plain canvases.
// Live from /v1/trace/stream (server-sent events read through fetch, so an API key can go in
// the Authorization header), or from a saved --trace-file (drag and drop, the file field, or
// ?trace=URL). No build step, no library.
"use strict";

const KEEP = 300;  // records kept for the charts
const S = { header: null, records: [], totals: null, map: null, live: true, metrics: {}, dirty: true };
window.pagedllmDashboard = S;  // for the browser test and for curious readers
const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const COLORS = { prefill: "#1565c0", decode: "#2e7d32", draft: "#8e24aa", recompute: "#c62828",
                 running: "#2e7d32", waiting: "#ef6c00", finished: "#546e7a" };

// -- data in ------------------------------------------------------------------------------------
function addRecord(rec) {
  S.records.push(rec);
  if (S.records.length > KEEP) S.records.shift();
  if (rec.totals) S.totals = rec.totals;
  if (rec.block_map) S.map = rec.block_map;
  S.dirty = true;
}

function onEvent(name, data) {
  if (!S.live) return;  // a loaded trace is on screen
  if (name === "hello") { S.header = data; S.totals = data.totals; if (data.block_map) S.map = data.block_map; }
  else if (name === "step") addRecord(data);
  else if (name === "totals") { S.totals = data.totals; if (data.block_map) S.map = data.block_map; }
  S.dirty = true;
}

async function connect() {
  const key = $("key").value;
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let resp;
  try { resp = await fetch("v1/trace/stream", { headers }); }
  catch (e) { setStatus("stream failed: " + e); return setTimeout(connect, 3000); }
  if (resp.status === 401) return setStatus("the stream needs the API key (the key field, or ?key=)");
  if (!resp.ok) { setStatus("stream: HTTP " + resp.status); return setTimeout(connect, 3000); }
  setStatus("live");
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) onEvent(name, JSON.parse(data));
    }
  }
  if (S.live) { setStatus("stream ended; reconnecting"); setTimeout(connect, 2000); }
}

// A saved trace: fill in the totals the live stream would have carried.
function loadTrace(text, name) {
  const lines = text.split("\n").filter((l) => l.trim());
  const recs = lines.map((l) => JSON.parse(l));
  const bad = recs.find((r) => r.v !== 1);
  if (bad) return setStatus(`${name}: trace schema v${bad.v}, this page reads v1`);
  S.live = false;
  S.header = recs.find((r) => r.header) || null;
  S.records = []; S.map = null;
  const t = { steps: 0, finished: 0, preempted: 0, prompt_tokens: 0, generation_tokens: 0,
              prefix_queries: 0, prefix_hits: 0, running: 0, waiting: 0, kv_usage: 0 };
  for (const r of recs) {
    if (r.header) continue;
    t.steps += 1; t.finished += r.finished.length; t.preempted += r.preempted.length;
    t.prompt_tokens += r.tokens.prompt; t.generation_tokens += r.tokens.generation;
    t.prefix_queries += r.prefix_cache.queries; t.prefix_hits += r.prefix_cache.hits;
    t.running = r.queues.running; t.waiting = r.queues.waiting; t.kv_usage = r.kv_usage;
    r.totals = Object.assign({}, t);
    addRecord(r);
  }
  setStatus(`trace ${name}: ${t.steps} steps`);
}

async function pollMetrics() {
  try {
    const resp = await fetch("metrics");
    if (resp.ok) S.metrics = parseMetrics(await resp.text());
    S.dirty = true;
  } catch (e) { /* the server may be gone; the stream says so */ }
}

function parseMetrics(text) {
  const m = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const sp = line.lastIndexOf(" ");
    const name = line.slice(0, sp).replace(/\{.*\}/, "");
    m[name] = (m[name] || 0) + parseFloat(line.slice(sp + 1));
  }
  return m;
}

// -- drawing ------------------------------------------------------------------------------------
function ctxOf(id) {
  const c = $(id), ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  return [c, ctx];
}

function axes(ctx, c, max, label) {
  ctx.strokeStyle = "#bbb"; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(30, 4); ctx.lineTo(30, c.height - 14); ctx.lineTo(c.width - 4, c.height - 14); ctx.stroke();
  ctx.fillStyle = "#666"; ctx.font = "10px sans-serif";
  ctx.fillText(String(label !== undefined ? label : max), 2, 12); ctx.fillText("0", 18, c.height - 14);
}

function drawLines(id, series, max, label) {
  const [c, ctx] = ctxOf(id);
  axes(ctx, c, max, label);
  const n = S.records.length, w = c.width - 36, h = c.height - 20;
  for (const [color, values] of series) {
    ctx.strokeStyle = color; ctx.lineWidth = 2; ctx.beginPath();
    values.forEach((v, i) => {
      const x = 32 + (n > 1 ? (i * w) / (n - 1) : 0), y = c.height - 14 - (max ? (v / max) * h : 0);
      if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    });
    if (values.length === 1) ctx.lineTo(36, c.height - 14 - (max ? (values[0] / max) * h : 0));
    ctx.stroke();
  }
}

function drawBudget() {
  const [c, ctx] = ctxOf("c-budget");
  const max = (S.header && S.header.max_num_batched_tokens) ||
              Math.max(1, ...S.records.map((r) => r.budget.max));
  axes(ctx, c, max);
  const n = S.records.length, w = (c.width - 36) / Math.max(n, 1), h = c.height - 20;
  S.records.forEach((r, i) => {
    let y = c.height - 14;
    for (const kind of ["prefill", "decode", "draft", "recompute"]) {
      const bh = (r.budget[kind] / max) * h;
      ctx.fillStyle = COLORS[kind];
      ctx.fillRect(32 + i * w, y - bh, Math.max(w - 1, 1), bh);
      y -= bh;
    }
  });
}

function hue(rid) {
  let x = 0;
  for (const ch of rid) x = (x * 31 + ch.charCodeAt(0)) >>> 0;
  return x % 360;
}

function drawBlocks() {
  const c = $("c-blocks"), m = S.map;
  if (!m) return;
  const n = m.num_blocks, width = c.clientWidth || c.width;
  const cell = Math.max(3, Math.min(22, Math.floor(Math.sqrt((width * 260) / n))));
  const cols = Math.max(1, Math.floor(width / cell)), rows = Math.ceil(n / cols);
  c.width = width; c.height = rows * cell;
  S.layout = { cell, cols };
  const ctx = c.getContext("2d");
  const owner = new Array(n).fill(null);
  for (const [rid, table] of Object.entries(m.tables)) for (const b of table) if (owner[b] === null) owner[b] = rid;
  const cached = new Set(m.cached_free);
  ctx.font = `${Math.max(8, cell - 8)}px sans-serif`;
  for (let b = 0; b < n; b++) {
    const x = (b % cols) * cell, y = Math.floor(b / cols) * cell, ref = m.ref_cnt[b];
    ctx.fillStyle = ref > 1 ? `hsl(${hue(owner[b])},55%,32%)` : ref === 1 ? `hsl(${hue(owner[b])},65%,55%)`
                  : cached.has(b) ? "#bdbdbd" : "#eeeeee";
    ctx.fillRect(x, y, cell - 1, cell - 1);
    if (ref > 1 && cell >= 14) { ctx.fillStyle = "#fff"; ctx.fillText(String(ref), x + 3, y + cell - 4); }
  }
  c.dataset.cells = String(n);
  const used = m.ref_cnt.filter((r) => r > 0).length;
  $("map-info").textContent = ` (${n} blocks of ${m.block_size} tokens; ${used} in use, ${m.cached_free.length} cached-free)`;
}

function blockAt(ev) {
  const m = S.map, L = S.layout;
  if (!m || !L) return;
  const b = Math.floor(ev.offsetY / L.cell) * L.cols + Math.floor(ev.offsetX / L.cell);
  if (b >= m.num_blocks) return;
  const owners = Object.entries(m.tables).filter(([, t]) => t.includes(b)).map(([rid]) => rid);
  $("block-tip").textContent = `block ${b}: ref ${m.ref_cnt[b]}` +
    (owners.length ? `, in ${owners.join(", ")}` : m.cached_free.includes(b) ? ", free, cached" : ", free");
}

function setText(id, v) { $(id).textContent = v; }
function setStatus(s) { setText("status", s); }

function draw() {
  if (!S.dirty) return;
  S.dirty = false;
  const recs = S.records, t = S.totals || {};
  setText("t-steps", t.steps || 0);
  setText("t-running", t.running || 0);
  setText("t-waiting", t.waiting || 0);
  setText("t-finished", t.finished || 0);
  setText("t-preempted", t.preempted || 0);
  setText("t-generation", t.generation_tokens || 0);
  setText("t-kv", Math.round((t.kv_usage || 0) * 100) + "%");
  setText("t-hit-rate", t.prefix_queries ? (100 * t.prefix_hits / t.prefix_queries).toFixed(1) + "%" : "-");
  const mm = S.metrics, mean = (n) => (mm[n + "_count"] ? (1000 * mm[n + "_sum"] / mm[n + "_count"]).toFixed(1) + " ms" : "-");
  setText("t-ttft", mean("vllm:time_to_first_token_seconds"));
  setText("t-itl", mean("vllm:inter_token_latency_seconds"));
  const qmax = Math.max(1, ...recs.map((r) => Math.max(r.queues.running, r.queues.waiting, r.totals ? r.totals.finished : 0)));
  drawLines("c-queues", [[COLORS.running, recs.map((r) => r.queues.running)],
                         [COLORS.waiting, recs.map((r) => r.queues.waiting)],
                         [COLORS.finished, recs.map((r) => (r.totals ? r.totals.finished : 0))]], qmax);
  drawBudget();
  drawLines("c-hits", [["#1565c0", recs.map((r) => (r.totals && r.totals.prefix_queries ? r.totals.prefix_hits / r.totals.prefix_queries : 0))]], 1, "100%");
  const pmax = Math.max(1, ...recs.map((r) => (r.totals ? r.totals.preempted : 0)));
  drawLines("c-preempt", [["#c62828", recs.map((r) => (r.totals ? r.totals.preempted : 0))]], pmax);
  drawBlocks();
  const last = recs[recs.length - 1];
  if (last) {
    const lines = [`step ${last.step}: ${last.budget.used}/${last.budget.max} tokens`];
    for (const r of last.reqs) lines.push(`  ${r.id}: ${r.kind} ${r.n} (from ${r.start})`);
    for (const p of last.preempted) lines.push(`  preempted ${p.id} (needed by ${p.needed_by})`);
    for (const f of last.finished) lines.push(`  finished ${f.id} (${f.reason})`);
    if (last.skipped.length) lines.push(`  skipped ${last.skipped.join(", ")}`);
    $("last-step").textContent = lines.join("\n");
  }
}

// -- start --------------------------------------------------------------------------------------
$("key").value = params.get("key") || sessionStorage.getItem("pagedllm-key") || "";
$("key").addEventListener("change", () => { sessionStorage.setItem("pagedllm-key", $("key").value); if (S.live) connect(); });
$("trace-file").addEventListener("change", async (ev) => {
  const f = ev.target.files[0];
  if (f) loadTrace(await f.text(), f.name);
});
document.addEventListener("dragover", (ev) => ev.preventDefault());
document.addEventListener("drop", async (ev) => {
  ev.preventDefault();
  const f = ev.dataTransfer.files[0];
  if (f) loadTrace(await f.text(), f.name);
});
$("c-blocks").addEventListener("mousemove", blockAt);
setInterval(draw, 250);
if (params.get("trace")) {
  fetch(params.get("trace")).then((r) => r.text()).then((t) => loadTrace(t, params.get("trace")))
    .catch((e) => setStatus("cannot load the trace: " + e));
} else {
  connect();
  pollMetrics();
  setInterval(pollMetrics, 2000);
}
