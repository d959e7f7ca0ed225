// Tiny DOM helpers: elements from plain calls (no templating, so no HTML injection) and formatters.

const SVG_NS = "http://www.w3.org/2000/svg";

function apply(el, attrs) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") el.textContent = String(value);
    else if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** h("button", {class: "x", onclick: f}, "text", child) */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

export function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  apply(el, attrs);
  append(el, children);
  return el;
}

export function clear(el) {
  while (el.firstChild) el.firstChild.remove();
  return el;
}

export const fmt = {
  loss: (x) => (x === null || x === undefined ? "—" : Number(x).toFixed(4)),
  num: (x) => (x === null || x === undefined ? "—" : String(x)),
  pct: (p) => `${Math.round((p || 0) * 100)}%`,
  lr: (x) => (x === null || x === undefined ? "—" : String(Number(Number(x).toPrecision(3)))),
  duration(seconds) {
    if (seconds === null || seconds === undefined) return "—";
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
    return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  },
  time(iso) {
    if (!iso) return "—";
    const d = new Date(iso);
    return d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
  },
  datetime(iso) {
    return iso ? new Date(iso).toLocaleString() : "—";
  },
  bytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  },
  modules(m) {
    if (m === "all-linear" || (Array.isArray(m) && m.length === 1 && m[0] === "all-linear")) return "all-linear";
    return Array.isArray(m) ? m.map((x) => x.replace("_proj", "")).join(",") : String(m);
  },
};

/** A trial's states once it has ended. */
export const TRIAL_FINAL = new Set(["completed", "stopped_early", "failed", "cancelled"]);

/** A state badge: the state's text plus a class the stylesheet colours. */
export function badge(state) {
  return h("span", { class: `badge state-${state}` }, state.replace("_", " "));
}

/** A progress bar; `state` (a task's or trial's: running, succeeded, failed, cancelled, ...) colours its fill
 * through the class `progress-<state>`, so a failed task never reads as a finished blue one. */
export function progressBar(p, label, state = null) {
  const pct = Math.min(100, Math.max(0, Math.round((p || 0) * 100)));
  const fill = h("div", { class: "fill" });
  fill.style.width = `${pct}%`; // through the CSSOM: the page's policy allows no inline style attributes
  return h("div", { class: state ? `bar progress-${state}` : "bar", role: "progressbar", "aria-valuemin": 0,
    "aria-valuemax": 100, "aria-valuenow": pct, "aria-label": state ? `${label} (${state.replace("_", " ")})` : label },
  fill);
}
