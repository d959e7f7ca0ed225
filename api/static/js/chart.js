// Hand-written SVG charts: every trial's train loss (solid) and validation loss (dashed, with dots) on one pair of
// axes; a DPO task's reward curves (a line of validation points per trial); a hyperparameter against each trial's
// result. No library: a few hundred lines of SVG are all the dashboard draws.

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
  // Each tick a whole multiple of the step, not a running sum: summed, an axis across zero (a DPO task's rewards)
  // ticked 5.6e-17 where 0 belongs.
  for (let k = Math.ceil(lo / step); k * step <= hi + step * 1e-9; k += 1) out.push(Number((k * step).toPrecision(10)));
  return out;
}

/** Ticks for a log axis over [lo, hi] (both > 0): 1, 2, 5 × 10^k over a decade or more, else round linear ones. */
export function logTicks(lo, hi, count = 5) {
  if (!(lo > 0) || !(hi > lo)) return [lo];
  if (hi / lo < 10) return ticks(lo, hi, count).filter((v) => v > 0);
  const out = [];
  for (let k = Math.floor(Math.log10(lo)); k <= Math.ceil(Math.log10(hi)); k += 1) {
    for (const m of [1, 2, 5]) {
      const v = Number((m * 10 ** k).toPrecision(6));
      if (v >= lo && v <= hi) out.push(v);
    }
  }
  // Many decades: the 2s and 5s would crowd the axis.
  return out.length > count * 2 ? out.filter((v) => Math.round(v / 10 ** Math.floor(Math.log10(v) + 1e-9)) === 1) : out;
}

/** A scale from data values to pixels over [from, to]; `log` maps log10 of the values (which must be > 0). */
export function scale(lo, hi, from, to, log = false) {
  const f = log ? Math.log10 : (v) => v;
  const [a, b] = [f(lo), f(hi)];
  return (v) => from + ((f(v) - a) / (b - a || 1)) * (to - from);
}

/** [lo, hi] of the values with a margin of `share` each side; on a log scale, the margin is a ratio. */
function padded(values, log, share = 0.05) {
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  if (log) {
    if (hi / lo < 1.0001) { lo /= 1.5; hi *= 1.5; }
    const ratio = (hi / lo) ** share;
    return [lo / ratio, hi * ratio];
  }
  if (hi - lo < 1e-6) { lo -= Math.abs(lo) * 0.5 || 0.5; hi += Math.abs(hi) * 0.5 || 0.5; }
  const margin = (hi - lo) * share;
  return [lo - margin, hi + margin];
}

const tickText = (v) => (Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(1) : String(Number(v.toPrecision(3))));

function pathOf(points, x, y, usable) {
  let d = "";
  let pen = false;
  for (const [step, loss] of points) {
    if (!usable(loss)) { pen = false; continue; } // a non-finite loss (or ≤ 0 on a log axis) breaks the line
    d += `${pen ? "L" : "M"}${x(step).toFixed(1)},${y(loss).toFixed(1)}`;
    pen = true;
  }
  return d;
}

function axisLabels(svg, { width, height, pad, xLabel, yLabel }) {
  const mid = (pad.top + height - pad.bottom) / 2;
  svg.append(
    s("line", { x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom, class: "axis" }),
    s("line", { x1: pad.left, x2: width - pad.right, y1: height - pad.bottom, y2: height - pad.bottom, class: "axis" }),
    s("text", { x: (pad.left + width - pad.right) / 2, y: height - 4, "text-anchor": "middle", class: "label" }, xLabel),
    s("text", { x: 12, y: mid, "text-anchor": "middle", class: "label", transform: `rotate(-90 12 ${mid})` }, yLabel),
  );
}

/** The step axis and the value axis with its grid: ticks in `g.y-ticks` and `g.x-ticks`, then both axes' labels. */
function stepAxes(svg, { x, y, lo, hi, lastStep, width, height, pad, logY = false, yLabel }) {
  const yTicks = s("g", { class: "axes y-ticks" });
  for (const t of logY ? logTicks(lo, hi) : ticks(lo, hi)) {
    yTicks.append(s("line", { x1: pad.left, x2: width - pad.right, y1: y(t), y2: y(t), class: "grid" }),
      s("text", { x: pad.left - 6, y: y(t) + 4, "text-anchor": "end" }, tickText(t)));
  }
  const xTicks = s("g", { class: "axes x-ticks" });
  for (const t of ticks(0, lastStep, Math.max(2, Math.round(width / 140))).filter((v) => Number.isInteger(v))) {
    xTicks.append(s("text", { x: x(t), y: height - pad.bottom + 16, "text-anchor": "middle" }, String(t)));
  }
  svg.append(yTicks, xTicks);
  axisLabels(svg, { width, height, pad, xLabel: "step", yLabel });
}

