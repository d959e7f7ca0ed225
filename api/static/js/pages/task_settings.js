// What a task was asked to do and what it was predicted to cost, from the task object alone (GET /v1/tasks/{id}):
// its settings (a DPO task's objective, model, data, sequence length, budget, early exit, search space) and its
// `estimate` with the `actual` beside it once it ended. Pure rendering: the task page calls renderSettings on every
// refresh.

import { fmt, h } from "../dom.js";
import { lossName, metricName, objectiveText } from "../objective.js";

const DIMENSION_NAMES = { learning_rate: "learning rate", lora_rank: "rank", lora_alpha: "alpha",
  batch_size: "batch size", lora_dropout: "dropout", target_modules: "modules", beta: "beta" };

/** One search-space dimension in a few words: "1e-4, 3e-4" or "1e-4 – 1e-3 (4 points, log)". */
export function dimensionText(name, value) {
  if (Array.isArray(value)) {
    const show = name === "learning_rate" ? fmt.lr : name === "target_modules" ? fmt.modules : String;
    return value.map((v) => show(v)).join(", ");
  }
  if (value && typeof value === "object" && "min" in value) {
    const show = name === "learning_rate" ? fmt.lr : String;
    const extra = [value.num ? `${value.num} points` : null, value.scale || null].filter(Boolean).join(", ");
    return `${show(value.min)} – ${show(value.max)}${extra ? ` (${extra})` : ""}`;
  }
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

function searchSpaceText(task) {
  const space = task.search_space;
  if (!space || typeof space !== "object") return String(space ?? "—");
  const parts = Object.entries(space).filter(([, v]) => v !== null && v !== undefined)
    .map(([k, v]) => `${DIMENSION_NAMES[k] || k}: ${dimensionText(k, v)}`);
  const how = `${task.strategy}${task.max_trials ? `, at most ${task.max_trials} trials` : ""}, seed ${task.seed}`;
  return [parts.join(" · ") || "every dimension at its default", h("div", { class: "muted small" }, how)];
}

function earlyExitText(early) {
  const params = Object.entries(early || {}).filter(([k]) => k !== "policy").map(([k, v]) => `${k}=${v}`);
  return [early?.policy || "none", params.length ? h("span", { class: "muted small" }, ` (${params.join(", ")})`) : null];
}

function budgetText(task) {
  const per = task.max_steps ? `${task.max_steps} steps per trial` : `${task.epochs || 1} epoch(s) per trial`;
  return `${per}; validation every ${task.eval_interval} steps`;
}

function dataText(task) {
  const validation = task.validation_file ? `validation file ${task.validation_file}`
    : `${Math.round((task.validation_split ?? 0) * 100)}% held out for validation`;
  return [h("span", { class: "mono" }, task.training_file), h("div", { class: "muted small" }, validation)];
}

const KNOWN_COST = ["tokens", "gpu_seconds", "wall_seconds", "actual"];

/** A cost's numbers: wall time, device seconds (GPU or CPU: the worker's kind decides), tokens. */
function costText(cost, predicted) {
  const wall = cost.wall_seconds === null || cost.wall_seconds === undefined
    ? (predicted ? "wall time unknown (no live worker could take it then)" : "wall time unknown")
    : `${fmt.duration(cost.wall_seconds)} wall`;
  return `${wall} · ${Number(cost.gpu_seconds ?? 0).toFixed(1)} device seconds · ${fmt.num(cost.tokens)} tokens`;
}

/** The estimate and, once the task ended, what it took. Fields the API adds later (what the estimate rests on,
 * its error band) are shown as they come, one line each. */
function estimateItems(estimate) {
  if (!estimate) return [["Estimate", h("span", { class: "muted", id: "task-estimate" }, "none (submitted before estimates)")]];
  const items = [["Estimate", h("span", { id: "task-estimate" }, costText(estimate, true))]];
  if (estimate.actual) items.push(["Actual", h("span", { id: "task-actual" }, costText(estimate.actual, false))]);
  for (const [k, v] of Object.entries(estimate)) {
    if (KNOWN_COST.includes(k) || v === null || v === undefined) continue;
    const text = typeof v === "object" ? Object.entries(v).map(([a, b]) => `${a} ${b}`).join(", ") : String(v);
    const name = k.replace(/_/g, " ");
    items.push([name[0].toUpperCase() + name.slice(1), h("span", { class: "small", dataset: { estimate: k } }, text)]);
  }
  return items;
}

/** The settings card's <dl>, rebuilt from the task object. */
export function renderSettings(task) {
  const metric = task.evaluation?.metric || "loss";
  const objective = objectiveText(task); // an SFT task's is the default: no row, as before objectives
  const items = [
    ...(objective ? [["Objective", h("span", { id: "task-objective" }, objective)]] : []),
    ["Base model", task.base_model],
    ["Training file", dataText(task)],
    ["Max sequence length", `${task.max_seq_len} tokens`],
    ["Budget", budgetText(task)],
    ["Early exit", earlyExitText(task.early_exit)],
    ["Search space", searchSpaceText(task)],
    ["Best trial by", metric === "loss" ? `validation ${lossName(task)}` : metricName(metric)],
    ...estimateItems(task.estimate),
  ];
  return h("dl", {}, items.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
}
