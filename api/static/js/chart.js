// A hand-written SVG line chart: every trial's train loss (solid) and validation loss (dashed, with dots)
// on one pair of axes. No library: a few hundred lines of SVG are all the dashboard draws.

import { s } from "./dom.js";

export const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22"];

const MAX_DRAWN = 600; // points per line actually drawn; more only costs the browser, not the picture

export function colourOf(index) {
  return PALETTE[index % PALETTE.length];
}

/** At most `max` points: evenly strided, always keeping the last (the newest point is what people watch). */
export function thin(points, max = MAX_DRAWN) {
  if (points.length <= max) return points;
  const stride = points.length / (max - 1);
  const out = [];
  for (let i = 0; i < max - 1; i += 1) out.push(points[Math.floor(i * stride)]);
  out.push(points[points.length - 1]);
  return out;
}

/** Round tick values covering [lo, hi]. */
export function ticks(lo, hi, count = 5) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((st) => st >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(10)));
  return out;
}

function pathOf(points, x, y) {
  let d = "";
  let pen = false;
  for (const [step, loss] of points) {
    if (loss === null || !Number.isFinite(loss)) { pen = false; continue; } // a non-finite loss breaks the line
    d += `${pen ? "L" : "M"}${x(step).toFixed(1)},${y(loss).toFixed(1)}`;
    pen = true;
  }
  return d;
}

/**
 * series: [{id, index, label, colour, train: [[step, loss]], val: [[step, loss]], best, stopped: reason|null}]
 * Returns an <svg>. The best trial's lines are drawn last and thicker; a stopped trial ends in a cross whose
 * tooltip gives the reason.
 */
export function lossChart(series, { width = 1000, height = 380, maxStep = null } = {}) {
  const pad = { left: 56, right: 16, top: 12, bottom: 36 };
  const losses = [];
  let lastStep = maxStep || 1;
  for (const line of series) {
    for (const [step, loss] of [...line.train, ...line.val]) {
      if (loss !== null && Number.isFinite(loss)) losses.push(loss);
      if (!maxStep) lastStep = Math.max(lastStep, step);
    }
  }
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img",
    "aria-label": `Train and validation loss by step for ${series.length} trials` });
  if (!losses.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" },
      "No loss points yet"));
    return svg;
  }
  let lo = Math.min(...losses);
  let hi = Math.max(...losses);
  if (hi - lo < 1e-6) { lo -= 0.5; hi += 0.5; }
  const margin = (hi - lo) * 0.05;
  lo -= margin;
  hi += margin;
  const x = (step) => pad.left + (step / lastStep) * (width - pad.left - pad.right);
  const y = (loss) => pad.top + (1 - (loss - lo) / (hi - lo)) * (height - pad.top - pad.bottom);

  const axes = s("g", { class: "axes" });
  for (const t of ticks(lo, hi)) {
    axes.append(s("line", { x1: pad.left, x2: width - pad.right, y1: y(t), y2: y(t), class: "grid" }),
      s("text", { x: pad.left - 6, y: y(t) + 4, "text-anchor": "end" }, t.toPrecision(3)));
  }
  for (const t of ticks(0, lastStep).filter((v) => Number.isInteger(v))) {
    axes.append(s("text", { x: x(t), y: height - pad.bottom + 16, "text-anchor": "middle" }, String(t)));
  }
  axes.append(
    s("line", { x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom, class: "axis" }),
    s("line", { x1: pad.left, x2: width - pad.right, y1: height - pad.bottom, y2: height - pad.bottom, class: "axis" }),
    s("text", { x: (pad.left + width - pad.right) / 2, y: height - 4, "text-anchor": "middle", class: "label" }, "step"),
    s("text", { x: 12, y: (pad.top + height - pad.bottom) / 2, "text-anchor": "middle", class: "label",
      transform: `rotate(-90 12 ${(pad.top + height - pad.bottom) / 2})` }, "loss"),
  );
  svg.append(axes);

  const ordered = [...series].sort((a, b) => Number(a.best) - Number(b.best)); // the best on top
  for (const line of ordered) {
    const g = s("g", { class: `trial${line.best ? " best" : ""}${line.stopped ? " stopped" : ""}`,
      "data-trial": line.id, stroke: line.colour, fill: line.colour });
    const train = thin(line.train);
    const val = thin(line.val);
    g.append(s("title", {}, line.label));
    if (train.length) g.append(s("path", { d: pathOf(train, x, y), class: "train", fill: "none" }));
    if (val.length) {
      g.append(s("path", { d: pathOf(val, x, y), class: "val", fill: "none" }));
      for (const [step, loss] of val.slice(-50)) {
        if (loss !== null && Number.isFinite(loss)) g.append(s("circle", { cx: x(step), cy: y(loss), r: 2.5 }));
      }
    }
    const last = [...train].reverse().find(([, loss]) => loss !== null && Number.isFinite(loss));
    if (line.stopped && last) {
      const [cx, cy] = [x(last[0]), y(last[1])];
      g.append(s("path", { d: `M${cx - 5},${cy - 5}L${cx + 5},${cy + 5}M${cx - 5},${cy + 5}L${cx + 5},${cy - 5}`,
        class: "stop-mark" }, s("title", {}, `${line.label}: stopped early (${line.stopped})`)));
    }
    svg.append(g);
  }
  return svg;
}
