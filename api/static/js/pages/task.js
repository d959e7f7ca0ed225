// One task, live: summary (its progress coloured by state), its settings and estimate, every trial's loss curves on
// one chart (log scale, trials hidden or isolated from the legend or the table), a DPO task's reward curves (its
// trials' validation reward accuracy, reward margin, and chosen and rejected rewards), each trial's hyperparameter
// against its result, the sortable trials table with the best trial highlighted, adapter downloads, a trial's
// checkpoints (checkpoints.js), a playground (answers of chosen trials side by side: playground.js), the experiment
// trackers' state (trackers.js), and the event log. Events arrive on the SSE stream (polling when it
// cannot be used); loss points are not events, so while the task runs the page also re-reads the task, its
// trials and the curves' new points every few seconds, and at once (at most once a second) after an event.

import { api, download, ndjson } from "../api.js";
import { colourOf, lossChart, rewardChart, scatterChart } from "../chart.js";
import { TRIAL_FINAL, badge, clear, fmt, h, progressBar } from "../dom.js";
import { Poller, TaskStream } from "../live.js";
import { isDpo, lossName, metricName } from "../objective.js";
import { checkpoints } from "./checkpoints.js";
import { playground } from "./playground.js";
import { renderSettings } from "./task_settings.js";
import { trialSummary } from "./tasks.js";
import { trackers } from "./trackers.js";

const FINAL = new Set(["succeeded", "failed", "cancelled"]);
const MAX_EVENTS = 500; // the log keeps the newest; the full history stays in the API (/events)
const MAX_POINTS = 4000; // per curve kept in memory; past it, every other point is dropped (the last kept)

const COLUMNS = [
  { key: "index", label: "#", value: (t) => t.index },
  { key: "state", label: "State", value: (t) => t.state },
  { key: "steps", label: "Steps", value: (t) => t.steps_done },
  { key: "lr", label: "LR", value: (t) => t.hyperparameters.learning_rate },
  { key: "rank", label: "Rank", value: (t) => t.hyperparameters.lora_rank },
  { key: "alpha", label: "Alpha", value: (t) => t.hyperparameters.lora_alpha },
  { key: "batch", label: "Batch", value: (t) => t.hyperparameters.batch_size },
  { key: "dropout", label: "Dropout", value: (t) => t.hyperparameters.lora_dropout },
  { key: "modules", label: "Modules", value: (t) => fmt.modules(t.hyperparameters.target_modules) },
  { key: "train", label: "Last train", value: (t) => t.last_train_loss },
  { key: "val", label: "Best val", value: (t) => t.best_val_loss },
];
// A DPO task's trials differ by beta too: a column of the trials table after the learning rate.
const BETA_COLUMN = { key: "beta", label: "Beta", value: (t) => t.hyperparameters.beta };
// The hyperparameters the scatter can put on its x axis; learning rates spread over decades, so on a log axis, and
// so do betas (0.01 to 1). `dpo`: a DPO task's only.
const HYPERPARAMETERS = [
  { key: "learning_rate", label: "learning rate", log: true },
  { key: "beta", label: "beta", log: true, dpo: true },
  { key: "lora_rank", label: "LoRA rank" },
  { key: "lora_alpha", label: "LoRA alpha" },
  { key: "batch_size", label: "batch size" },
  { key: "lora_dropout", label: "LoRA dropout" },
  { key: "target_modules", label: "target modules", text: true },
];
// A task judged by a generative metric (exact_match, contains, regex, json_valid) adds its score per trial.
const METRIC_COLUMN = { key: "metric", label: "Metric", value: (t) => t.metric_score };
// A DPO trial's validation reward metrics (the curves' `rewards`), each [step, value] as the loss curves' points.
const PREFERENCE_SPLITS = ["reward_acc", "margin", "chosen", "rejected"];
// A DPO task's reward charts, side by side: which of those splits each draws (dashed: the rejected answers', beside
// the chosen ones'), what its value axis always covers and whether it marks zero (chart.js rewardChart).
const REWARD_CHARTS = [
  { id: "reward-accuracy-chart", title: "Reward accuracy", yLabel: "reward accuracy", range: [0, 1],
    what: "Validation reward accuracy", lines: [["reward_acc", false]] },
  { id: "reward-margin-chart", title: "Reward margin", yLabel: "margin", range: [0], zero: true,
    what: "Mean validation reward margin", lines: [["margin", false]] },
  { id: "reward-values-chart", title: "Chosen and rejected rewards", yLabel: "reward", range: [0], zero: true,
    what: "Mean validation rewards of the chosen (solid) and rejected (dashed) answers",
    lines: [["chosen", false], ["rejected", true]] },
];