/**
 * series: [{id, index, label, colour, train: [[step, loss]], val: [[step, loss]], best, stopped: reason|null}]
 * Returns an <svg>. The best trial's lines are drawn last and thicker; a stopped trial ends in a cross whose
 * tooltip gives the reason. `logY` draws the loss on a log axis (its ticks in `g.y-ticks`, `data-y-scale`).
 * `lossName` names the loss on the axis and in the description ("DPO loss" for a DPO task's).
 * The caller passes only the trials it shows: the axes fit those (isolating a trial zooms to it).
 */
export function lossChart(series, { width = 1000, height = 380, maxStep = null, logY = false, empty = "No loss points yet",
  lossName = "loss" } = {}) {
  const pad = { left: 56, right: 16, top: 12, bottom: 36 };
  const usable = (loss) => loss !== null && Number.isFinite(loss) && (!logY || loss > 0);
  const losses = [];
  let lastStep = maxStep || 1;
  for (const line of series) {
    for (const [step, loss] of [...line.train, ...line.val]) {
      if (usable(loss)) losses.push(loss);
      if (!maxStep) lastStep = Math.max(lastStep, step);
    }
  }
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img", "data-y-scale": logY ? "log" : "linear",
    "aria-label": `Train and validation ${lossName} by step for ${series.length} trials${logY ? " (log scale)" : ""}` });
  if (!losses.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, empty));
    return svg;
  }
  const [lo, hi] = padded(losses, logY);
  const x = scale(0, lastStep, pad.left, width - pad.right);
  const y = scale(lo, hi, height - pad.bottom, pad.top, logY);

  stepAxes(svg, { x, y, lo, hi, lastStep, width, height, pad, logY, yLabel: logY ? `${lossName} (log)` : lossName });

  const ordered = [...series].sort((a, b) => Number(a.best) - Number(b.best)); // the best on top
  for (const line of ordered) {
    const g = s("g", { class: `trial${line.best ? " best" : ""}${line.stopped ? " stopped" : ""}`,
      "data-trial": line.id, stroke: line.colour, fill: line.colour });
    const train = thin(line.train);
    const val = thin(line.val);
    g.append(s("title", {}, line.label));
    if (train.length) g.append(s("path", { d: pathOf(train, x, y, usable), class: "train", fill: "none" }));
    if (val.length) {
      g.append(s("path", { d: pathOf(val, x, y, usable), class: "val", fill: "none" }));
      for (const [step, loss] of val.slice(-50)) {
        if (usable(loss)) g.append(s("circle", { cx: x(step), cy: y(loss), r: 2.5 }));
      }
    }
    const last = [...train].reverse().find(([, loss]) => usable(loss));
    if (line.stopped && last) {
      const [cx, cy] = [x(last[0]), y(last[1])];
      g.append(s("path", { d: `M${cx - 5},${cy - 5}L${cx + 5},${cy + 5}M${cx - 5},${cy + 5}L${cx + 5},${cy - 5}`,
        class: "stop-mark" }, s("title", {}, `${line.label}: stopped early (${line.stopped})`)));
    }
    svg.append(g);
  }
  return svg;
}

/**
 * series: [{id, label, colour, best, lines: [{points: [[step, value]], dashed}]}] — one trial each (a DPO trial's
 * reward accuracy: one line; its chosen and rejected rewards: two), a dot per point (its validations are few).
 * Returns an <svg class="chart rewards">, a `g.trial` per trial that has a point, the best drawn last and thicker.
 * `range`: values the value axis always covers: reward accuracy's [0, 1], so that trials compare on the whole scale
 * rather than on a zoomed sliver; a margin's [0], so that its zero (no preference either way) stays in view, and
 * `zero` draws it as a line (`line.zero`). `what` describes the chart to a screen reader ("Validation reward accuracy").
 */
