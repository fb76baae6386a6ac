// Charts drawn by hand in SVG: lines with a point per value, stacked bars, a sparkline and a
// device-by-round grid. No library, nothing fetched; each chart scales to its container.

import { h, s } from "./dom.js";

const W = 480;
const H = 220;
const PAD = { left: 56, right: 12, top: 12, bottom: 34 };

function extent(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  if (lo === Infinity) return [0, 1];
  if (lo === hi) return lo === 0 ? [0, 1] : [Math.min(0, lo), Math.max(0, hi) * 1.05 || 1];
  return [lo, hi];
}

function niceStep(range, count, integer) {
  const raw = range / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const n = raw / mag;
  const step = (n <= 1 ? 1 : n <= 2 ? 2 : n <= 5 ? 5 : 10) * mag;
  return integer ? Math.max(1, Math.round(step)) : step;
}

/** Round-numbered ticks within [lo, hi] (about count of them). */
function ticks(lo, hi, count, integer) {
  if (!(hi > lo)) return [lo];
  const step = niceStep(hi - lo, count, integer);
  const first = Math.ceil(lo / step - 1e-9) * step;
  const out = [];
  for (let i = 0; first + i * step <= hi + step * 1e-9; i += 1) out.push(first + i * step);
  return out;
}

/** [lo, hi] widened to whole ticks, so a value axis starts and ends on a label. */
function niceExtent([lo, hi], count) {
  const step = niceStep(hi - lo, count, false);
  return [Math.floor(lo / step + 1e-9) * step, Math.ceil(hi / step - 1e-9) * step];
}

function scale(lo, hi, from, to) {
  return (v) => (hi === lo ? (from + to) / 2 : from + ((v - lo) / (hi - lo)) * (to - from));
}

function frame(name, title, xs, ys, xFormat, yFormat, xInteger) {
  const [x0, x1] = extent(xs);
  const [y0, y1] = niceExtent(extent(ys), 4);
  const x = scale(x0, x1, PAD.left, W - PAD.right);
  const y = scale(y0, y1, H - PAD.bottom, PAD.top);
  const svg = s("svg", {
    viewBox: `0 0 ${W} ${H}`,
    class: "chart-svg",
    role: "img",
    "aria-label": title,
    "data-chart": name,
  });
  for (const v of ticks(y0, y1, 4, false)) {
    svg.append(
      s("line", { class: "grid", x1: PAD.left, x2: W - PAD.right, y1: y(v), y2: y(v) }),
      s("text", { class: "tick", x: PAD.left - 6, y: y(v) + 4, "text-anchor": "end" }, yFormat(v)),
    );
  }
  for (const v of ticks(x0, x1, 4, xInteger)) {
    const px = x(v);
    const anchor = px > W - PAD.right - 24 ? "end" : px < PAD.left + 24 ? "start" : "middle";
    svg.append(
      s("text", { class: "tick", x: px, y: H - PAD.bottom + 16, "text-anchor": anchor },
        xFormat(v)),
    );
  }
  svg.append(
    s("line", { class: "axis", x1: PAD.left, x2: W - PAD.right, y1: H - PAD.bottom,
      y2: H - PAD.bottom }),
  );
  return { svg, x, y };
}

function figure(title, svg, legend, note) {
  return h(
    "figure",
    { class: "chart" },
    h("figcaption", {}, title),
    svg,
    legend && legend.length > 1
      ? h("ul", { class: "legend" },
        legend.map((l) => h("li", {}, h("span", { class: `swatch ${l.cls}` }), l.label)))
      : null,
    note ? h("p", { class: "muted small" }, note) : null,
  );
}

/**
 * Lines with a circle per point. series: [{label, cls, points: [[x, y], ...]}].
 * The svg carries data-chart=name and data-points=total points (tests count them).
 */
export function lineChart({ name, title, series, xLabel, xFormat = String, yFormat = String,
  xInteger = false }) {
  const all = series.flatMap((sr) => sr.points);
  if (all.length === 0) {
    return figure(title, h("p", { class: "empty", "data-chart": name }, "No data yet."));
  }
  const { svg, x, y } = frame(name, title, all.map((p) => p[0]), all.map((p) => p[1]),
    xFormat, yFormat, xInteger);
  svg.setAttribute("data-points", String(all.length));
  for (const sr of series) {
    if (sr.points.length > 1) {
      const d = sr.points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
      svg.append(s("polyline", { class: `line ${sr.cls}`, points: d }));
    }
    const r = sr.points.length > 150 ? 1.2 : 2.6;
    for (const [px, py] of sr.points) {
      svg.append(
        s("circle", { class: `pt ${sr.cls}`, cx: x(px).toFixed(1), cy: y(py).toFixed(1), r },
          s("title", {}, `${sr.label}: ${yFormat(py)} at ${xFormat(px)}`)),
      );
    }
  }
  if (xLabel) {
    svg.append(s("text", { class: "axis-label", x: W / 2, y: H - 4, "text-anchor": "middle" },
      xLabel));
  }
  return figure(title, svg, series.map((sr) => ({ label: sr.label, cls: sr.cls })));
}

/**
 * Stacked bars, one per x. bars: [{x, parts: [value, ...]}]; parts: [{label, cls}].
 */
