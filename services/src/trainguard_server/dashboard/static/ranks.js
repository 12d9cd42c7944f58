// Per-rank step time (issue 23): the run page's heatmap (ranks x steps, colour = time per step) and a perf
// incident's rank against the others (a chart and a table of medians). Loaded before app.js, whose helpers
// (api, namesParam, num, esc, chart, charts, darkTheme) it calls.
//
// What is measured, per rank and step, from the metrics the SDK records (bucket means when downsampled):
//   own work     time/data_s + time/forward_s + time/optimizer_s: the rank's own time, without the wait inside
//                backward's collectives -- what tells a straggler apart, since every rank's step time is the
//                slowest rank's once they synchronise (the perf/straggler detector measures the same)
//   step time    time/step_s (boundary to boundary), and each phase on its own
"use strict";

const OWN_WORK = "own";
const OWN_PHASES = ["time/data_s", "time/forward_s", "time/optimizer_s"];
const RANK_MEASURES = [
  [OWN_WORK, "own work (data + forward + optimizer)"], ["time/step_s", "step time"], ["time/data_s", "data wait"],
  ["time/forward_s", "forward"], ["time/backward_s", "backward (with its collectives)"], ["time/optimizer_s", "optimizer"],
];
const RANK_HEATMAP_POINTS = 200;   // step buckets of the per-rank heatmap
const RANK_HEATMAP_RANKS = 256;    // ranks shown (the first, by number)
const rankMeasureChosen = new Map();  // run id -> the measure its heatmap shows (this tab's session)

// the measures a run can be shown by, among the metric names it has: [[value, label]...]
function rankMeasures(names) {
  return RANK_MEASURES.filter(([m]) => names.includes(m === OWN_WORK ? "time/forward_s" : m));
}

const measureNames = (measure) => (measure === OWN_WORK ? OWN_PHASES : [measure]);

// one /metrics answer -> {rank: [[step, seconds]...]} for ``measure``; own work: at each step of the rank's
// forward series, the sum of the three phases' bucket means there (a phase missing at a step adds nothing)
function perRankSeconds(data, measure) {
  const series = data.series || {};
  const base = measure === OWN_WORK ? "time/forward_s" : measure;
  const out = {};
  for (const rank of Object.keys(series[base] || {})) {
    const steps = new Map(((series[base] || {})[rank] || []).map((b) => [b.step_end, 0]));
    for (const name of measureNames(measure)) {
      for (const b of (series[name] || {})[rank] || []) {
        const v = num(b.mean);
        if (steps.has(b.step_end) && Number.isFinite(v)) steps.set(b.step_end, steps.get(b.step_end) + v);
      }
    }
    out[rank] = [...steps.entries()].sort((a, b) => a[0] - b[0]);
  }
  return out;
}

