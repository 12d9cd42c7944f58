// TrainGuard dashboard: a single page over the query API (/api/v1). Hash routes:
//   #/runs[?status=…]      runs, most recently active first
//   #/runs/<run id>[?overlay=<id>,<id>…&rank=<r>&points=<n>]
//                          the run: incidents; plots of its metrics (every rank), incident onsets marked, chosen in
//                          a metric picker, smoothed (EMA, raw faint behind), zoomed together, log/linear each,
//                          other runs overlaid dashed; its tags/config/versions diffed against the overlaid runs
//                          and, for several ranks, a heatmap of their step times (ranks.js)
//   #/incidents/<id>       an incident: summary, the crash's traceback, a perf incident's rank against the others
//                          (ranks.js), hypotheses, checklist, evidence (plotted),
//                          workflow, timeline
//   #/search?q=…           full-text search over raw context (tracebacks, logs)
//   #/clusters[/<fp>]      stack-fingerprint clusters across runs and ranks; one with its sample traceback
// The read token is asked for once and kept in localStorage; every request sends it as a bearer token.
// Also kept in localStorage: the smoothing weight and the theme (dark/light; else the system's setting).
"use strict";

const TOKEN_KEY = "trainguard.readToken";
const view = document.getElementById("view");
const REFRESH_MS = 2000;           // a live run's plots redraw at most this often (the run and incidents: at once)
const MAX_POINTS = 600;            // buckets per series asked of the API (server-side downsampling keeps spikes)
const HEATMAP_LAYERS = 48;         // per-layer gradient norms shown in the heatmap (the first, by name)
const HEATMAP_POINTS = 200;        // step buckets of the heatmap
const PLOTTED = [                  // the metrics a run page plots first, when the run has them (SDK names)
  "loss", "grad/global_norm", "opt/lr", "lr", "grad/clip_rate", "grad/clip_triggered", "amp/scale",
  "mem/allocated", "mem/reserved", "mem/fragmentation", "mem/max_allocated", "mem/rss", "time/step_s",
];
let liveStream = null;             // the AbortController of the open run stream (server-sent events)
const charts = [];

// ---------------------------------------------------------------------------------------------- api
class AuthError extends Error {}

async function post(path, body) {
  const res = await fetch(path, { method: "POST", body: JSON.stringify(body), headers: {
    Authorization: `Bearer ${localStorage.getItem(TOKEN_KEY)}`, "Content-Type": "application/json" } });
  const data = await res.json().catch(() => ({}));
  if (res.status === 401 || res.status === 403) throw new AuthError(data.detail || res.statusText);
  if (!res.ok) throw new Error(`${res.status}: ${data.detail || res.statusText}`);
  return data;
}

// [body, the X-Next-Cursor header (null on a last page)] of a GET on the query API
async function apiPage(path) {
  const token = localStorage.getItem(TOKEN_KEY);
  if (!token) throw new AuthError("no token");
  const res = await fetch(path, { headers: { Authorization: `Bearer ${token}` } });
  if (res.status === 401 || res.status === 403) throw new AuthError((await res.json()).detail || res.statusText);
  if (!res.ok) throw new Error(`${res.status}: ${(await res.json().catch(() => ({}))).detail || res.statusText}`);
  return [await res.json(), res.headers.get("X-Next-Cursor")];
}

async function api(path) {
  return (await apiPage(path))[0];
}

// The ?names= value naming these metrics, URL-encoded: comma-separated, and in a name a backslash, a comma
// and a white-space character at either end (a space, U+00A0, ...: what the API strips, Python's isspace)
// escaped with a backslash (the API's syntax: a metric name may hold commas and spaces at its ends,
// docs/security.md H35)
const NAME_SPACE = "[\\t-\\r\\x1c-\\x20\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]";  // = isspace
const EDGE_SPACE = new RegExp(`^${NAME_SPACE}|${NAME_SPACE}$`, "g");
function namesParam(names) {
  const one = (n) => n.replace(/\\/g, "\\\\").replace(/,/g, "\\,").replace(EDGE_SPACE, (m) => "\\" + m);
  return encodeURIComponent(names.map(one).join(","));
}

// A run's metric summary: the endpoint answers a page of names at a time (X-Next-Cursor gives the next);
// at most SUMMARY_PAGES pages of SUMMARY_PAGE names are read (a run has at most run_max_metric_names)
const SUMMARY_PAGE = 5000, SUMMARY_PAGES = 4;
async function metricSummary(runId) {
  const base = `/api/v1/runs/${encodeURIComponent(runId)}/metrics/summary?limit=${SUMMARY_PAGE}`;
  let out = [], cursor = null;
  for (let page = 0; page < SUMMARY_PAGES; page++) {
    const [items, next] = await apiPage(cursor ? `${base}&cursor=${encodeURIComponent(cursor)}` : base);
    out = out.concat(items);
    if (!next) break;
    cursor = next;
  }
  return out;
}

function askToken(message) {
  const dialog = document.getElementById("login");
  document.getElementById("login-error").textContent = message || "";
  if (!dialog.open) dialog.showModal();
}

document.getElementById("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  localStorage.setItem(TOKEN_KEY, document.getElementById("token").value.trim());
  document.getElementById("login").close();
  route();
});
document.getElementById("logout").addEventListener("click", () => { localStorage.removeItem(TOKEN_KEY); route(); });
document.getElementById("search-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  location.hash = `#/search?q=${encodeURIComponent(document.getElementById("search-box").value)}`;
});

// ---------------------------------------------------------------------------------------------- theme
// dark or light: the header's toggle (kept in localStorage), else the system's prefers-color-scheme
const THEME_KEY = "trainguard.theme";
const systemDark = window.matchMedia("(prefers-color-scheme: dark)");

function applyTheme() {
  const theme = localStorage.getItem(THEME_KEY) || (systemDark.matches ? "dark" : "light");
  document.documentElement.dataset.theme = theme;
  document.getElementById("theme-toggle").textContent = theme === "dark" ? "Light" : "Dark";
}

applyTheme();
document.getElementById("theme-toggle").addEventListener("click", () => {
  localStorage.setItem(THEME_KEY, document.documentElement.dataset.theme === "dark" ? "light" : "dark");
  applyTheme();
  route();  // the charts are drawn again in the theme's colours
});
systemDark.addEventListener("change", () => { if (!localStorage.getItem(THEME_KEY)) { applyTheme(); route(); } });