/** A trial's curves before any point came: train and validation loss, and a DPO trial's reward metrics. */
function noPoints() {
  return { train: [], val: [], rewards: Object.fromEntries(PREFERENCE_SPLITS.map((split) => [split, []])) };
}

/** The hyperparameters the scatter offers for the task: beta for a DPO task only. */
function hyperparametersOf(task) {
  return HYPERPARAMETERS.filter((p) => !p.dpo || isDpo(task));
}

/** The task's generative metric, or null when it is judged by validation loss. */
function metricOf(task) {
  const metric = task?.evaluation?.metric;
  return metric && metric !== "loss" ? metric : null;
}

const score = (x) => (x === null || x === undefined ? "—" : Number(x).toFixed(3));

function compare(a, b) {
  if (a === b) return 0;
  if (a === null || a === undefined) return 1; // missing values last, whichever the direction
  if (b === null || b === undefined) return -1;
  return a < b ? -1 : 1;
}

/** Halves a curve that grew past the cap, keeping its last point: memory stays bounded for any length. */
function capped(points) {
  if (points.length <= MAX_POINTS) return points;
  const last = points[points.length - 1];
  const kept = points.filter((_, i) => i % 2 === 0);
  if (kept[kept.length - 1] !== last) kept.push(last);
  return kept;
}

/** How far a task's trials got, steps over steps: a failed or cancelled task's bar shows where it stopped
 * (the task's own `progress` counts every ended trial as done). */
export function reached(trials) {
  if (!trials.length) return 0;
  const done = trials.map((t) => (t.total_steps > 0 ? Math.min(1, t.steps_done / t.total_steps) : 0));
  return done.reduce((a, b) => a + b, 0) / trials.length;
}

/** The hyperparameter the scatter starts on: the first that differs between trials (else the learning rate). */
function varying(trials, params) {
  const found = params.find((p) =>
    new Set(trials.map((t) => JSON.stringify(t.hyperparameters[p.key]))).size > 1);
  return (found || params[0]).key;
}

/** Points of a curve row's split newer than the last one kept, appended as [step, value]; the kept list as it was
 * when none is newer (a live view re-reads the points of the last evaluation interval). */
function appended(kept, points) {
  const last = kept.length ? kept[kept.length - 1][0] : 0;
  const fresh = (points || []).filter((p) => p[0] > last).map((p) => [p[0], p[3]]);
  return fresh.length ? capped(kept.concat(fresh)) : kept;
}

/** Hidden trial ids after a click on trial `id`: a plain click toggles it; isolating shows it alone (or,
 * when it already is alone, every trial again). */
export function toggled(hidden, ids, id, isolate) {
  const next = new Set(hidden);
  if (isolate) {
    const alone = ids.every((other) => (other === id) !== next.has(other));
    return alone ? new Set() : new Set(ids.filter((other) => other !== id));
  }
  if (next.has(id)) next.delete(id);
  else next.add(id);
  return next;
}

