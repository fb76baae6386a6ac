// The four views: jobs, one job, devices, volunteer runs. Each is a function of the page's
// state that returns fresh DOM; app.js decides when to draw it again.

import { badge, bytes, clock, duration, h, num, progress, short, table, when } from "./dom.js";
import { lineChart, participationGrid, sparkline, stackedBars } from "./charts.js";

const LIVE_STATES = new Set(["pending", "running"]);

function jobLink(job) {
  return h("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name || job.id);
}

function metric(job, key) {
  const v = job.metrics ? job.metrics[key] : undefined;
  return typeof v === "number" ? num(v) : "–";
}

function trend(rounds) {
  const key = rounds.some((r) => typeof r.metrics.accuracy === "number") ? "accuracy" : "loss";
  const values = rounds.map((r) => r.metrics[key]).filter((v) => typeof v === "number");
  return sparkline(values.slice(-60), `${key} over the last ${Math.min(values.length, 60)} rounds`);
}

export function jobsView(ctx) {
  const { state } = ctx;
  const rows = state.jobs.map((job) =>
    h("tr", { dataset: { job: job.id } },
      h("td", {}, jobLink(job), h("div", { class: "muted small" }, job.id)),
      h("td", {}, badge(job.state)),
      h("td", {}, progress(job.rounds_committed, job.rounds_total, `${job.name} progress`)),
      h("td", { class: "num" }, metric(job, "accuracy")),
      h("td", { class: "num" }, metric(job, "loss")),
      h("td", {}, trend(state.rounds.get(job.id) || [])),
      h("td", { class: "small" }, job.task),
      h("td", { class: "small" }, when(job.updated_at, state.source))));
  return h("section", { "aria-labelledby": "jobs-title" },
    h("h1", { id: "jobs-title" }, "Jobs"),
    state.jobs.length === 0
      ? h("p", { class: "empty" }, state.source === "simulation"
        ? "No jobs yet: the simulation has not written jobs.json or a round."
        : "No jobs yet: submit one with flotilla job submit.")
      : table("Jobs", ["Job", "State", "Progress", "Accuracy", "Loss", "Trend", "Task",
        "Updated"], rows));
}

function series(rounds, key, x) {
  return rounds
    .filter((r) => typeof r.metrics[key] === "number")
    .map((r) => [x(r), r.metrics[key]]);
}

function title(key) {
  return key.charAt(0).toUpperCase() + key.slice(1);
}

function metricCharts(job, rounds) {
  const t0 = rounds.length ? Math.min(rounds[0].started_at, rounds[0].committed_at) : 0;
  const byRound = (r) => r.round;
  const byTime = (r) => r.committed_at - t0;
  const charts = [];
  for (const [key, cls] of [["accuracy", "s1"], ["loss", "s2"]]) {
    if (!rounds.some((r) => typeof r.metrics[key] === "number")) continue;
    charts.push(
      lineChart({ name: `${key}-round`, title: `${title(key)} by round`, xLabel: "round",
        series: [{ label: key, cls, points: series(rounds, key, byRound) }], xInteger: true,
        xFormat: (v) => String(Math.round(v)), yFormat: short }),
      lineChart({ name: `${key}-time`, title: `${title(key)} over time`,
        xLabel: "time since the first round started",
        series: [{ label: key, cls, points: series(rounds, key, byTime) }],
        xFormat: duration, yFormat: short }),
    );
  }
  if (charts.length === 0) charts.push(h("p", { class: "empty" }, "No metrics yet."));
  return charts;
}

function timeline(rounds) {
  return stackedBars({
    name: "timeline", title: "Round timeline: selected = delivered + failed + stale",
    parts: [{ label: "delivered", cls: "ok" }, { label: "failed", cls: "fail" },
      { label: "stale", cls: "stale" }],
    bars: rounds.map((r) => ({ x: r.round, parts: [r.participants.length, r.failures.length,
      r.stale.length] })),
    xLabel: "round", xFormat: (v) => String(Math.round(v)), yFormat: (v) => num(v, 0),
  });
}

function bytesChart(rounds) {
  return lineChart({ name: "bytes", title: "Bytes per round", xLabel: "round", xInteger: true,
    series: [
      { label: "up (updates)", cls: "s1", points: rounds.map((r) => [r.round, r.bytes_up]) },
      { label: "down (model)", cls: "s3", points: rounds.map((r) => [r.round, r.bytes_down]) },
    ],
    xFormat: (v) => String(Math.round(v)), yFormat: bytes });
}

function decisions(rounds) {
  const latest = rounds.slice(-20).reverse();
  return h("section", { class: "panel", "aria-labelledby": "decisions-title" },
    h("h2", { id: "decisions-title" }, "Scheduler decisions"),
    latest.length === 0 ? h("p", { class: "empty" }, "No rounds yet.")
      : h("ol", { class: "decisions", reversed: true },
        latest.map((r) => h("li", { value: r.round },
          h("strong", {}, `Round ${r.round}: `),
          r.decisions.length ? r.decisions.join("; ") : "no decision recorded"))));
}

function roundsTable(rounds, source) {
  const rows = rounds.slice(-200).reverse().map((r) =>
    h("tr", {},
      h("td", { class: "num" }, r.round),
      h("td", {}, source === "simulation" ? `t=${duration(r.committed_at)}` : clock(r.committed_at)),
      h("td", { class: "num" }, duration(r.committed_at - r.started_at)),
      h("td", { class: "num" }, num(r.metrics.accuracy)),
      h("td", { class: "num" }, num(r.metrics.loss)),
      h("td", { class: "num" }, `${r.participants.length} / ${r.selected.length}`),
      h("td", { class: "small" }, r.failures.map((f) => `${f.device_id}: ${f.reason}`).join(", ")),
      h("td", { class: "num" }, r.stale.length),
      h("td", { class: "num" }, bytes(r.bytes_up)),
      h("td", { class: "num" }, bytes(r.bytes_down))));
  return table("Rounds, newest first", ["Round", "Committed", "Took", "Accuracy", "Loss",
    "Delivered / selected", "Failures", "Stale", "Up", "Down"], rows);
}

function cancelControls(ctx, job) {
  const { state } = ctx;
  if (state.scope !== "operator" || state.source !== "server" || !LIVE_STATES.has(job.state)) {
    return null;
  }
  if (state.confirmCancel !== job.id) {
    return h("button", { type: "button", class: "danger", id: "cancel-job",
      "data-action": "ask-cancel", "data-job": job.id }, "Cancel job");
  }
  return h("div", { class: "confirm", role: "group", "aria-label": "Confirm cancelling" },
    h("span", {}, `Cancel ${job.name}? Its devices are freed; committed rounds stay.`),
    h("button", { type: "button", class: "danger", id: "confirm-cancel",
      "data-action": "cancel", "data-job": job.id }, "Yes, cancel it"),
    h("button", { type: "button", "data-action": "ask-cancel", "data-job": "" },
      "Keep it running"));
}

export function jobView(ctx, id) {
  const { state } = ctx;
  const job = state.jobs.find((j) => j.id === id);
  if (!job) {
    return h("section", {}, h("h1", {}, "Job not found"),
      h("p", {}, `There is no job ${id}. `, h("a", { href: "#/jobs" }, "See every job.")));
  }
  const rounds = state.rounds.get(id) || [];
  return h("section", { "aria-labelledby": "job-title", dataset: { job: id } },
    h("p", { class: "crumbs" }, h("a", { href: "#/jobs" }, "Jobs"), " / ", job.id),
    h("div", { class: "job-head" },
      h("h1", { id: "job-title" }, job.name || job.id), badge(job.state),
      cancelControls(ctx, job)),
    h("dl", { class: "facts" },
      h("div", {}, h("dt", {}, "Progress"),
        h("dd", {}, progress(job.rounds_committed, job.rounds_total, "rounds committed"))),
      h("div", {}, h("dt", {}, "Accuracy"), h("dd", {}, metric(job, "accuracy"))),
      h("div", {}, h("dt", {}, "Loss"), h("dd", {}, metric(job, "loss"))),
      h("div", {}, h("dt", {}, "Task"), h("dd", { class: "small" }, job.task || "–"))),
    h("div", { class: "charts" }, metricCharts(job, rounds), timeline(rounds), bytesChart(rounds)),
    h("div", { class: "panel" }, participationGrid(rounds)),
    decisions(rounds),
    h("section", { class: "panel", "aria-labelledby": "rounds-title" },
      h("h2", { id: "rounds-title" }, "Rounds"), roundsTable(rounds, state.source)));
}

function select(label, id, key, value, options) {
  return h("label", { for: id }, label,
    h("select", { id, "data-action": "filter", "data-key": key },
      h("option", { value: "" }, "all"),
      options.map((o) => h("option", { value: o, selected: o === value }, o))));
}

function deviceCounts(devices) {
  const counts = { idle: 0, busy: 0, offline: 0, ineligible: 0 };
  for (const d of devices) counts[d.state] = (counts[d.state] || 0) + 1;
  return h("ul", { class: "counts", "aria-label": "Devices by state" },
    h("li", {}, h("strong", {}, counts.idle + counts.busy + counts.ineligible), " online"),
    Object.entries(counts).map(([k, v]) => h("li", {}, badge(k), ` ${v}`)));
}

function historyChart(samples) {
  const pick = (key) => samples.map((p) => [p.t, p[key]]);
  return lineChart({ name: "device-history", title: "Devices over time",
    series: [{ label: "idle", cls: "s1", points: pick("idle") },
      { label: "busy", cls: "s2", points: pick("busy") },
      { label: "offline", cls: "s4", points: pick("offline") }],
    xFormat: clock, yFormat: (v) => num(v, 0) });
}

export function devicesView(ctx) {
  const { state } = ctx;
  const f = state.filters;
  const distinct = (key) => [...new Set(state.devices.map((d) => d[key]))].filter(Boolean).sort();
  const shown = state.devices.filter((d) => (!f.state || d.state === f.state)
    && (!f.device_class || d.device_class === f.device_class) && (!f.job || d.job === f.job));
  const limit = 500;
  const rows = shown.slice(0, limit).map((d) => h("tr", { dataset: { device: d.id } },
    h("td", {}, d.id), h("td", {}, badge(d.state)), h("td", {}, d.device_class || "–"),
    h("td", {}, d.job || "–"), h("td", { class: "num" }, d.rounds_served),
    h("td", { class: "small" }, Object.entries(d.failures).map(([k, v]) => `${k}: ${v}`)
      .join(", ") || "–"),
    h("td", { class: "small" }, when(d.last_seen, state.source)),
    h("td", { class: "num" }, d.gflops ? num(d.gflops, 1) : "–"),
    h("td", { class: "num" }, d.upload_bytes_per_s ? `${bytes(d.upload_bytes_per_s)}/s` : "–"),
    h("td", { class: "small" }, d.ineligible_reason || "")));
  return h("section", { "aria-labelledby": "devices-title" },
    h("h1", { id: "devices-title" }, "Devices"),
    deviceCounts(state.devices),
    h("div", { class: "charts" }, historyChart(state.history)),
    h("form", { class: "filters", "aria-label": "Filter devices" },
      select("State", "filter-state", "state", f.state,
        ["offline", "idle", "busy", "ineligible"]),
      select("Class", "filter-class", "device_class", f.device_class, distinct("device_class")),
      select("Job", "filter-job", "job", f.job, distinct("job"))),
    h("p", { class: "muted small", id: "device-count" },
      shown.length > limit ? `Showing ${limit} of ${shown.length} devices.`
        : `${shown.length} of ${state.devices.length} devices.`),
    table("Devices", ["Device", "State", "Class", "Job", "Rounds served", "Failures",
      "Last seen", "GFLOPS", "Upload", "Not eligible because"], rows));
}

export function volunteersView(ctx) {
  const { state } = ctx;
  const runs = state.volunteers;
  return h("section", { "aria-labelledby": "volunteers-title" },
    h("h1", { id: "volunteers-title" }, "Volunteer runs"),
    runs.length === 0 ? h("p", { class: "empty" }, state.source === "simulation"
      ? "A simulation has no volunteer runs."
      : "No volunteer runs: start the server with --volunteer-run NAME=TASK.")
      : runs.map((run) => h("article", { class: "panel" },
        h("h2", {}, run.run),
        h("dl", { class: "facts" },
          h("div", {}, h("dt", {}, "Task"), h("dd", { class: "small" }, run.task)),
          h("div", {}, h("dt", {}, "Peers online"), h("dd", {}, run.peers_online)),
          h("div", {}, h("dt", {}, "Samples/s"), h("dd", {}, num(run.samples_per_s, 1)))),
        lineChart({ name: `loss-${run.run}`, title: "Loss over time",
          series: [{ label: "loss", cls: "s2",
            points: run.loss_history.filter((p) => typeof p[1] === "number") }],
          xFormat: clock, yFormat: short }),
        run.maddrs.length ? h("details", {}, h("summary", {}, "Addresses peers join at"),
          h("ul", { class: "small mono" }, run.maddrs.map((m) => h("li", {}, m)))) : null)));
}