// ---------------------------------------------------------------------------------------------- helpers
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const when = (ns) => (ns ? new Date(ns / 1e6).toLocaleString() : "—");
const pill = (text) => `<span class="pill ${esc(text)}">${esc(text)}</span>`;
const darkTheme = () => document.documentElement.dataset.theme === "dark";
const num = (v) => (typeof v === "number" ? v : v === "NaN" ? NaN : v === "Infinity" ? Infinity : v === "-Infinity" ? -Infinity : Number(v));

function clearPage() {
  delete view.dataset.charts;   // set again once the new page's charts are drawn
  if (liveStream) { liveStream.abort(); liveStream = null; }
  while (charts.length) charts.pop().dispose();
}

const PALETTE = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
const ZOOM_GROUP = "run-metrics";  // the run page's metric charts: one zoom moves every chart's step axis

// TensorBoard's smoothing: a debiased exponential moving average over the finite points, in step order;
// a non-finite point (NaN, inf) is drawn as is and does not enter the average. weight 0 = raw.
function ema(points, weight) {
  let last = 0, n = 0;
  return points.map(([x, y]) => {
    if (!(weight > 0) || !Number.isFinite(y)) return [x, y];
    last = last * weight + (1 - weight) * y;
    n += 1;
    return [x, last / (1 - Math.pow(weight, n))];
  });
}

// an axis label: plain when short, k/M/G/T up to 1e15 (320.9M), else in exponent form (1e+20, 3.2e-7)
function tick(v) {
  const a = Math.abs(v);
  if (v === 0 || (a >= 1e-3 && a < 1e5)) return String(+v.toPrecision(6));
  if (a >= 1e5 && a < 1e15) {
    const [div, unit] = a >= 1e12 ? [1e12, "T"] : a >= 1e9 ? [1e9, "G"] : a >= 1e6 ? [1e6, "M"] : [1e3, "k"];
    return `${+(v / div).toPrecision(5)}${unit}`;
  }
  return v.toExponential(2).replace(/\.?0+e/, "e");
}

// a wall-time axis label: 42 s, 12.5 min, 3.25 h
function duration(sec) {
  const a = Math.abs(sec);
  if (a < 120) return `${+sec.toPrecision(3)} s`;
  if (a < 7200) return `${+(sec / 60).toPrecision(3)} min`;
  return `${+(sec / 3600).toPrecision(3)} h`;
}

// Wall time since the run's first step, from the SDK's time/step_s (step boundary to step boundary, so the
// sum of a run's step times up to a step is the time it reached that step): step -> seconds, linear between
// the buckets' last steps (a downsampled bucket adds its mean times its finite count), flat outside them.
// null when the rank (else the lowest rank) has no step times.
const STEP_TIME = "time/step_s";
function stepClock(d, rank) {
  const byRank = (d.series || {})[STEP_TIME] || {};
  const buckets = byRank[rank] || byRank[Object.keys(byRank).sort((a, b) => a - b)[0]] || [];
  if (!buckets.length) return null;
  const knots = [[buckets[0].step_start - 1, 0]];
  let total = 0;
  for (const b of buckets) {
    const mean = num(b.mean);
    if (Number.isFinite(mean)) total += mean * (b.count - b.nonfinite);
    knots.push([b.step_end, total]);
  }
  return (step) => {
    if (step <= knots[0][0]) return 0;
    let lo = 0, hi = knots.length - 1;
    if (step >= knots[hi][0]) return knots[hi][1];
    while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (knots[mid][0] <= step) lo = mid; else hi = mid; }
    const [s0, t0] = knots[lo], [s1, t1] = knots[hi];
    return t0 + (t1 - t0) * (step - s0) / (s1 - s0);
  };
}

// a chart in `el` for a redraw: whatever chart was drawn there before is disposed and forgotten
function freshChart(el) {
  const old = echarts.getInstanceByDom(el);
  if (old) { if (charts.includes(old)) charts.splice(charts.indexOf(old), 1); old.dispose(); }
  const c = echarts.init(el, darkTheme() ? "dark" : null);
  charts.push(c);
  return c;
}

// series: [{name, data: [[step, y]...], dashed?, color?}]; opts.smoothing (0..0.99): each series drawn
// smoothed over its raw line shown faint (ids "smooth:<name>" and "raw:<name>"); opts.group connects zooms;
// opts.time: x is wall time in seconds (see stepClock), else the step
function chart(el, title, series, markers, opts = {}) {
  if (typeof echarts === "undefined") { el.innerHTML = '<p class="error">charting library missing (tools/fetch_assets.py)</p>'; return null; }
  const c = echarts.init(el, darkTheme() ? "dark" : null, { renderer: "canvas" });
  charts.push(c);
  // a series that spans orders of magnitude (an explosion) is read on a log axis, or its start is flat
  const ys = series.flatMap((s) => s.data.map((p) => p[1])).filter((y) => Number.isFinite(y));
  const autoLog = ys.length > 0 && ys.every((y) => y > 0) && Math.max(...ys) / Math.min(...ys) > 1e3;
  const canLog = ys.length > 0 && ys.every((y) => y > 0);
  const logScale = canLog && (opts.scale ? opts.scale === "log" : autoLog);
  const marks = markers.map((m) => ({ xAxis: m.step, name: m.label, lineStyle: { color: m.color, type: "dashed" }, label: { formatter: m.label, color: m.color } }));
  const w = opts.smoothing || 0;
  const drawn = [];
  series.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    const line = { color, type: s.dashed ? "dashed" : "solid", width: 1.5 };
    if (w > 0) drawn.push({ id: `raw:${s.name}`, name: s.name, type: "line", showSymbol: false, data: s.data, silent: true,
      itemStyle: { color }, lineStyle: { ...line, opacity: 0.25 }, z: 1, tooltip: { show: false } });
    drawn.push({ id: `${w > 0 ? "smooth" : "raw"}:${s.name}`, name: s.name, type: "line", showSymbol: false,
      sampling: "lttb", data: w > 0 ? ema(s.data, w) : s.data, itemStyle: { color }, lineStyle: line, z: 2 });
    if (s.band) {  // downsampled: each bucket's min..max as a faint band around its mean
      const stack = `band:${s.name}`, finite = (v) => (Number.isFinite(v) ? v : null);
      drawn.push({ id: `band-low:${s.name}`, name: s.name, type: "line", stack, showSymbol: false, silent: true, z: 0,
        data: s.band.map(([x, lo]) => [x, finite(lo)]), lineStyle: { opacity: 0 }, itemStyle: { color }, tooltip: { show: false } });
      drawn.push({ id: `band-high:${s.name}`, name: s.name, type: "line", stack, showSymbol: false, silent: true, z: 0,
        data: s.band.map(([x, lo, hi]) => [x, Number.isFinite(lo) && Number.isFinite(hi) ? hi - lo : null]),
        lineStyle: { opacity: 0 }, itemStyle: { color }, areaStyle: { color, opacity: 0.15 }, tooltip: { show: false } });
    }
  });
  if (drawn.length && marks.length) drawn[drawn.length - 1].markLine = { symbol: "none", data: marks };
  c.setOption({
    animation: false,
    backgroundColor: "transparent",
    title: { text: logScale ? `${title} (log scale)` : title, textStyle: { fontSize: 13 } },
    tooltip: { trigger: "axis" },
    legend: { top: 20, left: "center", type: "scroll", width: "75%", textStyle: { fontSize: 11 } },
    grid: { left: 60, right: 30, top: 52, bottom: 30 },
    xAxis: opts.time ? { type: "value", name: "wall time", min: "dataMin", max: "dataMax", axisLabel: { formatter: duration } }
      : { type: "value", name: "step", min: "dataMin", max: "dataMax", minInterval: 1 },
    yAxis: logScale ? { type: "log", axisLabel: { formatter: tick } } : { type: "value", scale: true, axisLabel: { formatter: tick } },
    dataZoom: [{ type: "inside", xAxisIndex: 0, filterMode: "none" }],
    series: drawn,
  });
  if (opts.group) c.group = opts.group;
  return c;
}

