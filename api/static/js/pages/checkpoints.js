// The task page's checkpoints (issue 35): one trial's kept adapters (each epoch's end, its best and its last; GET
// .../trials/{id}/checkpoints) with their step, validation loss and size, each downloadable in PEFT format. A trial
// still training gets new ones: its list is read again with the page; an ended trial's list is read once.

import { api, download } from "../api.js";
import { TRIAL_FINAL, clear, fmt, h } from "../dom.js";

const KIND_TITLES = {
  best: "The lowest validation loss of the kept ones",
  last: "The newest: the trial's last step once it has ended",
  epoch: "It ends an epoch",
};

/** The checkpoints' section. `trials()` gives the task's trials now, `bestId()` its best trial's id, `onError(e)`
 * shows what failed. */
export function checkpoints(task, { trials, bestId, onError, signal }) {
  const pick = h("select", { id: "checkpoints-trial", onchange: () => { chosen = pick.value; read(); } });
  const note = h("p", { class: "muted small", id: "checkpoints-note", role: "status" });
  const tableBox = h("div", { class: "table-box" });
  let chosen = null; // the trial shown: the best once there is one, until the user picks another
  let picked = false;
  const lists = new Map(); // trial id -> { rows, ended }: an ended trial's list is final

  function renderPick() {
    const shown = trials().filter((t) => t.steps_done > 0);
    if (!picked && bestId()) chosen = bestId();
    if (!chosen && shown.length) chosen = shown[0].id;
    clear(pick).append(...shown.map((t) => h("option", { value: t.id, selected: t.id === chosen },
      `trial ${t.index}${t.id === bestId() ? " (best)" : ""}`)));
    pick.disabled = !shown.length;
  }

  function renderTable() {
    const list = lists.get(chosen);
    clear(tableBox);
    if (task.training && task.training.checkpoints === false) {
      note.textContent = "This task keeps no checkpoints (its training.checkpoints is false).";
      return;
    }
    if (!chosen || !list) {
      note.textContent = chosen ? "Reading…" : "No trial has trained yet.";
      return;
    }
    note.textContent = list.rows.length ? "" : "No checkpoint yet: the first comes at the trial's first epoch's end.";
    if (!list.rows.length) return;
    const head = h("tr", {}, ["Step", "Epoch", "Kind", "Val loss", "Metric", "Size", "Adapter"].map(
      (label) => h("th", { scope: "col" }, label)));
    const body = h("tbody", {}, list.rows.map((c) => h("tr", { dataset: { step: String(c.step) } },
      h("td", { class: "num" }, fmt.num(c.step)),
      h("td", { class: "num" }, String(c.epoch)),
      h("td", {}, c.kinds.map((kind) => h("span", { class: "tag", title: KIND_TITLES[kind] }, kind))),
      h("td", { class: "num" }, fmt.loss(c.val_loss)),
      h("td", { class: "num" }, c.metric_score === null ? "—" : c.metric_score.toFixed(3)),
      h("td", { class: "num" }, fmt.bytes(c.size_bytes)),
      h("td", {}, h("button", { type: "button", class: "small-button",
        "aria-label": `Download the checkpoint at step ${c.step}`, title: `As model: ${c.model}`,
        onclick: () => save(c) }, "Download")))));
    tableBox.append(h("table", { class: "data", id: "checkpoints" },
      h("caption", { class: "sr-only" }, "The chosen trial's checkpoints, oldest first"), h("thead", {}, head), body));
  }

  async function save(c) {
    try {
      await download(`/v1/tasks/${task.id}/trials/${c.trial_id}/checkpoints/${c.step}/adapter`,
        `${c.trial_id}-step-${c.step}.tar`);
    } catch (e) {
      onError(e);
    }
  }

  /** The chosen trial's list, read unless it is already final. */
  async function read() {
    renderTable();
    const trial = trials().find((t) => t.id === chosen);
    if (!trial || lists.get(chosen)?.ended || task.training?.checkpoints === false) return;
    const id = chosen;
    const ended = TRIAL_FINAL.has(trial.state); // read after the trial ended: nothing more will come
    try {
      const page = await api.get(`/v1/tasks/${task.id}/trials/${id}/checkpoints`, { signal });
      lists.set(id, { rows: page.data, ended });
    } catch (e) {
      if (e.name !== "AbortError") onError(e);
      return;
    }
    if (id === chosen) renderTable();
  }

  pick.addEventListener("change", () => { picked = true; });
  const section = h("section", { id: "checkpoints-section", "aria-labelledby": "checkpoints-title" },
    h("h2", { id: "checkpoints-title" }, "Checkpoints"),
    h("p", { class: "muted small" }, "A trial's adapter kept at each epoch's end, at its best validation and at its ",
      "last step; each downloads in PEFT format, and samples by its step (the API's \"checkpoint\")."),
    h("div", { class: "chart-tools" }, h("label", { for: "checkpoints-trial" }, "Trial"), pick),
    note, tableBox);
  return { section, update: () => { renderPick(); return read(); } };
}
