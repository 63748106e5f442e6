"""The dashboard's HTML page: no external assets (inline CSS, JS and SVG); it polls
`dashboard/data` for the cards and the worker table and `dashboard/history` for the charts of the
last 15 minutes, and re-renders. Kept as a Python string so a plain `pip install .` ships it."""

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
  th:first-child, td:first-child, th:nth-child(2), td:nth-child(2), th:nth-child(3),
  td:nth-child(3) { text-align:left; }
  td.id { font-family:ui-monospace, monospace; }
  td.id a { color:var(--text); text-decoration:none; border-bottom:1px dotted var(--dim); }
  .kv { display:flex; align-items:center; gap:8px; justify-content:flex-end; }
  .bar { width:120px; height:10px; background:#0b0f13; border:1px solid var(--line);
         border-radius:5px; overflow:hidden; }
  .fill { height:100%; background:var(--ok); }
  .fill.warn { background:var(--warn); } .fill.bad { background:var(--bad); }
  .stale { color:var(--warn); }
  .draining { color:var(--warn); font-weight:600; }
  .missed { color:var(--bad); font-weight:600; }
  .charts { display:grid; grid-template-columns:repeat(auto-fit, minmax(300px, 1fr)); gap:10px;
            margin-bottom:18px; }
  .chart { background:var(--panel); border:1px solid var(--line); border-radius:8px;
           padding:8px 10px 4px; }
  .chart .head { display:flex; gap:10px; align-items:baseline; font-size:12px; color:var(--dim); }
  .chart .head .latest { margin-left:auto; color:var(--text); font-weight:600;
                         font-variant-numeric:tabular-nums; }
  .chart svg { width:100%; height:auto; display:block; }
  .chart .axis { stroke:var(--line); stroke-width:1; }
  .chart .axis.top { stroke-dasharray:3 3; }
  .chart text { fill:var(--dim); font-size:10px; font-family:system-ui, sans-serif; }
  .line { fill:none; stroke-width:2; stroke-linejoin:round; stroke-linecap:round; }
  .line.tps { stroke:#39c5cf; } .line.p50 { stroke:#a371f7; } .line.p99 { stroke:#ff7b72; }
  .line.queue { stroke:#e3b341; } .line.kv { stroke:#7ee787; }
  .key { display:inline-block; width:10px; height:3px; vertical-align:middle; margin-right:3px; }
  .key.p50 { background:#a371f7; } .key.p99 { background:#ff7b72; }
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
  <div class="card"><div class="label">Cached prompt</div><div class="value" id="fleet-hit">–</div>
    <div class="sub" id="routing">–</div></div>
  <div class="card"><div class="label">TTFT p50</div><div class="value" id="ttft-p50">–</div>
    <div class="sub">recent requests</div></div>
  <div class="card"><div class="label">TTFT p99</div><div class="value" id="ttft-p99">–</div>
    <div class="sub" id="in-flight">–</div></div>
</section>
<section class="charts" id="charts">
  <div class="chart"><div class="head">Fleet tokens/s<span class="latest" id="latest-tps">–</span>
    </div><svg id="chart-tps" viewBox="0 0 320 120"></svg></div>
  <div class="chart"><div class="head">TTFT <span><i class="key p50"></i>p50</span>
    <span><i class="key p99"></i>p99</span><span class="latest" id="latest-ttft">–</span></div>
    <svg id="chart-ttft" viewBox="0 0 320 120"></svg></div>
  <div class="chart"><div class="head">Queue depth<span class="latest" id="latest-queue">–</span>
    </div><svg id="chart-queue" viewBox="0 0 320 120"></svg></div>
  <div class="chart"><div class="head">KV usage<span class="latest" id="latest-kv">–</span>
    </div><svg id="chart-kv" viewBox="0 0 320 120"></svg></div>
</section>
<table>
  <thead><tr><th>worker</th><th>model</th><th>role</th><th>numerics</th><th>KV usage</th><th>running</th>
    <th>waiting</th><th>tokens/s</th><th>prefix hit</th><th>spec accepted</th>
    <th>ITL p99 / target</th><th>TTFT p99 / target</th><th>room at pace</th>
    <th>indexed blocks</th><th>routed</th><th>own queue</th><th>handoffs out / in</th>
    <th>preempted</th><th>heartbeat</th></tr></thead>
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

// "p99 / target ms" of a promised pace ("–" when none); red when the p99 misses the target
function paceCell(row, p99, target) {
  if (target === null) return cell(row, "–");
  return cell(row, fmt(p99, 0) + " / " + fmt(target, 0) + " ms",
              p99 !== null && p99 > target ? "missed" : "");
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
    cell(row, w.draining ? w.role + " · draining" : w.role, w.draining ? "role draining" : "role");
    cell(row, w.numerics === null ? "–" : w.numerics, "numerics");
    kvCell(row, w);
    cell(row, String(w.running));
    cell(row, String(w.waiting));
    cell(row, fmt(w.tokens_per_s, 1));
    cell(row, w.prefix_hit_rate === null ? "–" : (w.prefix_hit_rate * 100).toFixed(1) + "%");
    cell(row, w.spec_acceptance_rate === null ? "–"
      : (w.spec_acceptance_rate * 100).toFixed(1) + "%");
    paceCell(row, w.itl_p99_ms, w.target_itl_ms);
    paceCell(row, w.ttft_p99_ms, w.target_ttft_ms);
    cell(row, w.pace_room === null ? "–" : String(w.pace_room));
    cell(row, w.indexed_blocks === null ? "–" : String(w.indexed_blocks));
    cell(row, w.routed === null ? "–" : String(w.routed));
    cell(row, String(w.own_queue));
    cell(row, w.handoffs_out + " / " + w.handoffs_in);
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
  $("fleet-hit").textContent = d.totals.prefix_hit_rate === null ? "–"
    : (d.totals.prefix_hit_rate * 100).toFixed(1) + "%";
  $("routing").textContent = d.routing.mode === "affinity"
    ? "affinity " + d.routing.affinity + " · least loaded " + d.routing.least_loaded
      + " · shared " + d.routing.shared
    : d.routing.mode === "random"
    ? "random " + d.routing.random + " · shared " + d.routing.shared : "shared routing";
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
// ---- charts of the last 15 minutes (dashboard/history) ----
const SVG_NS = "http://www.w3.org/2000/svg";
const W = 320, H = 120, LEFT = 40, RIGHT = 6, TOP = 8, BOTTOM = 18;
const count = (v) => Number(v).toFixed(0);
const CHARTS = [
  {id: "chart-tps", latest: "latest-tps", fmt: (v) => fmt(v, 1), axis: count,
   series: [{key: "tokens_per_s", cls: "tps"}]},
  {id: "chart-ttft", latest: "latest-ttft", fmt: fmtS, axis: fmtS,
   series: [{key: "ttft_p50_s", cls: "p50"}, {key: "ttft_p99_s", cls: "p99"}]},
  {id: "chart-queue", latest: "latest-queue", fmt: count, axis: count,
   series: [{key: "queue_depth", cls: "queue"}]},
  {id: "chart-kv", latest: "latest-kv", fmt: (v) => v.toFixed(1) + "%", axis: (v) => count(v) + "%",
   series: [{key: "kv_usage_pct", cls: "kv"}], max: 100},
];

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function niceMax(v) {  // the smallest 1, 2, 2.5 or 5 x 10^k at or above v
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  return [1, 2, 2.5, 5, 10].map((m) => m * p).find((m) => m >= v * (1 - 1e-9));
}

function drawChart(spec, h) {
  const svg = $(spec.id);
  svg.replaceChildren();
  const t1 = h.now, t0 = h.now - h.history_s;
  const values = h.points.flatMap((p) => spec.series.map((s) => p[s.key]))
    .filter((v) => v !== null && v !== undefined);
  const top = spec.max || niceMax(Math.max(0, ...values));
  const x = (t) => LEFT + (W - LEFT - RIGHT) * Math.max(0, t - t0) / (t1 - t0);
  const y = (v) => TOP + (H - TOP - BOTTOM) * (1 - Math.min(v, top) / top);
  svg.append(
    svgEl("line", {class: "axis", x1: LEFT, x2: W - RIGHT, y1: y(0), y2: y(0)}),
    svgEl("line", {class: "axis top", x1: LEFT, x2: W - RIGHT, y1: y(top), y2: y(top)}),
    svgEl("text", {x: LEFT - 4, y: y(top) + 4, "text-anchor": "end", class: "ymax"}, spec.axis(top)),
    svgEl("text", {x: LEFT - 4, y: y(0) + 4, "text-anchor": "end"}, spec.axis(0)),
    svgEl("text", {x: LEFT, y: H - 4}, "-" + Math.round(h.history_s / 60) + " min"),
    svgEl("text", {x: W - RIGHT, y: H - 4, "text-anchor": "end"}, "now"));
  for (const s of spec.series) {
    let d = "", drawn = 0, penUp = true;
    for (const p of h.points) {
      const v = p[s.key];
      if (v === null || v === undefined || p.t < t0) { penUp = true; continue; }
      const xy = x(p.t).toFixed(1) + " " + y(v).toFixed(1);
      d += penUp ? "M" + xy + " L" + xy : " L" + xy;  // a lone point still shows (round cap)
      penUp = false;
      drawn += 1;
    }
    svg.append(svgEl("path", {class: "line " + s.cls, d: d || "M0 0", "data-points": drawn}));
  }
  const last = [...h.points].reverse().find((p) => p[spec.series[0].key] !== null);
  $(spec.latest).textContent = last ? spec.series.map((s) => spec.fmt(last[s.key] ?? 0))
    .join(" / ") : "–";
}

async function pollHistory() {
  let waitMs = 5000;
  try {
    const res = await fetch("dashboard/history", {cache: "no-store"});
    if (res.ok) {
      const h = await res.json();
      for (const spec of CHARTS) drawChart(spec, h);
      waitMs = Math.max(1000, h.sample_s * 1000);
    }
  } catch (err) {
    // the status line already says what is unreachable
  } finally {
    setTimeout(pollHistory, waitMs);
  }
}
poll();
pollHistory();
</script>
</body>
</html>
""".replace("__POLL_MS__", str(POLL_INTERVAL_MS))


def render_page(model: str) -> str:
    """The page with the served model's name in its header (shown even while Redis is down)."""
    return DASHBOARD_HTML.replace("__MODEL__", html.escape(model))