// ---------------------------------------------------------------------------------------------- pages
// Server-sent events over fetch (EventSource cannot send the token): calls on(event, data) per message
async function stream(path, on) {
  const controller = new AbortController();
  liveStream = controller;
  const res = await fetch(path, { headers: { Authorization: `Bearer ${localStorage.getItem(TOKEN_KEY)}` }, signal: controller.signal });
  if (!res.ok || !res.body) return;
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message", data = "";
      for (const line of frame.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) on(event, JSON.parse(data));
    }
  }
}

async function runsPage(params) {
  const status = params.get("status") || "", tag = params.get("tag") || "";
  const page = await api(`/api/v1/runs?limit=200${status ? `&status=${encodeURIComponent(status)}` : ""}${tag ? `&tag=${encodeURIComponent(tag)}` : ""}`);
  const options = ["", "running", "finished", "failed", "stalled", "lost"]
    .map((s) => `<option value="${s}" ${s === status ? "selected" : ""}>${s || "any status"}</option>`).join("");
  view.innerHTML = `<h1>Runs</h1>
    <div class="filters"><label>Status <select id="status">${options}</select></label>
      <form id="tag-form"><label>Tag <input id="tag" placeholder="key or key=value" value="${esc(tag)}"></label></form>
      <span class="muted">${page.items.length} run(s)</span></div>
    <table id="runs"><thead><tr><th>Run</th><th>Status</th><th>Health</th><th>Last step</th><th>Open incidents</th>
      <th>Ranks</th><th>Last event</th></tr></thead><tbody>
    ${page.items.map((r) => `<tr><td><a class="run-link" href="#/runs/${encodeURIComponent(r.run_id)}">${esc(r.run_name || r.run_id)}</a>
        <div class="muted">${esc(r.run_id)}</div></td><td>${pill(r.status)}</td><td>${pill(r.health)}</td>
        <td>${r.last_step}</td><td>${r.open_incidents}</td><td>${r.world_size}</td><td>${when(r.last_event_ns)}</td></tr>`).join("")}
    </tbody></table>`;
  const filter = () => {
    const q = new URLSearchParams();
    const s = document.getElementById("status").value, t = document.getElementById("tag").value.trim();
    if (s) q.set("status", s);
    if (t) q.set("tag", t);
    location.hash = q.toString() ? `#/runs?${q}` : "#/runs";
  };
  document.getElementById("status").addEventListener("change", filter);
  document.getElementById("tag-form").addEventListener("submit", (ev) => { ev.preventDefault(); filter(); });
}

const SMOOTH_KEY = "trainguard.smoothing";
const MAX_OVERLAID = 9;            // other runs drawn on a run's charts (10 runs in all)
const chosenMetrics = new Map();   // run id -> the metric names the picker shows (this tab's session)
const chartScales = new Map();     // metric name -> "log" | "linear" chosen on its chart (else: log when it spans 1e3)

// the run's configuration as key -> text: its tags, and what its START event recorded (config, versions, argv)
async function hyperparameters(enc, run) {
  const out = {};
  for (const [k, v] of Object.entries(run.tags || {})) out[`tag ${k}`] = String(v);
  const events = await api(`/api/v1/runs/${enc}/events?kinds=lifecycle&limit=20`).catch(() => ({ items: [] }));
  const start = events.items.map((e) => (e.payload || {}).lifecycle || {}).find((l) => l.phase === "START");
  if (start) {
    const flat = (prefix, obj) => {
      for (const [k, v] of Object.entries(obj || {})) {
        if (v && typeof v === "object" && !Array.isArray(v)) flat(`${prefix}${k}.`, v);
        else out[`${prefix}${k}`] = Array.isArray(v) ? v.join(" ") : String(v);
      }
    };
    flat("config ", start.config);
    for (const k of ["python", "torch", "transformers", "lightning"]) if (start[k]) out[k] = String(start[k]);
    if (start.argv) out.argv = start.argv.join(" ");
  }
  return out;
}

