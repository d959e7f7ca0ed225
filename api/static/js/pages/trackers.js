// The task page's experiment trackers (issue 35; a task's `integrations`): each tracker, how many trials' runs are in
// step there, and why it is behind while it is (GET /v1/tasks/{id}/integrations). Read with the page until every
// run is finished there.

import { api } from "../api.js";
import { clear, h } from "../dom.js";

/** The trackers' section (empty for a task without any). `onError(e)` shows what failed. */
export function trackers(task, { onError, signal }) {
  const box = h("div", { id: "trackers" });
  const section = h("section", { id: "trackers-section", "aria-labelledby": "trackers-title", hidden: true },
    h("h2", { id: "trackers-title" }, "Experiment trackers"),
    h("p", { class: "muted small" }, "Every trial is a run there, with its hyperparameters, curves, end and adapter. ",
      "A tracker that is down delays nothing: its runs catch up once it answers."),
    box);
  let done = false;

  function render(list) {
    clear(box);
    for (const t of list) {
      const synced = t.runs.filter((r) => r.finished).length;
      const behind = t.runs.filter((r) => r.attempts > 0);
      const where = t.type === "wandb" ? `${t.entity ? `${t.entity}/` : ""}${t.experiment} (${t.mode})`
        : `${t.experiment} at ${t.tracking_uri}`;
      box.append(h("article", { class: "tracker", dataset: { type: t.type, done: String(t.done) } },
        h("h3", {}, t.type === "wandb" ? "Weights & Biases" : "MLflow", " ", h("span", { class: "mono" }, where)),
        h("p", { class: "tracker-state" }, t.done ? `every run finished (${synced})`
          : `${synced} of ${t.runs.length} runs finished`, behind.length ? `, ${behind.length} behind` : ""),
        behind.length ? h("ul", { class: "small" }, behind.map((r) => h("li", { dataset: { trial: r.trial_id } },
          `trial ${r.trial_index}: ${r.attempts} failed attempt(s): ${r.last_error || "no answer"}`))) : null));
    }
  }

  async function update() {
    if (done || !(task.integrations || []).length) return;
    section.hidden = false;
    try {
      const page = await api.get(`/v1/tasks/${task.id}/integrations`, { signal });
      render(page.data);
      done = page.data.every((t) => t.done);
    } catch (e) {
      if (e.name !== "AbortError") onError(e);
    }
  }

  return { section, update };
}
