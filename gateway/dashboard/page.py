"""The dashboard's HTML page: no external assets (inline CSS and JS); it polls `dashboard/data`
and re-renders. Kept as a Python string so a plain `pip install .` ships it."""

from __future__ import annotations

import html

POLL_INTERVAL_MS = 1500

DASHBOARD_HTML = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kvfleet dashboard</title>
<style>
  :root { --bg:#0f1419; --panel:#182029; --line:#2a3542; --text:#e6edf3; --dim:#8b98a5;
          --ok:#3fb950; --warn:#d29922; --bad:#f85149; --accent:#58a6ff; }
  * { box-sizing: border-box; }
  body { margin:0; padding:20px 24px; background:var(--bg); color:var(--text);
         font:14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; }
  header { display:flex; align-items:baseline; gap:16px; margin-bottom:16px; }
  h1 { font-size:20px; margin:0; }
  #model { color:var(--accent); font-family:ui-monospace, monospace; }
  #status { margin-left:auto; color:var(--dim); font-size:12px; }
  #status.down { color:var(--bad); font-weight:600; font-size:14px; }
  .cards { display:grid; grid-template-columns:repeat(auto-fit, minmax(140px, 1fr)); gap:10px;
           margin-bottom:18px; }
  .card { background:var(--panel); border:1px solid var(--line); border-radius:8px;
          padding:10px 12px; }
  .card .label { color:var(--dim); font-size:11px; text-transform:uppercase; letter-spacing:.05em; }
  .card .value { font-size:22px; font-weight:600; font-variant-numeric:tabular-nums; }
  .card .sub { color:var(--dim); font-size:12px; }
  table { width:100%; border-collapse:collapse; background:var(--panel);
          border:1px solid var(--line); border-radius:8px; overflow:hidden; }
  th, td { padding:8px 10px; text-align:right; border-bottom:1px solid var(--line);
           font-variant-numeric:tabular-nums; white-space:nowrap; }
  th { color:var(--dim); font-weight:500; font-size:12px; background:#141b22; }
  th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align:left; }
  td.id { font-family:ui-monospace, monospace; }
  td.id a { color:var(--text); text-decoration:none; border-bottom:1px dotted var(--dim); }
  .kv { display:flex; align-items:center; gap:8px; justify-content:flex-end; }
  .bar { width:120px; height:10px; background:#0b0f13; border:1px solid var(--line);
         border-radius:5px; overflow:hidden; }
  .fill { height:100%; background:var(--ok); }
  .fill.warn { background:var(--warn); } .fill.bad { background:var(--bad); }
  .stale { color:var(--warn); }
  #empty { color:var(--dim); padding:14px; text-align:center; }
</style>
</head>
<body>
<header>
  <h1>kvfleet</h1><span id="model">__MODEL__</span>
  <span id="status">loading…</span>
</header>
<section class="cards">
  <div class="card"><div class="label">Queue depth</div><div class="value" id="queue-depth">–</div>
    <div class="sub" id="queue-detail">–</div></div>
  <div class="card"><div class="label">In progress</div>
    <div class="value" id="queue-pending">–</div>
    <div class="sub">delivered, not acked</div></div>
  <div class="card"><div class="label">Fleet tokens/s</div><div class="value" id="total-tps">–</div>
    <div class="sub" id="total-workers">–</div></div>
  <div class="card"><div class="label">Running / waiting</div>
    <div class="value"><span id="total-running">–</span> / <span id="total-waiting">–</span></div>
    <div class="sub" id="total-kv">–</div></div>
  <div class="card"><div class="label">TTFT p50</div><div class="value" id="ttft-p50">–</div>
    <div class="sub">recent requests</div></div>
  <div class="card"><div class="label">TTFT p99</div><div class="value" id="ttft-p99">–</div>
    <div class="sub" id="in-flight">–</div></div>
</section>
<table>
  <thead><tr><th>worker</th><th>model</th><th>KV usage</th><th>running</th><th>waiting</th>
    <th>tokens/s</th><th>prefix hit</th><th>preempted</th><th>heartbeat</th></tr></thead>
  <tbody id="workers"></tbody>
</table>
<div id="empty" hidden>no live workers</div>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const $ = (id) => document.getElementById(id);
const fmt = (x, d) => (x === null || x === undefined) ? "–" : Number(x).toFixed(d);
const fmtS = (s) => (s === null || s === undefined) ? "–"
  : (s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s");

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function kvCell(row, w) {
  const td = cell(row, "");
  const box = document.createElement("div"); box.className = "kv";
  const bar = document.createElement("div"); bar.className = "bar";
  const fill = document.createElement("div");
  const pct = w.kv_usage_pct;
  fill.className = "fill" + (pct >= 95 ? " bad" : pct >= 80 ? " warn" : "");
  fill.style.width = Math.min(pct, 100) + "%";
  bar.appendChild(fill);
  const label = document.createElement("span");
  label.className = "kv-label";
  label.textContent = pct.toFixed(1) + "% (" + w.kv_blocks_used + "/" + w.kv_blocks_total + ")";
  box.appendChild(bar); box.appendChild(label); td.appendChild(box);
}

function renderWorkers(workers) {
  const body = $("workers");
  body.replaceChildren();
  for (const w of workers) {
    const row = document.createElement("tr");
    row.dataset.worker = w.id;
    const idCell = cell(row, w.metrics_url ? "" : w.id, "id");
    if (w.metrics_url) {
      const link = document.createElement("a");
      link.href = w.metrics_url; link.textContent = w.id; link.title = "Prometheus metrics";
      idCell.appendChild(link);
    }
    cell(row, w.model);
    kvCell(row, w);
    cell(row, String(w.running));
    cell(row, String(w.waiting));
    cell(row, fmt(w.tokens_per_s, 1));
    cell(row, w.prefix_hit_rate === null ? "–" : (w.prefix_hit_rate * 100).toFixed(1) + "%");
    cell(row, String(w.preemptions));
    cell(row, w.heartbeat_age_s === null ? "–" : w.heartbeat_age_s.toFixed(1) + " s ago",
         w.heartbeat_age_s !== null && w.heartbeat_age_s > 3 ? "stale" : "");
    body.appendChild(row);
  }
  $("empty").hidden = workers.length > 0;
}

function render(d) {
  $("model").textContent = d.model;
  $("queue-depth").textContent = String(d.queue.depth);
  $("queue-pending").textContent = String(d.queue.pending);
  $("queue-detail").textContent = Object.entries(d.queue.by_priority)
    .map(([p, q]) => p + " " + q.depth).join(" · ");
  $("total-tps").textContent = fmt(d.totals.tokens_per_s, 1);
  const n = d.totals.workers;
  $("total-workers").textContent = n + " worker" + (n === 1 ? "" : "s");
  $("total-running").textContent = String(d.totals.running);
  $("total-waiting").textContent = String(d.totals.waiting);
  $("total-kv").textContent = "KV " + d.totals.kv_usage_pct.toFixed(1) + "% used";
  $("ttft-p50").textContent = fmtS(d.ttft_p50_s);
  $("ttft-p99").textContent = fmtS(d.ttft_p99_s);
  $("in-flight").textContent = d.in_flight + " in flight";
  renderWorkers(d.workers);
  const status = $("status");
  status.className = "";
  status.textContent = "last updated " + new Date(d.updated * 1000).toLocaleTimeString();
}

function showDown(message) {
  const status = $("status");
  status.className = "down";
  status.textContent = "Redis unreachable" + (message ? " — " + message : "");
}

async function poll() {
  try {
    const res = await fetch("dashboard/data", {cache: "no-store"});
    const body = await res.json().catch(() => null);
    if (res.ok && body) render(body);
    else if (res.status === 503) showDown("");
    else showDown("HTTP " + res.status);
  } catch (err) {
    const status = $("status");
    status.className = "down";
    status.textContent = "gateway unreachable";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
poll();
</script>
</body>
</html>
""".replace("__POLL_MS__", str(POLL_INTERVAL_MS))


def render_page(model: str) -> str:
    """The page with the served model's name in its header (shown even while Redis is down)."""
    return DASHBOARD_HTML.replace("__MODEL__", html.escape(model))