// others: [{label, values}] (the overlaid runs); a row differs when any run's value is not this run's
function hparamTable(mine, others) {
  const keys = [...new Set([mine, ...others.map((o) => o.values)].flatMap((v) => Object.keys(v)))].sort();
  if (!keys.length) return '<p class="muted">The run recorded no tags or config (init(tags=..., config=...)).</p>';
  const cell = (v) => `<td>${esc(v) || '<span class="muted">—</span>'}</td>`;
  const differs = (k) => others.some((o) => (o.values[k] ?? "") !== (mine[k] ?? ""));
  const rows = keys.map((k) => `<tr class="${differs(k) ? "differs" : ""}" data-key="${esc(k)}"><td>${esc(k)}</td>${cell(mine[k] ?? "")}
      ${others.map((o) => cell(o.values[k] ?? "")).join("")}</tr>`).join("");
  return `${others.length ? `<p class="muted" id="hparam-diff-count">${keys.filter(differs).length} of ${keys.length} differ between the runs (highlighted)</p>` : ""}
    <table id="hparams"><thead><tr><th>Key</th><th>This run</th>${others.map((o) => `<th>${esc(o.label)}</th>`).join("")}</tr></thead><tbody>${rows}</tbody></table>`;
}

async function runPage(runId, params) {
  const enc = encodeURIComponent(runId);
  const overlayIds = [...new Set((params.get("overlay") || "").split(",").filter((x) => x && x !== runId))].slice(0, MAX_OVERLAID);
  const [run, incidents, summary, runs] = await Promise.all([
    api(`/api/v1/runs/${enc}`), api(`/api/v1/runs/${enc}/incidents?limit=200`), metricSummary(runId),
    api("/api/v1/runs?limit=200"),
  ]);
  const others = await Promise.all(overlayIds.map((id) => api(`/api/v1/runs/${encodeURIComponent(id)}`)));
  const otherSummary = (await Promise.all(others.map((o) => metricSummary(o.run_id)))).flat();
  const rankFilter = params.get("rank");
  const names = [...new Set(summary.map((s) => s.name).concat(otherSummary.map((s) => s.name)))].sort();
  const defaults = PLOTTED.filter((n) => names.includes(n))
    .concat(names.filter((n) => !PLOTTED.includes(n) && !n.startsWith("grad/layer/") && !n.startsWith("trainguard/")).slice(0, 6));
  if (!chosenMetrics.has(runId)) chosenMetrics.set(runId, defaults);
  const chosen = () => chosenMetrics.get(runId).filter((n) => names.includes(n));
  const markersOf = (items) => items.filter((i) => !i.explained_by && i.first_step >= 0)
    .map((i) => ({ step: i.first_step, label: `${i.category}/${i.subtype}`, color: i.severity === "critical" ? "#b42318" : "#d92d20" }));
  let markers = markersOf(incidents.items), latestIncidents = incidents.items;
  const incidentRows = (items) => items.filter((i) => !i.explained_by).map((i) => `<tr><td><a class="incident-link" href="#/incidents/${encodeURIComponent(i.incident_id)}">${esc(i.title)}</a>
        <div class="muted">${esc(i.category)}/${esc(i.subtype)}</div></td><td>${pill(i.severity)}</td><td>${pill(i.status)}</td>
        <td>${i.first_step}</td><td>${i.lead_rank}</td></tr>`).join("");
  const header = (r) => `${esc(r.run_name || r.run_id)} ${pill(r.status)} ${pill(r.health)}`;
  const facts = (r) => `${esc(r.run_id)} · ${r.world_size} rank(s) · last step <span id="last-step">${r.last_step}</span> · last event ${when(r.last_event_ns)}`;
  const ranks = run.ranks.length ? run.ranks : [0];
  const layers = names.filter((n) => n.startsWith("grad/layer/") && summary.some((s) => s.name === n)).sort().slice(0, HEATMAP_LAYERS);
  const shown = [run, ...others];
  const legendBy = params.get("legend") || "";  // a tag key: the runs named by that tag's value in the legends
  const tagKeys = [...new Set(shown.flatMap((r) => Object.keys(r.tags || {})))].sort();
  const byName = (r) => (r.run_name && shown.filter((x) => x.run_name === r.run_name).length === 1 ? r.run_name : r.run_id);
  const label = (r) => (legendBy && tagKeys.includes(legendBy) ? `${legendBy}=${(r.tags || {})[legendBy] ?? "—"}` : byName(r));
  const smoothing = () => Math.min(0.99, Math.max(0, Number(localStorage.getItem(SMOOTH_KEY) || 0)));
  const wallTime = params.get("x") === "time";  // ?x=time: the charts' x axis is wall time since the first step
  const withParams = (changes) => {
    const q = new URLSearchParams(params);
    for (const [k, v] of Object.entries(changes)) { if (v) q.set(k, v); else q.delete(k); }
    return `#/runs/${enc}${q.toString() ? `?${q}` : ""}`;
  };
  view.innerHTML = `<h1 id="run-header">${header(run)}</h1>
    <div class="muted" id="run-facts">${facts(run)}</div>
    <h2>Incidents</h2>
    <table id="incidents"><thead><tr><th>Incident</th><th>Severity</th><th>Status</th><th>From step</th><th>Lead rank</th></tr></thead>
      <tbody>${incidentRows(incidents.items)}</tbody></table>
    <h2>Metrics</h2>
    <div class="filters toolbar"><label>Rank <select id="rank"><option value="">every rank (overlay)</option>
      ${ranks.map((r) => `<option value="${r}" ${String(r) === rankFilter ? "selected" : ""}>rank ${r}</option>`).join("")}</select></label>
      <label>Compare with <select id="overlay"><option value="">${others.length ? "add another run…" : "no other run"}</option>
        ${runs.items.filter((r) => r.run_id !== runId && !overlayIds.includes(r.run_id)).map((r) => `<option value="${esc(r.run_id)}">${esc(r.run_name || r.run_id)} (${esc(r.run_id)})</option>`).join("")}</select></label>
      ${others.length ? `<label>Legend <select id="legend-by"><option value="">run name</option>
        ${tagKeys.map((k) => `<option value="${esc(k)}" ${k === legendBy ? "selected" : ""}>tag ${esc(k)}</option>`).join("")}</select></label>` : ""}
      <span id="overlaid">${others.map((o) => `<span class="chip">${esc(byName(o))} <button class="remove-overlay" data-run="${esc(o.run_id)}" title="stop comparing">×</button></span>`).join(" ")}</span>
      <label title="exponential moving average, as TensorBoard's; the raw line stays faint behind">Smoothing
        <input id="smoothing" type="range" min="0" max="0.99" step="0.01" value="${smoothing()}"><output id="smoothing-value">${smoothing().toFixed(2)}</output></label>
      <label title="wall time: since the run's first step, summed from its step times (time/step_s)">X axis
        <select id="x-axis"><option value="">step</option><option value="time" ${wallTime ? "selected" : ""}>wall time</option></select></label>
      <button id="zoom-reset" title="every chart back to the whole run">Reset zoom</button>
      <span class="muted" id="live">${run.status === "running" ? "live" : ""}</span></div>
    <details id="picker"><summary>Metrics shown: <span id="picker-count"></span></summary>
      <input id="metric-search" type="search" placeholder="filter metric names" autocomplete="off">
      <button id="metric-show-matching">show only matching</button> <button id="metric-defaults">defaults</button>
      <div id="metric-list">${names.map((n) => `<label class="metric-option" data-name="${esc(n)}"><input type="checkbox" value="${esc(n)}"> ${esc(n)}</label>`).join("")}</div>
    </details>
    <div class="cards" id="cards"></div>
    ${rankHeatmapSection(runId, run.ranks, summary.map((s) => s.name))}
    ${layers.length ? `<h2>Per-layer gradient norms</h2><div class="card"><div class="chart wide" id="layer-heatmap"></div></div>` : ""}
    <h2>Hyperparameters</h2><div id="hparam-panel" class="muted">loading…</div>`;
  document.getElementById("rank").addEventListener("change", (ev) => { location.hash = withParams({ rank: ev.target.value }); });
  document.getElementById("x-axis").addEventListener("change", (ev) => { location.hash = withParams({ x: ev.target.value }); });
  document.getElementById("overlay").addEventListener("change", (ev) => {
    if (overlayIds.length >= MAX_OVERLAID) { ev.target.value = ""; return; }
    location.hash = withParams({ overlay: overlayIds.concat([ev.target.value]).join(",") });
  });
  const legendSelect = document.getElementById("legend-by");
  if (legendSelect) legendSelect.addEventListener("change", (ev) => { location.hash = withParams({ legend: ev.target.value }); });
  document.querySelectorAll(".remove-overlay").forEach((b) => b.addEventListener("click", () => {
    location.hash = withParams({ overlay: overlayIds.filter((x) => x !== b.dataset.run).join(",") });
  }));
  const syncPicker = () => {
    const set = new Set(chosen());
    document.querySelectorAll("#metric-list input").forEach((box) => { box.checked = set.has(box.value); });
    document.getElementById("picker-count").textContent = `${set.size} of ${names.length}`;
  };
  const matching = () => {
    const q = document.getElementById("metric-search").value.trim().toLowerCase();
    return names.filter((n) => n.toLowerCase().includes(q));
  };
  document.getElementById("metric-search").addEventListener("input", () => {
    const shown = new Set(matching());
    document.querySelectorAll("#metric-list .metric-option").forEach((el) => { el.hidden = !shown.has(el.dataset.name); });
  });
  const choose = (list) => { chosenMetrics.set(runId, list); syncPicker(); draw().catch(showError); };
  document.getElementById("metric-list").addEventListener("change", (ev) => {
    const n = ev.target.value;
    choose(ev.target.checked ? chosen().concat([n]) : chosen().filter((x) => x !== n));
  });
  document.getElementById("metric-show-matching").addEventListener("click", () => choose(matching().slice(0, 24)));
  document.getElementById("metric-defaults").addEventListener("click", () => choose(defaults));
  syncPicker();
  document.getElementById("smoothing").addEventListener("input", (ev) => {
    localStorage.setItem(SMOOTH_KEY, ev.target.value);
    document.getElementById("smoothing-value").textContent = Number(ev.target.value).toFixed(2);
    render();
  });
  document.getElementById("zoom-reset").addEventListener("click", () => {
    const first = charts.find((c) => c.group === ZOOM_GROUP);
    if (first) first.dispatchAction({ type: "dataZoom", start: 0, end: 100 });
  });
  const showError = (err) => { document.getElementById("cards").innerHTML = `<p class="error">${esc(err.message)}</p>`; };
  let data = null, otherData = [];
  const points = Math.min(MAX_POINTS, Math.max(2, Number(params.get("points")) || MAX_POINTS));  // ?points=: coarser
  const fetchSeries = (e, chosenNames) => {
    const list = wallTime && !chosenNames.includes(STEP_TIME) ? chosenNames.concat([STEP_TIME]) : chosenNames;
    return api(`/api/v1/runs/${e}/metrics?names=${namesParam(list)}&max_points=${points}${rankFilter ? `&rank=${rankFilter}` : ""}`);
  };
  const render = () => {
    for (let i = charts.length - 1; i >= 0; i--) if (charts[i].group === ZOOM_GROUP) charts.splice(i, 1)[0].dispose();
    const list = chosen();
    const cards = document.getElementById("cards");
    cards.innerHTML = list.map((n, i) => `<div class="card"><button class="scale-toggle" data-scale-for="${esc(n)}"
        title="log or linear y axis">${esc(chartScales.get(n) === "log" ? "linear" : chartScales.get(n) === "linear" ? "log" : "log/linear")}</button>
        <div class="chart" id="chart-${i}" data-metric="${esc(n)}"></div></div>`).join("")
      || '<p class="muted">No metric chosen: pick some above.</p>';
    if (!data) return;
    const untimed = new Set();  // runs without step times: not drawn on a wall-time axis
    const clock0 = wallTime ? stepClock(data, rankFilter || String(ranks[0])) : null;
    const shownMarkers = !wallTime ? markers : clock0 ? markers.map((m) => ({ ...m, step: clock0(m.step) })) : [];
    list.forEach((name, i) => {
      const series = [];
      const add = (d, who, dashed) => {
        for (const [rank, buckets] of Object.entries((d.series || {})[name] || {})) {
          const clock = wallTime ? stepClock(d, rank) : (step) => step;
          if (!clock) { untimed.add(who); continue; }
          // one point a step: its value; a bucket of several steps: their mean, in a min..max band
          const downsampled = buckets.some((b) => b.count > 1);
          series.push({ name: others.length ? `${who} · rank ${rank}` : `rank ${rank}`, dashed,
            data: buckets.map((b) => [clock(b.step_end), num(downsampled ? b.mean : b.max)]),
            band: downsampled ? buckets.map((b) => [clock(b.step_end), num(b.min), num(b.max)]) : null });
        }
      };
      add(data, label(run), false);
      others.forEach((o, j) => add(otherData[j], label(o), true));
      const c = chart(document.getElementById(`chart-${i}`), name, series, shownMarkers,
        { smoothing: smoothing(), group: ZOOM_GROUP, scale: chartScales.get(name), time: wallTime });
      const button = document.querySelector(`#cards .card:nth-child(${i + 1}) .scale-toggle`);
      const isLog = c && c.getOption().yAxis[0].type === "log";
      const positive = series.some((x) => x.data.length) && series.every((x) => x.data.every((p) => !Number.isFinite(p[1]) || p[1] > 0));
      if (button) { button.textContent = isLog ? "linear" : "log"; button.disabled = !isLog && !positive; }
      if (button && button.disabled) button.title = "a log axis needs every value > 0";
      if (button) button.onclick = () => { chartScales.set(name, isLog ? "linear" : "log"); render(); };
    });
    if (typeof echarts !== "undefined") echarts.connect(ZOOM_GROUP);
    if (untimed.size) cards.insertAdjacentHTML("afterbegin", `<p class="muted" id="untimed">Not on the wall-time axis (no
      ${STEP_TIME} recorded): ${[...untimed].map(esc).join(", ")}</p>`);
  };
  const draw = async () => {
    const list = chosen();
    [data, ...otherData] = list.length
      ? await Promise.all([fetchSeries(enc, list), ...others.map((o) => fetchSeries(encodeURIComponent(o.run_id), list))])
      : [{ series: {} }, ...others.map(() => ({ series: {} }))];
    render();
  };
  const drawAll = async () => {
    await draw();
    await rankHeatmap(enc, run, latestIncidents);
    if (layers.length) await heatmap(enc, layers, rankFilter || String(ranks[0]));
  };
  await drawAll();
  const [mine, ...theirs] = await Promise.all([run, ...others].map((r) => hyperparameters(encodeURIComponent(r.run_id), r)));
  const panel = document.getElementById("hparam-panel");
  panel.classList.remove("muted");
  panel.innerHTML = hparamTable(mine, others.map((o, j) => ({ label: byName(o), values: theirs[j] })));
  view.dataset.charts = "drawn";
  if (run.status !== "running") return;
  // live: the server pushes the run and its incidents as they change; plots redraw at most every REFRESH_MS
  let lastDraw = Date.now(), pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    setTimeout(() => { pending = false; lastDraw = Date.now(); drawAll().catch(() => {}); }, Math.max(0, REFRESH_MS - (Date.now() - lastDraw)));
  };
  stream(`/api/v1/runs/${enc}/stream`, (event, data) => {
    if (event === "run") {
      document.getElementById("run-header").innerHTML = header(data);
      document.getElementById("run-facts").innerHTML = facts(data);
      document.getElementById("live").textContent = data.status === "running" ? "live" : "";
      redraw();
    } else if (event === "incidents") {
      document.querySelector("#incidents tbody").innerHTML = incidentRows(data);
      markers = markersOf(data);
      latestIncidents = data;
      redraw();
    }
  }).catch(() => {});
}