export function rewardChart(series, { width = 500, height = 260, maxStep = null, yLabel, what, range = [], zero = false,
  empty = "No validation yet" } = {}) {
  const pad = { left: 56, right: 16, top: 12, bottom: 36 };
  const usable = (v) => v !== null && Number.isFinite(v);
  const drawn = series.filter((line) => line.lines.some((l) => l.points.some(([, v]) => usable(v))));
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart rewards", role: "img",
    "aria-label": `${what} by step for ${drawn.length} trials` });
  if (!drawn.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, empty));
    return svg;
  }
  const values = [...range];
  let lastStep = maxStep || 1;
  for (const line of drawn) {
    for (const [step, v] of line.lines.flatMap((l) => l.points)) {
      if (usable(v)) values.push(v);
      if (!maxStep) lastStep = Math.max(lastStep, step);
    }
  }
  const [lo, hi] = padded(values, false);
  const x = scale(0, lastStep, pad.left, width - pad.right);
  const y = scale(lo, hi, height - pad.bottom, pad.top);
  stepAxes(svg, { x, y, lo, hi, lastStep, width, height, pad, yLabel });
  if (zero && lo < 0 && hi > 0) svg.append(s("line", { x1: pad.left, x2: width - pad.right, y1: y(0), y2: y(0), class: "zero" }));

  const ordered = [...drawn].sort((a, b) => Number(a.best) - Number(b.best)); // the best on top
  for (const line of ordered) {
    const g = s("g", { class: `trial${line.best ? " best" : ""}`, "data-trial": line.id, stroke: line.colour,
      fill: line.colour }, s("title", {}, line.label));
    for (const { points, dashed } of line.lines) {
      const shown = thin(points);
      if (!shown.length) continue;
      g.append(s("path", { d: pathOf(shown, x, y, usable), class: dashed ? "reward dashed" : "reward", fill: "none" }));
      for (const [step, v] of shown.slice(-50)) {
        if (usable(v)) g.append(s("circle", { cx: x(step), cy: y(v), r: 2.5, class: dashed ? "dashed" : null }));
      }
    }
    svg.append(g);
  }
  return svg;
}

/**
 * points: [{id, label, x, y, state}] — one trial each: a hyperparameter's value against its result. A dot per
 * point (class `pt state-<trial state>`, coloured by the stylesheet), `logX` for a log axis (learning rates).
 * Categorical x values (strings) are spread evenly in their first-seen order.
 */
export function scatterChart(points, { width = 1000, height = 300, xLabel, yLabel, logX = false, empty = "No results yet" } = {}) {
  const pad = { left: 56, right: 20, top: 14, bottom: 40 };
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart scatter", role: "img",
    "data-x-scale": logX ? "log" : "linear", "aria-label": `${yLabel} against ${xLabel}, one dot per trial` });
  const shown = points.filter((p) => p.y !== null && p.y !== undefined && Number.isFinite(p.y) && p.x !== null
    && p.x !== undefined && (typeof p.x === "string" || (Number.isFinite(p.x) && (!logX || p.x > 0))));
  if (!shown.length) {
    svg.append(s("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" }, empty));
    return svg;
  }
  const categories = [...new Set(shown.filter((p) => typeof p.x === "string").map((p) => p.x))];
  const categorical = categories.length > 0;
  const xs = categorical ? [0, Math.max(1, categories.length - 1)] : shown.map((p) => p.x);
  const [xlo, xhi] = categorical ? [-0.5, xs[1] + 0.5] : padded(xs, logX, 0.08);
  const [ylo, yhi] = padded(shown.map((p) => p.y), false, 0.1);
  const x = scale(xlo, xhi, pad.left, width - pad.right, logX && !categorical);
  const y = scale(ylo, yhi, height - pad.bottom, pad.top);
  const axes = s("g", { class: "axes" });
  for (const t of ticks(ylo, yhi)) {
    axes.append(s("line", { x1: pad.left, x2: width - pad.right, y1: y(t), y2: y(t), class: "grid" }),
      s("text", { x: pad.left - 6, y: y(t) + 4, "text-anchor": "end" }, tickText(t)));
  }
  const xTicks = categorical ? categories.map((c, i) => [i, c])
    : (logX ? logTicks(xlo, xhi) : ticks(xlo, xhi, Math.max(2, Math.round(width / 140))))
      .filter((t) => !xs.every(Number.isInteger) || Number.isInteger(t)) // ranks and batch sizes: whole ticks only
      .map((t) => [t, tickText(t)]);
  for (const [t, text] of xTicks) {
    axes.append(s("text", { x: x(t), y: height - pad.bottom + 16, "text-anchor": "middle", class: "x-tick" }, text));
  }
  svg.append(axes);
  axisLabels(svg, { width, height, pad, xLabel: logX ? `${xLabel} (log)` : xLabel, yLabel });
  for (const p of shown) {
    const px = categorical ? categories.indexOf(p.x) : p.x;
    svg.append(s("circle", { cx: x(px), cy: y(p.y), r: 6, class: `pt state-${p.state}`, "data-trial": p.id },
      s("title", {}, `${p.label}: ${yLabel} ${Number(p.y.toPrecision(4))} (${p.state.replace("_", " ")})`)));
  }
  return svg;
}