export function stackedBars({ name, title, bars, parts, xLabel, xFormat = String,
  yFormat = String }) {
  if (bars.length === 0) {
    return figure(title, h("p", { class: "empty", "data-chart": name }, "No data yet."));
  }
  const totals = bars.map((b) => b.parts.reduce((a, v) => a + v, 0));
  const { svg, x, y } = frame(name, title, bars.map((b) => b.x), [0, ...totals], xFormat,
    yFormat, true);
  svg.setAttribute("data-bars", String(bars.length));
  const step = (W - PAD.left - PAD.right) / Math.max(bars.length, 1);
  const width = Math.max(1, Math.min(24, step * 0.7));
  for (const bar of bars) {
    let base = 0;
    const cx = x(bar.x);
    bar.parts.forEach((v, i) => {
      if (v <= 0) return;
      const top = y(base + v);
      svg.append(
        s("rect", { class: `bar ${parts[i].cls}`, x: (cx - width / 2).toFixed(1), y: top.toFixed(1),
          width: width.toFixed(1), height: Math.max(0.5, y(base) - top).toFixed(1) },
          s("title", {}, `${xFormat(bar.x)}: ${v} ${parts[i].label}`)),
      );
      base += v;
    });
  }
  if (xLabel) {
    svg.append(s("text", { class: "axis-label", x: W / 2, y: H - 4, "text-anchor": "middle" },
      xLabel));
  }
  return figure(title, svg, parts);
}

/** A small line of the latest values (a job's accuracy in the overview). */
export function sparkline(values, label) {
  const w = 120;
  const hgt = 28;
  if (values.length === 0) return h("span", { class: "muted" }, "–");
  const [lo, hi] = extent(values);
  const x = scale(0, Math.max(values.length - 1, 1), 2, w - 2);
  const y = scale(lo, hi, hgt - 3, 3);
  const pts = values.map((v, i) => `${x(i).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
  const svg = s("svg", { viewBox: `0 0 ${w} ${hgt}`, class: "spark", role: "img",
    "aria-label": label, "data-points": values.length });
  svg.append(s("polyline", { class: "line", points: values.length > 1 ? pts : `${pts} ${pts}` }));
  svg.append(s("circle", { class: "pt", cx: x(values.length - 1), cy: y(values.at(-1)), r: 2 }));
  return svg;
}

const CELL = { delivered: "ok", failed: "fail", stale: "stale", selected: "sel" };

/**
 * Which devices served which round: rows are devices, columns rounds; a cell says
 * delivered, failed (with the reason), stale, or selected without an answer.
 */
export function participationGrid(rounds, { maxRounds = 30, maxDevices = 60 } = {}) {
  const shown = rounds.slice(-maxRounds);
  const cells = new Map();
  for (const r of shown) {
    const mark = (id, kind, why) => {
      if (!cells.has(id)) cells.set(id, new Map());
      cells.get(id).set(r.round, { kind, why });
    };
    for (const id of r.selected || []) mark(id, "selected", "");
    for (const f of r.failures || []) mark(f.device_id, "failed", f.reason);
    for (const id of r.stale || []) mark(id, "stale", "");
    for (const id of r.participants || []) mark(id, "delivered", "");
  }
  const ids = [...cells.keys()].sort();
  const title = "Which devices served which round";
  if (ids.length === 0) return figure(title, h("p", { class: "empty" }, "No rounds yet."));
  const rows = ids.slice(0, maxDevices);
  const cw = 12;
  const ch = 12;
  const left = 96;
  const top = 18;
  const width = left + shown.length * cw + 4;
  const height = top + rows.length * ch + 4;
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "grid-svg", role: "img",
    "aria-label": title, "data-chart": "participation", width: Math.round(width * 1.25),
    height: Math.round(height * 1.25) });
  const labelEvery = Math.ceil(shown.length / 10);
  shown.forEach((r, j) => {
    if (j % labelEvery === 0) {
      svg.append(s("text", { class: "tick", x: left + j * cw + cw / 2, y: 12,
        "text-anchor": "middle" }, String(r.round)));
    }
  });
  rows.forEach((id, i) => {
    const yy = top + i * ch;
    svg.append(s("text", { class: "tick", x: left - 4, y: yy + ch - 3, "text-anchor": "end" },
      id.length > 14 ? `${id.slice(0, 13)}…` : id));
    shown.forEach((r, j) => {
      const cell = cells.get(id).get(r.round);
      if (!cell) return;
      const why = cell.why ? ` (${cell.why})` : "";
      svg.append(s("rect", { class: `cell ${CELL[cell.kind]}`, x: left + j * cw + 1, y: yy + 1,
        width: cw - 2, height: ch - 2 },
        s("title", {}, `${id}, round ${r.round}: ${cell.kind}${why}`)));
    });
  });
  const note = ids.length > rows.length
    ? `Showing ${rows.length} of ${ids.length} devices; the last ${shown.length} rounds.`
    : `The last ${shown.length} rounds.`;
  const legend = Object.entries(CELL).map(([label, cls]) => ({ label, cls }));
  return figure(title, h("div", { class: "scroll grid-box", tabindex: 0, role: "region",
    "aria-label": title }, svg), legend, note);
}