async function heatmap(enc, layers, rank) {
  // steps x layers, colour = log10 of the bucket's largest norm: an exploding or dead layer stands out
  const data = await api(`/api/v1/runs/${enc}/metrics?names=${namesParam(layers)}&rank=${rank}&max_points=${HEATMAP_POINTS}`);
  const steps = [...new Set(layers.flatMap((n) => ((data.series[n] || {})[rank] || []).map((b) => b.step_end)))].sort((a, b) => a - b);
  const cells = [];
  let lo = Infinity, hi = -Infinity;
  layers.forEach((name, y) => {
    for (const b of (data.series[name] || {})[rank] || []) {
      const v = num(b.max);
      const z = Number.isFinite(v) && v > 0 ? Math.log10(v) : (Number.isFinite(v) ? -12 : 12);
      lo = Math.min(lo, z); hi = Math.max(hi, z);
      cells.push([steps.indexOf(b.step_end), y, z]);
    }
  });
  const el = document.getElementById("layer-heatmap");
  if (typeof echarts === "undefined" || !el) return;
  const c = freshChart(el);
  c.setOption({
    animation: false,
    tooltip: { formatter: (p) => `${esc(layers[p.value[1]])}<br>step ${steps[p.value[0]]}: 10^${p.value[2].toFixed(2)}` },
    grid: { left: 220, right: 80, top: 10, bottom: 40 },
    xAxis: { type: "category", data: steps, name: "step" },
    yAxis: { type: "category", data: layers.map((n) => n.slice("grad/layer/".length)) },
    visualMap: { min: lo, max: hi, calculable: true, orient: "vertical", right: 0, top: "middle", text: ["log10 high", "low"] },
    series: [{ type: "heatmap", data: cells }],
  });
}