function median(values) {
  const s = values.filter((v) => Number.isFinite(v)).sort((a, b) => a - b);
  if (!s.length) return NaN;
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

const ms = (seconds) => `${(seconds * 1000).toPrecision(3)} ms`;

// the straggler ranks named by the run's standing perf/straggler incidents
function stragglerRanks(incidents) {
  return new Set(incidents.filter((i) => i.category === "perf" && i.subtype === "straggler" && !i.explained_by)
    .map((i) => i.lead_rank));
}

// the run page's section (empty for a single-rank run or one without step timings)
function rankHeatmapSection(runId, ranks, names) {
  const measures = rankMeasures(names);
  if (ranks.length < 2 || !measures.length) return "";
  const chosen = rankMeasureChosen.get(runId) || measures[0][0];
  return `<h2 id="rank-heatmap-title">Per-rank step time</h2>
    <div class="filters toolbar"><label>Colour by <select id="rank-heatmap-measure">${measures.map(([m, label]) =>
      `<option value="${esc(m)}" ${m === chosen ? "selected" : ""}>${esc(label)}</option>`).join("")}</select></label>
      <span class="muted">one row per rank; a straggler's row stands out in own work (every rank's step time is the slowest one's)</span></div>
    <div class="card"><div class="chart wide" id="rank-heatmap"></div></div>`;
}

// draws #rank-heatmap (when the page has it); the select redraws it with another measure
async function rankHeatmap(enc, run, incidents) {
  const el = document.getElementById("rank-heatmap");
  const select = document.getElementById("rank-heatmap-measure");
  if (!el || !select) return;
  select.onchange = () => { rankMeasureChosen.set(run.run_id, select.value); rankHeatmap(enc, run, incidents).catch(() => {}); };
  const measure = select.value;
  const data = await api(`/api/v1/runs/${enc}/metrics?names=${namesParam(measureNames(measure))}`
    + `&start_step=0&end_step=${Math.max(0, run.last_step)}&max_points=${RANK_HEATMAP_POINTS}`);
  const byRank = perRankSeconds(data, measure);
  const ranks = Object.keys(byRank).map(Number).sort((a, b) => a - b).slice(0, RANK_HEATMAP_RANKS);
  const steps = [...new Set(ranks.flatMap((r) => byRank[r].map((p) => p[0])))].sort((a, b) => a - b);
  const column = new Map(steps.map((s, i) => [s, i]));
  const cells = [];
  ranks.forEach((r, y) => byRank[r].forEach(([step, sec]) => cells.push([column.get(step), y, sec * 1000])));
  const values = cells.map((c) => c[2]);
  const stragglers = stragglerRanks(incidents);
  if (typeof echarts === "undefined") return;
  el.style.height = `${Math.max(220, Math.min(900, 22 * ranks.length + 60))}px`;  // a row per rank stays readable
  const c = freshChart(el);
  c.setOption({
    animation: false,
    backgroundColor: "transparent",
    tooltip: { formatter: (p) => `rank ${ranks[p.value[1]]} · step ${steps[p.value[0]]}: ${p.value[2].toPrecision(3)} ms` },
    grid: { left: 130, right: 90, top: 10, bottom: 44 },
    xAxis: { type: "category", data: steps, name: "step", nameLocation: "middle", nameGap: 26 },
    yAxis: { type: "category", inverse: true, data: ranks.map((r) => `rank ${r}${stragglers.has(r) ? " · straggler" : ""}`),
      axisLabel: { color: (label) => (String(label).includes("straggler") ? "#d92d20" : darkTheme() ? "#b9b8ce" : "#6e7079") } },
    visualMap: { min: values.length ? Math.min(...values) : 0, max: values.length ? Math.max(...values) : 1, calculable: true,
      orient: "vertical", right: 0, top: "middle", itemHeight: 90, text: ["ms  slow", "fast"], inRange: { color: ["#f7fbff", "#6baed6", "#08306b"] } },
    series: [{ type: "heatmap", data: cells }],
  });
  el.dataset.measure = measure;
}

// a perf incident of a multi-rank run: its rank against the others -- each rank's own work (else step time)
// around the incident, the incident's rank drawn red; a table of each rank's median over the incident's steps
// and its ratio to the median of the other ranks' medians
async function rankComparison(inc) {
  const box = document.getElementById("incident-ranks");
  if (!box || inc.category !== "perf") return;
  const enc = encodeURIComponent(inc.run_id);
  const run = await api(`/api/v1/runs/${enc}`);
  if ((run.ranks || []).length < 2) return;
  const from = Math.max(0, inc.first_step), to = Math.max(inc.last_step, inc.first_step);
  const lo = Math.max(0, from - 30), hi = to + 10;
  const data = await api(`/api/v1/runs/${enc}/metrics?names=${namesParam(OWN_PHASES.concat(["time/step_s"]))}`
    + `&start_step=${lo}&end_step=${hi}&max_points=${RANK_HEATMAP_POINTS}`);
  const measure = Object.keys((data.series || {})["time/forward_s"] || {}).length ? OWN_WORK : "time/step_s";
  const byRank = perRankSeconds(data, measure);
  const ranks = Object.keys(byRank).map(Number).sort((a, b) => a - b);
  if (ranks.length < 2) return;
  const medians = new Map(ranks.map((r) => [r, median(byRank[r].filter(([s]) => s >= from && s <= to).map((p) => p[1]))]));
  const ratio = (r) => medians.get(r) / median(ranks.filter((x) => x !== r).map((x) => medians.get(x)));
  const label = measure === OWN_WORK ? "own work per step (data + forward + optimizer)" : "step time";
  box.innerHTML = `<h2>Rank ${inc.lead_rank} against the other ranks</h2>
    <p class="muted">${esc(label)}, each rank; the median over the incident's steps ${from}–${to}, and its ratio to the median of the other ranks.</p>
    <table id="rank-compare"><thead><tr><th>Rank</th><th>Median</th><th>× the others</th></tr></thead><tbody>
    ${ranks.map((r) => `<tr class="${r === inc.lead_rank ? "lead" : ""}" data-rank="${r}" data-median="${medians.get(r)}" data-ratio="${ratio(r)}">
      <td>rank ${r}${r === inc.lead_rank ? " (this incident)" : ""}</td><td>${ms(medians.get(r))}</td><td>${ratio(r).toFixed(2)}×</td></tr>`).join("")}
    </tbody></table>
    <div class="card"><div class="chart wide" id="rank-compare-chart"></div></div>`;
  const series = ranks.map((r) => ({ name: `rank ${r}`, color: r === inc.lead_rank ? "#d92d20" : "#9ca3af",
    data: byRank[r].map(([s, v]) => [s, v * 1000]) }));
  chart(document.getElementById("rank-compare-chart"), `rank ${inc.lead_rank} (red) and the others, ms`, series,
    inc.first_step >= 0 ? [{ step: inc.first_step, label: "onset", color: "#b42318" }] : [], { scale: "linear" });
}