export function mount(root, { params, session }) {
  const [taskId] = params;
  const operator = session.role === "admin"; // the admin token reads any tenant's task: no cancel button
  // waiting: why the task's trials cannot start (the message of its newest `task.waiting_for_model` or
  // `task.waiting` event, until a `task.model_available` one), or null.
  // hidden: the ids of the trials left off the loss chart; logY: its loss axis on a log scale; hp: the scatter's x.
  const state = { task: null, trials: [], curves: new Map(), sort: { key: "val", dir: 1 }, events: [], waiting: null,
    hidden: new Set(), logY: false, hp: null };

  const heading = h("h1", {}, "Task ", h("span", { class: "mono" }, taskId));
  const liveNote = h("span", { class: "muted small", role: "status", id: "live-mode" }, "connecting…");
  const alert = h("p", { class: "error", role: "alert" });
  const summary = h("section", { class: "summary", "aria-label": "Summary" });
  const actions = h("div", { class: "actions" });
  const settings = h("section", { class: "summary settings", id: "settings", "aria-label": "Settings and estimate" });
  const chartBox = h("figure", { class: "chart-box", id: "loss-chart" });
  const curvesTitle = h("h2", { id: "curves-title" }, "Loss curves");
  const curvesNote = h("p", { class: "muted small", id: "curves-note" });
  // A DPO task's reward charts: on the page (after the loss chart's legend) only once the task is known to be one.
  const rewardBoxes = REWARD_CHARTS.map((c) => h("figure", { class: "chart-box", id: c.id }));
  const rewards = h("section", { id: "rewards", "aria-labelledby": "rewards-title" },
    h("h2", { id: "rewards-title" }, "Reward curves"),
    h("p", { class: "muted small" }, "At each validation, on the validation pairs: the share whose chosen answer the ",
      "trial rewards above the rejected one (higher is better), the mean margin between the two rewards, and the ",
      "mean rewards themselves (solid: chosen; dashed, hollow dots: rejected). An answer's reward is beta times the ",
      "log-ratio of its likelihood under the adapter to that under the base model. ",
      "Trials hidden above are hidden here."),
    h("div", { class: "reward-charts" }, rewardBoxes));
  const legend = h("ul", { class: "legend", "aria-label": "Trials on the chart" });
  const logToggle = h("input", { type: "checkbox", id: "log-y", onchange: () => { state.logY = logToggle.checked; renderChart(); } });
  const showAll = h("button", { type: "button", class: "secondary small-button", id: "show-all",
    onclick: () => { state.hidden = new Set(); renderChart(); renderTable(); } }, "Show all trials");
  // Its options come with the task (renderScatter): a DPO task's trials have a beta.
  const hpSelect = h("select", { id: "hp-select", onchange: () => { state.hp = hpSelect.value; renderScatter(); } });
  const hpNote = h("span", { class: "muted small", id: "hp-note" });
  const scatterBox = h("figure", { class: "chart-box", id: "hp-scatter" });
  const tableBox = h("div", { class: "table-box" });
  const log = h("ol", { class: "log", "aria-label": "Event log, newest first" });
  const playgroundBox = h("div");
  const checkpointsBox = h("div");
  const trackersBox = h("div");
  const curvesSection = h("section", { "aria-labelledby": "curves-title" }, curvesTitle, curvesNote,
    h("div", { class: "chart-tools" }, h("label", { class: "check" }, logToggle, "Log scale (loss)"), showAll),
    chartBox, legend);
  root.append(
    h("div", { class: "page-head" }, heading, liveNote),
    alert, summary, actions,
    h("h2", { id: "settings-title" }, "Settings and estimate"), settings,
    curvesSection,
    h("section", { "aria-labelledby": "hp-title" }, h("h2", { id: "hp-title" }, "Hyperparameters against the result"),
      h("div", { class: "chart-tools" }, h("label", { for: "hp-select" }, "Hyperparameter"), hpSelect,
        hpNote),
      scatterBox),
    h("section", { "aria-labelledby": "trials-title" }, h("h2", { id: "trials-title" }, "Trials"), tableBox),
    checkpointsBox,
    playgroundBox,
    trackersBox,
    h("section", { "aria-labelledby": "events-title" }, h("h2", { id: "events-title" }, "Events"), log));
  let tryOut = null; // the playground, once the task is read (a tenant's only: the admin token does not sample)
  let outputs = null; // the checkpoints and trackers sections, once the task is read

  async function save(path, name) {
    alert.textContent = "";
    try {
      await download(path, name);
    } catch (e) {
      alert.textContent = `Download failed: ${e.message}`;
    }
  }

  const bestId = () => state.task?.best_trial?.id || null;

  function renderSummary() {
    const t = state.task;
    clear(summary);
    const items = [
      ["State", badge(t.state)],
      ...(operator ? [["Tenant", h("span", { class: "mono", id: "task-tenant" }, t.tenant_id)]] : []),
      ...(waitingMessage(t) && !FINAL.has(t.state)
        ? [["Waiting", h("span", { class: "waiting", id: "waiting-reason", role: "status" }, waitingMessage(t))]]
        : []),
      ["Base model", t.base_model],
      ["Progress", progressCell(t)],
      ["Trials", trialSummary(t.trial_counts)],
      [`Best val ${lossName(t)}`,
        t.best_trial ? `${fmt.loss(t.best_trial.best_val_loss)} (step ${fmt.num(t.best_trial.best_step)})` : "—"],
      ...(metricOf(t) ? [["Best " + metricName(metricOf(t)), h("span", { id: "best-metric" },
        t.best_trial ? score(t.best_trial.metric_score) : "—")]] : []),
      ["Time left", t.state === "running" ? fmt.duration(t.estimated_seconds_left) : "—"],
      ["Created", fmt.datetime(t.created_at)],
    ];
    if (t.error) items.push(["Error", t.error]);
    summary.append(h("dl", {}, items.map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)])));
    clear(settings).append(renderSettings(t));

    clear(actions);
    const best = state.trials.find((tr) => tr.id === bestId());
    actions.append(h("button", { type: "button", id: "download-best", disabled: !(best && best.adapter_ready),
      onclick: () => save(`/v1/tasks/${taskId}/adapter`, `${taskId}-adapter.tar.gz`) }, "Download best adapter"));
    if (t.refit) {
      // The best configuration trained again on training + validation rows ("refit": true): an adapter of its own.
      const refit = state.trials.find((tr) => tr.id === t.refit_trial_id);
      actions.append(h("button", { type: "button", id: "download-refit", disabled: !(refit && refit.adapter_ready),
        title: "The best configuration trained again on the training and validation rows",
        onclick: () => save(`/v1/tasks/${taskId}/adapter?refit=true`, `${taskId}-refit-adapter.tar.gz`) },
        "Download refit adapter"));
    }
    if (!FINAL.has(t.state) && !operator) {
      actions.append(h("button", { type: "button", class: "secondary", onclick: async () => {
        if (!window.confirm(`Cancel ${taskId} and its unfinished trials?`)) return;
        try {
          await api.post(`/v1/tasks/${taskId}/cancel`);
          poller.trigger();
        } catch (e) {
          alert.textContent = e.message;
        }
      } }, "Cancel task"));
    }
  }

  /** The task's bar, coloured by its state; a failed or cancelled task's shows how far its trials got. */
  function progressCell(t) {
    const stopped = t.state === "failed" || t.state === "cancelled";
    const p = stopped ? reached(state.trials) : t.progress;
    return h("span", { class: "progress-cell", id: "task-progress" }, progressBar(p, "Task progress", t.state),
      stopped ? `${t.state} at ${fmt.pct(p)}` : fmt.pct(p));
  }

  function label(t) {
    const hp = t.hyperparameters;
    // A DPO task's trials often differ by beta alone: without it, their legend entries would read the same.
    const beta = hp.beta === null || hp.beta === undefined ? "" : ` β=${fmt.lr(hp.beta)}`;
    return `#${t.index} lr=${fmt.lr(hp.learning_rate)} r=${hp.lora_rank} b=${hp.batch_size}${beta}`;
  }

  /** The drawing width of a figure: its box's, so the chart stays legible from a phone to a wide screen. */
  function widthOf(box) {
    const inner = box.clientWidth - 18; // less its padding and border
    return inner > 0 ? Math.max(280, Math.round(inner)) : 1000;
  }

  function toggleTrial(id, event) {
    const isolate = Boolean(event && (event.shiftKey || event.altKey));
    state.hidden = toggled(state.hidden, state.trials.map((t) => t.id), id, isolate);
    renderChart();
    renderTable();
  }

  /** Why there is no curve at all: a failed task says so, with its reason, rather than an empty chart. */
  function noCurves() {
    const t = state.task;
    if (t.state === "failed") return `No curves: the task failed (${t.error || "no reason given"}).`;
    if (t.state === "cancelled") return "No curves: the task was cancelled before any trial reported a loss.";
    return null;
  }

  /** The loss chart's heading and key: a DPO task's train and validation losses are DPO losses. */
  function renderCurvesText() {
    const loss = lossName(state.task);
    curvesTitle.textContent = isDpo(state.task) ? "DPO loss curves" : "Loss curves";
    curvesNote.textContent = `Solid: train ${loss}. Dashed with dots: validation ${loss}. ` +
      "Thick: the best trial. ×: stopped early (hover for the reason). " +
      "Click a trial below (or its row in the table) to hide or show it; Shift- or Alt-click to show it alone.";
  }

  function renderChart() {
    renderCurvesText();
    const series = state.trials.map((t) => {
      const c = state.curves.get(t.id) || noPoints();
      return { id: t.id, label: label(t), colour: colourOf(t.index), train: c.train, val: c.val,
        best: t.id === bestId(), stopped: t.state === "stopped_early" ? (t.stop_reason || "stopped") : null };
    });
    const maxStep = Math.max(1, ...state.trials.map((t) => t.total_steps));
    const points = series.some((line) => line.train.length || line.val.length);
    const why = points ? null : noCurves();
    clear(chartBox);
    if (why) {
      chartBox.append(h("p", { class: "no-curves", role: "status" }, why));
    } else {
      const width = widthOf(chartBox);
      const shown = series.filter((line) => !state.hidden.has(line.id));
      chartBox.append(lossChart(shown, { maxStep, width, height: Math.min(380, Math.max(220, Math.round(width * 0.42))),
        logY: state.logY, lossName: lossName(state.task),
        empty: shown.length || !series.length ? "No loss points yet" : "Every trial is hidden: pick one below" }),
      h("figcaption", { class: "sr-only" }, "Loss by step for every trial shown; the table below has the numbers."));
    }
    renderRewards();
    clear(legend);
    for (const t of state.trials) {
      const swatch = h("span", { class: "swatch", "aria-hidden": "true" });
      swatch.style.background = colourOf(t.index);
      const visible = !state.hidden.has(t.id);
      legend.append(h("li", { class: [t.id === bestId() ? "best" : "", visible ? "" : "off"].join(" ").trim() || null },
        h("button", { type: "button", class: "legend-toggle", "aria-pressed": String(visible), dataset: { trial: t.id },
          title: "Click: hide or show. Shift- or Alt-click: show it alone.", onclick: (e) => toggleTrial(t.id, e) },
        swatch, label(t)), " ", badge(t.state),
        t.id === bestId() ? h("strong", {}, " best") : null,
        t.state === "stopped_early" ? h("span", { class: "reason" }, ` — ${t.stop_reason || "stopped"}`) : null));
    }
  }

  /** A DPO task's reward charts, the trials shown on the loss chart on each (nothing for an SFT task). */
  function renderRewards() {
    if (!isDpo(state.task)) return;
    const maxStep = Math.max(1, ...state.trials.map((t) => t.total_steps));
    const shown = state.trials.filter((t) => !state.hidden.has(t.id));
    const empty = !shown.length && state.trials.length ? "Every trial is hidden"
      : FINAL.has(state.task.state) ? "No validation was reported" : "No validation yet";
    REWARD_CHARTS.forEach((chart, i) => {
      const box = rewardBoxes[i];
      const series = shown.map((t) => {
        const c = (state.curves.get(t.id) || noPoints()).rewards;
        return { id: t.id, label: label(t), colour: colourOf(t.index), best: t.id === bestId(),
          lines: chart.lines.map(([split, dashed]) => ({ points: c[split], dashed })) };
      });
      const width = widthOf(box);
      clear(box).append(h("figcaption", {}, chart.title), rewardChart(series, { maxStep, width,
        height: Math.min(280, Math.max(200, Math.round(width * 0.6))), yLabel: chart.yLabel, what: chart.what,
        range: chart.range, zero: Boolean(chart.zero), empty }));
    });
  }

  /** The chosen hyperparameter against each trial's best validation loss (or metric score), a dot per trial. */
  function renderScatter() {
    const params = hyperparametersOf(state.task);
    if (!hpSelect.options.length) hpSelect.append(...params.map((p) => h("option", { value: p.key }, p.label)));
    if (!state.hp) state.hp = varying(state.trials, params);
    hpSelect.value = state.hp;
    const param = params.find((p) => p.key === state.hp);
    const metric = metricOf(state.task);
    const yLabel = metric ? `${metricName(metric)} score` : `best validation ${lossName(state.task)}`;
    const points = state.trials.map((t) => {
      const raw = t.hyperparameters[param.key];
      return { id: t.id, label: label(t), state: t.state, y: metric ? t.metric_score : t.best_val_loss,
        x: param.text ? fmt.modules(raw) : raw };
    });
    const missing = points.filter((p) => p.y === null || p.y === undefined).length;
    hpNote.textContent = `${metric ? "Higher is better" : "Lower is better"}. Dots coloured by trial state.` +
      (missing ? ` ${missing} trial(s) have no ${yLabel} yet.` : "");
    const width = widthOf(scatterBox);
    const height = missing === points.length ? 90 : Math.min(300, Math.max(200, Math.round(width * 0.32))); // nothing: a line
    clear(scatterBox).append(scatterChart(points, { width, height,
      xLabel: param.label, yLabel, logX: Boolean(param.log), empty: `No trial has a ${yLabel} yet` }));
  }

  /** The trials table's sortable columns: a DPO task's add beta, name its losses, and call its score by its name. */
  function columnsOf(task) {
    const metric = metricOf(task);
    if (!isDpo(task)) return metric ? [...COLUMNS, { ...METRIC_COLUMN, label: `Metric (${metric})` }] : COLUMNS;
    const loss = lossName(task);
    const named = { train: `Last train ${loss}`, val: `Best val ${loss}` };
    const columns = COLUMNS.flatMap((c) => {
      const column = named[c.key] ? { ...c, label: named[c.key] } : c;
      return c.key === "lr" ? [column, BETA_COLUMN] : [column];
    });
    if (!metric) return columns;
    const name = metricName(metric);
    return [...columns, { ...METRIC_COLUMN, label: name[0].toUpperCase() + name.slice(1) }];
  }

  function renderTable() {
    const metric = metricOf(state.task);
    const dpo = isDpo(state.task);
    const columns = columnsOf(state.task);
    const { key, dir } = state.sort;
    const column = columns.find((c) => c.key === key) || COLUMNS.find((c) => c.key === "val");
    const rows = [...state.trials].sort((a, b) => dir * compare(column.value(a), column.value(b)) || a.index - b.index);
    const head = h("tr", {}, columns.map((c) => h("th", { scope: "col",
      "aria-sort": c.key === key ? (dir > 0 ? "ascending" : "descending") : "none" },
    h("button", { type: "button", class: "sort", onclick: () => {
      state.sort = { key: c.key, dir: c.key === key ? -dir : 1 };
      renderTable();
      tableBox.querySelector(`th button[data-key="${c.key}"]`)?.focus(); // keep the keyboard where it was
    }, dataset: { key: c.key } }, c.label, h("span", { "aria-hidden": "true" }, c.key === key ? (dir > 0 ? " ▲" : " ▼") : ""))),
    ), h("th", { scope: "col" }, "Stop reason"), h("th", { scope: "col" }, "Adapter"));
    const body = h("tbody", {}, rows.map((t) => {
      const hp = t.hyperparameters;
      const isBest = t.id === bestId();
      const off = state.hidden.has(t.id);
      return h("tr", { class: [isBest ? "best" : "", off ? "off" : ""].join(" ").trim() || null, dataset: { trial: t.id },
        title: off ? "Hidden from the chart: click to show" : "Click to hide from the chart; Shift- or Alt-click to show it alone",
        onclick: (e) => { if (!e.target.closest("button")) toggleTrial(t.id, e); } },
        h("td", {}, String(t.index), isBest ? h("span", { class: "tag" }, "best") : null,
          t.refit_of ? h("span", { class: "tag", title: "The best configuration on training + validation rows" },
            "refit") : null),
        h("td", {}, badge(t.state)),
        h("td", { class: "num" }, `${t.steps_done}/${t.total_steps}`),
        h("td", { class: "num" }, fmt.lr(hp.learning_rate)),
        dpo ? h("td", { class: "num beta" }, fmt.num(hp.beta)) : null,
        h("td", { class: "num" }, fmt.num(hp.lora_rank)),
        h("td", { class: "num" }, fmt.num(hp.lora_alpha)),
        h("td", { class: "num" }, fmt.num(hp.batch_size)),
        h("td", { class: "num" }, fmt.num(hp.lora_dropout)),
        h("td", {}, fmt.modules(hp.target_modules)),
        h("td", { class: "num" }, fmt.loss(t.last_train_loss)),
        h("td", { class: "num" }, fmt.loss(t.best_val_loss)),
        metric ? h("td", { class: "num metric" }, score(t.metric_score)) : null,
        h("td", { class: "small" }, t.stop_reason || t.error || ""),
        h("td", {}, h("button", { type: "button", class: "small-button", disabled: !t.adapter_ready,
          "aria-label": `Download the adapter of trial ${t.index}`,
          onclick: () => save(`/v1/tasks/${taskId}/trials/${t.id}/adapter`, `${t.id}-adapter.tar.gz`) }, "Download")));
    }));
    clear(tableBox).append(h("table", { class: "data", id: "trials" },
      h("caption", { class: "sr-only" }, "Trials; the column buttons sort"), h("thead", {}, head), body));
  }

  // Why the task waits: the task's own `waiting` (the scheduler's reason, place in the queue and expected start),
  // else the newest waiting event's message.
  function waitingMessage(t) {
    return (t.waiting && t.waiting.message) || state.waiting;
  }

  function addEvent(event) {
    if (event.type === "task.waiting_for_model" || event.type === "task.waiting") state.waiting = event.message;
    else if (event.type === "task.model_available") state.waiting = null;
    state.events.push(event);
    log.prepend(h("li", { class: `level-${event.level}`, dataset: { type: event.type } },
      h("time", { datetime: event.created_at }, fmt.time(event.created_at)), " ",
      h("code", {}, event.type), " ", event.message));
    while (state.events.length > MAX_EVENTS) {
      state.events.shift();
      log.lastElementChild?.remove();
    }
  }

  /** The curves' new points: every point past a step all unfinished trials have passed, less an
   * evaluation interval (a validation point can be written after the next train points). */
  async function fetchCurves() {
    const open = state.trials.filter((t) => !TRIAL_FINAL.has(t.state) || !state.curves.has(t.id));
    const lasts = (open.length ? open : state.trials).map((t) => {
      const c = state.curves.get(t.id);
      return c && c.train.length ? c.train[c.train.length - 1][0] : 0;
    });
    const after = lasts.length ? Math.max(0, Math.min(...lasts) - (state.task.eval_interval || 0)) : 0;
    const rows = await ndjson(`/v1/tasks/${taskId}/curves${after > 0 ? `?after_step=${after}` : ""}`, { signal });
    for (const row of rows) {
      const c = state.curves.get(row.trial_id) || noPoints();
      for (const split of ["train", "val"]) c[split] = appended(c[split], row[split]);
      // A DPO trial's row has its validations' reward metrics too; an SFT trial's has no `rewards`.
      for (const split of PREFERENCE_SPLITS) c.rewards[split] = appended(c.rewards[split], row.rewards?.[split]);
      state.curves.set(row.trial_id, c);
    }
  }

  const controller = new AbortController();
  const signal = controller.signal;
  let curvesComplete = false;

  async function refresh() {
    const [task, trials] = await Promise.all([
      api.get(`/v1/tasks/${taskId}`, { signal }), api.get(`/v1/tasks/${taskId}/trials`, { signal })]);
    state.task = task;
    state.trials = trials.data;
    if (isDpo(task) && !rewards.isConnected) curvesSection.after(rewards);
    if (!curvesComplete) await fetchCurves();
    renderSummary();
    renderChart();
    renderScatter();
    renderTable();
    if (!operator && !tryOut) {
      tryOut = playground(task, { trials: () => state.trials, bestId });
      playgroundBox.append(tryOut.section);
    }
    tryOut?.update();
    if (!outputs) {
      const shared = { trials: () => state.trials, bestId, signal,
        onError: (e) => { alert.textContent = e.message; } };
      outputs = [checkpoints(task, shared), trackers(task, shared)];
      checkpointsBox.append(outputs[0].section);
      trackersBox.append(outputs[1].section);
    }
    for (const part of outputs) part.update(); // each reads what it shows on its own; errors land in the alert
    if (FINAL.has(task.state)) {
      curvesComplete = true; // read after the task was final: nothing more will come
      poller.stop();
    }
  }

  const poller = new Poller(refresh, { intervalMs: 3000, minGapMs: 1000 });
  const stream = new TaskStream(taskId, {
    onEvent: (event) => { addEvent(event); poller.trigger(); },
    onEnd: () => { poller.trigger(); },
    onMode: (mode) => {
      liveNote.textContent = { stream: "live", polling: "live (polling)", ended: "final" }[mode];
      liveNote.dataset.mode = mode;
    },
    onError: (e) => { alert.textContent = e.message; },
  });

  return (async () => {
    try {
      await refresh();
    } catch (e) {
      alert.textContent = e.status === 404 ? `No task ${taskId}.` : e.message;
      return { dispose: () => controller.abort() };
    }
    if (!FINAL.has(state.task.state)) poller.start({ immediate: false });
    stream.start(); // a final task's stream sends its whole log, then `end`
    // The charts are drawn to their box's width: redrawn when it changes (a resized window, a rotated phone).
    let drawnWidth = chartBox.clientWidth;
    const resized = new ResizeObserver(() => {
      if (chartBox.clientWidth === drawnWidth || !state.task) return;
      drawnWidth = chartBox.clientWidth;
      renderChart();
      renderScatter();
    });
    resized.observe(chartBox);
    return { dispose() { controller.abort(); poller.stop(); stream.close(); resized.disconnect(); } };
  })();
}