async function clustersPage() {
  const page = await api("/api/v1/clusters?limit=200");
  view.innerHTML = `<h1>Clusters</h1><p class="muted">Exceptions grouped by stack fingerprint across runs and ranks.</p>
    <table id="clusters"><thead><tr><th>Exception</th><th>Count</th><th>Runs</th><th>Ranks</th><th>Hosts</th><th>First seen</th><th>Last seen</th></tr></thead><tbody>
    ${page.items.map((c) => `<tr><td><a class="cluster-link" href="#/clusters/${encodeURIComponent(c.fingerprint)}">${esc(c.exc_type)}</a>
      <div class="muted">${esc(c.message_template).slice(0, 160)}</div></td><td>${c.count}</td><td>${c.runs.length}</td>
      <td>${c.ranks.length}</td><td>${c.hosts.map(esc).join(", ")}</td><td>${when(c.first_ns)}</td><td>${when(c.last_ns)}</td></tr>`).join("")}
    </tbody></table>`;
}

async function clusterPage(fingerprint) {
  const c = await api(`/api/v1/clusters/${encodeURIComponent(fingerprint)}`);
  const sample = c.sample || {};
  const frames = (sample.frames || []).map((f) => `<tr class="${f.in_app ? "in-app" : ""}"><td>${f.in_app ? "<mark>app</mark>" : "lib"}</td>
      <td>${esc(f.function)}</td><td>${esc(f.filename)}:${f.lineno}</td><td><code>${esc(f.context_line)}</code></td></tr>`).join("");
  view.innerHTML = `<h1 id="cluster-title">${esc(c.exc_type)}</h1>
    <div class="muted">fingerprint ${esc(c.fingerprint)} (${esc(c.fingerprint_version)}) · ${c.count} occurrence(s)</div>
    <p>${esc(c.message_template)}</p>
    <div class="kv"><span class="muted">first / last seen</span><span>${when(c.first_ns)} / ${when(c.last_ns)}</span>
      <span class="muted">runs</span><span>${c.runs.map((r) => `<a href="#/runs/${encodeURIComponent(r)}">${esc(r)}</a>`).join(", ")}</span>
      <span class="muted">ranks</span><span>${c.ranks.map(esc).join(", ")}</span>
      <span class="muted">hosts</span><span>${c.hosts.map(esc).join(", ")}</span></div>
    <h2>Sample: innermost frames</h2>
    <p class="muted">Frames marked <mark>app</mark> are your code: they make the fingerprint (library frames do not).</p>
    <table id="frames"><thead><tr><th></th><th>Function</th><th>Where</th><th>Line</th></tr></thead><tbody>${frames}</tbody></table>
    <h2>Sample traceback</h2><pre id="sample-traceback">${esc(sample.traceback || "")}</pre>`;
}

async function incidentPage(incidentId) {
  const inc = await api(`/api/v1/incidents/${encodeURIComponent(incidentId)}`);
  const evidenceRows = inc.evidence.map((e) => `<li><b>${esc(e.rule)}</b> <span class="muted">rank ${e.rank}, step ${e.step}</span><br>${esc(e.description)}</li>`).join("");
  const hypotheses = (inc.hypotheses || []).map((h) => `<li><b>${Math.round(100 * h.confidence)}%</b> ${esc(h.cause)}
      <div class="muted">${(h.why || []).map(esc).join("; ")}</div></li>`).join("");
  view.innerHTML = `<h1 id="incident-title">${esc(inc.title)}</h1>
    <div>${pill(inc.severity)} <span id="incident-status">${pill(inc.status)}</span> <span class="muted">${esc(inc.category)}/${esc(inc.subtype)} ·
      run <a href="#/runs/${encodeURIComponent(inc.run_id)}">${esc(inc.run_id)}</a></span></div>
    <h2>Summary</h2><p id="incident-summary">${esc(inc.summary)}</p>
    <div id="incident-exception"></div>
    <div id="incident-ranks"></div>
    <div class="kv"><span class="muted">began</span><span>step ${inc.first_step}, ${when(inc.first_ns)}</span>
      <span class="muted">lead rank</span><span>${inc.lead_rank} (ranks ${inc.ranks.join(", ")})</span>
      <span class="muted">consequences</span><span>${(inc.consequences || []).map(esc).join("; ") || "—"}</span>
      <span class="muted">fingerprint</span><span>${inc.fingerprint ? `<a href="#/clusters/${encodeURIComponent(inc.fingerprint)}">${esc(inc.fingerprint)}</a>` : "—"}</span></div>
    <div class="card"><div class="chart wide" id="evidence-chart"></div></div>
    <h2>Workflow</h2><div class="card" id="workflow"></div>
    <h2>Root-cause hypotheses</h2><ol id="hypotheses">${hypotheses || '<li class="muted">none</li>'}</ol>
    <h2>What to check first</h2><ol id="checks">${inc.checks.map((c) => `<li>${esc(c)}</li>`).join("")}</ol>
    <h2>Evidence</h2><ul class="plain" id="evidence">${evidenceRows}</ul>
    <h2>Timeline</h2><ul class="plain">${inc.timeline.map((t) => `<li><span class="muted">${when(t.time_ns)} · step ${t.step} · rank ${t.rank}</span> ${esc(t.what)}</li>`).join("")}</ul>`;
  await exceptionPanel(inc);
  await rankComparison(inc);
  await workflowPanel(inc);
  // the evidence window: the run's loss and gradient norm around the onset
  const lo = Math.max(0, inc.first_step - 100), hi = Math.max(inc.last_step, inc.first_step) + 20;
  const data = await api(`/api/v1/runs/${encodeURIComponent(inc.run_id)}/metrics?names=loss,grad/global_norm&start_step=${lo}&end_step=${hi}&max_points=${MAX_POINTS}`);
  const series = [];
  for (const [name, byRank] of Object.entries(data.series)) {
    for (const [rank, buckets] of Object.entries(byRank)) series.push({ name: `${name} (rank ${rank})`, data: buckets.map((b) => [b.step_end, num(b.max)]) });
  }
  chart(document.getElementById("evidence-chart"), "evidence window", series, inc.first_step >= 0 ? [{ step: inc.first_step, label: "onset", color: "#b42318" }] : []);
}

// a crash: the exception event the incident rests on (its evidence names it; else the run's first one), with
// its frames (yours marked) and the traceback's text, as the SDK captured them. The evidence's events are read
// by id: a page of the run's exceptions ends at the API's byte bound, so the one named may be on any page.
const EVIDENCE_READS = 8;
async function exceptionPanel(inc) {
  const ids = [...new Set(inc.evidence.map((e) => e.event_id).filter(Boolean))].slice(0, EVIDENCE_READS);
  if (!ids.length && !inc.fingerprint) return;
  const run = `/api/v1/runs/${encodeURIComponent(inc.run_id)}`;
  const named = await Promise.all(ids.map((id) => api(`${run}/events/${encodeURIComponent(id)}`).catch((err) => {
    if (err instanceof AuthError) throw err;
    return null;  // not stored as an event (a metric point's evidence) or gone: the next one
  })));
  let event = named.find((e) => e && e.kind === "exception") || null;
  if (!event && inc.fingerprint) event = (await api(`${run}/events?kinds=exception&limit=1`)).items[0] || null;
  if (!event) return;
  const exc = (event.payload || {}).exception || {};
  const frames = (exc.frames || []).map((f) => `<tr class="${f.in_app ? "in-app" : ""}"><td>${f.in_app ? "<mark>app</mark>" : "lib"}</td>
      <td>${esc(f.function)}</td><td>${esc(f.filename)}:${f.lineno}</td><td><code>${esc(f.context_line || "")}</code></td></tr>`).join("");
  document.getElementById("incident-exception").innerHTML = `<h2>Traceback</h2>
    <p class="muted">rank ${event.rank} · step ${event.step} · ${esc(event.host)} · ${when(event.time_ns)}. Frames marked <mark>app</mark> are your code; the innermost is last.</p>
    ${frames ? `<table id="incident-frames"><thead><tr><th></th><th>Function</th><th>Where</th><th>Line</th></tr></thead><tbody>${frames}</tbody></table>` : ""}
    <pre id="incident-traceback">${esc(event.text)}</pre>`;
}

const NAME_KEY = "trainguard.name";

async function workflowPanel(inc) {
  const base = `/api/v1/incidents/${encodeURIComponent(inc.incident_id)}`;
  const render = (data) => {
    const w = data.workflow;
    const state = w.resolved_ns ? `Resolved by ${esc(w.resolved_by)} (${when(w.resolved_ns)}): <b id="root-cause">${esc(w.root_cause)}</b>`
      : w.acknowledged_ns ? `Acknowledged by ${esc(w.acknowledged_by)} (${when(w.acknowledged_ns)})` : "Nobody has taken it yet.";
    document.getElementById("workflow").innerHTML = `<p id="workflow-state">${state}</p>
      <div class="filters"><label>Your name <input id="wf-name" value="${esc(localStorage.getItem(NAME_KEY) || "")}"></label>
        <button id="wf-ack" ${w.acknowledged_ns ? "disabled" : ""}>Acknowledge</button></div>
      <div class="filters"><input id="wf-cause" placeholder="the root cause you confirmed" size="60">
        <button id="wf-resolve">Resolve</button></div>
      <div class="filters"><input id="wf-note" placeholder="a note" size="60"><button id="wf-add-note">Add note</button></div>
      <ul class="plain" id="wf-notes">${w.notes.map((n) => `<li><span class="muted">${esc(n.by)} · ${when(n.time_ns)}</span> ${esc(n.text)}</li>`).join("")}</ul>
      <h3>Root causes confirmed before for ${esc(inc.category)}/${esc(inc.subtype)}</h3>
      <ol id="confirmed">${data.confirmed_causes.map((c) => `<li><b>${esc(c.root_cause)}</b>
        <span class="muted">${c.count}x${c.same_fingerprint ? `, ${c.same_fingerprint}x with this stack` : ""}, last ${when(c.last_resolved_ns)}</span></li>`).join("") || '<li class="muted">none yet: resolving this incident starts the library</li>'}</ol>
      <h3>Similar incidents, resolved</h3>
      <ul class="plain" id="similar">${data.similar.map((x) => `<li><a href="#/incidents/${encodeURIComponent(x.incident_id)}">${esc(x.title || x.incident_id)}</a>
        <span class="muted">run ${esc(x.run_id)}</span><br>root cause: <b>${esc(x.root_cause)}</b></li>`).join("") || '<li class="muted">none yet</li>'}</ul>
      <p class="error" id="wf-error"></p>`;
    const by = () => { const v = document.getElementById("wf-name").value.trim(); localStorage.setItem(NAME_KEY, v); return v; };
    const act = (path, body) => post(`${base}/${path}`, body).then(render).catch((err) => {
      document.getElementById("wf-error").textContent = err.message;
    });
    document.getElementById("wf-ack").onclick = () => act("acknowledge", { by: by() });
    document.getElementById("wf-resolve").onclick = () => act("resolve", { by: by(), root_cause: document.getElementById("wf-cause").value })
      .then(() => api(base)).then((now) => {  // the status as the API now says it (resolved, by a person)
        const el = document.getElementById("incident-status");
        if (el && now) el.innerHTML = pill(now.status);
      }).catch(() => {});
    document.getElementById("wf-add-note").onclick = () => act("notes", { by: by(), text: document.getElementById("wf-note").value });
  };
  render(await api(`${base}/workflow`));
}

async function searchPage(params) {
  const q = params.get("q") || "";
  document.getElementById("search-box").value = q;
  if (!q) { view.innerHTML = "<h1>Search</h1><p class='muted'>Type in the search box: exception types, messages, NCCL lines…</p>"; return; }
  const page = await api(`/api/v1/search?q=${encodeURIComponent(q)}&limit=50`);
  view.innerHTML = `<h1>Search: ${esc(q)}</h1><p class="muted">${page.items.length} hit(s)</p>
    <ul class="plain" id="hits">${page.items.map((h) => `<li><a href="#/runs/${encodeURIComponent(h.event.run_id)}">${esc(h.event.run_id)}</a>
      <span class="muted">rank ${h.event.rank} · step ${h.event.step} · ${esc(h.event.kind)} · ${when(h.event.time_ns)}</span>
      <pre>${esc(h.event.text).slice(0, 4000)}</pre></li>`).join("")}</ul>`;
}

// ---------------------------------------------------------------------------------------------- router
let routeGeneration = 0;            // a route whose page was left while it loaded must not mark the view loaded

async function route() {
  const generation = ++routeGeneration;
  clearPage();
  document.getElementById("logout").hidden = !localStorage.getItem(TOKEN_KEY);
  const [path, query] = (location.hash.slice(1) || "/runs").split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  try {
    if (parts[0] === "runs" && parts[1]) await runPage(parts[1], params);
    else if (parts[0] === "incidents" && parts[1]) await incidentPage(parts[1]);
    else if (parts[0] === "search") await searchPage(params);
    else if (parts[0] === "clusters" && parts[1]) await clusterPage(parts[1]);
    else if (parts[0] === "clusters") await clustersPage();
    else await runsPage(params);
    if (generation !== routeGeneration) return;
    view.dataset.loaded = location.hash || "#/runs";
    const login = document.getElementById("login");
    if (login.open) login.close();  // a token given meanwhile (another tab, a script) answered
  } catch (err) {
    if (err instanceof AuthError) { askToken(err.message === "no token" ? "" : err.message); return; }
    view.innerHTML = `<p class="error">${esc(err.message)}</p>`;
  }
}

window.addEventListener("hashchange", route);
route();
