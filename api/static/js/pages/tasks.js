// The tenant's tasks, newest first, refreshed every few seconds while the tab is visible.

import { api } from "../api.js";
import { badge, clear, fmt, h, progressBar } from "../dom.js";
import { Poller } from "../live.js";

const PAGE = 50;
const TRIAL_STATES = ["running", "pending", "waiting", "completed", "stopped_early", "failed", "cancelled"];

export function trialSummary(counts) {
  const parts = TRIAL_STATES.filter((st) => counts[st]).map((st) => `${counts[st]} ${st.replace("_", " ")}`);
  return parts.join(" · ") || "none";
}

function row(task) {
  const total = Object.values(task.trial_counts).reduce((a, b) => a + b, 0);
  return h("tr", { dataset: { task: task.id } },
    h("td", {}, h("a", { href: `#/tasks/${task.id}` }, task.id), h("div", { class: "muted small" }, task.base_model)),
    h("td", {}, badge(task.state)),
    h("td", { class: "progress-cell" }, progressBar(task.progress, `Progress of ${task.id}`),
      h("span", { class: "small" }, fmt.pct(task.progress))),
    h("td", { class: "num" }, fmt.loss(task.best_trial?.best_val_loss)),
    h("td", {}, h("span", { class: "small" }, `${total}: ${trialSummary(task.trial_counts)}`)),
    h("td", { class: "num" }, task.state === "running" ? fmt.duration(task.estimated_seconds_left) : "—"),
    h("td", { class: "small" }, fmt.datetime(task.created_at)));
}

export function mount(root) {
  const status = h("p", { class: "muted", role: "status" });
  const body = h("tbody");
  const table = h("table", { class: "data" },
    h("caption", { class: "sr-only" }, "Your tasks, newest first"),
    h("thead", {}, h("tr", {}, ...["Task", "State", "Progress", "Best val loss", "Trials", "Time left", "Created"]
      .map((c) => h("th", { scope: "col" }, c)))),
    body);
  root.append(
    h("div", { class: "page-head" }, h("h1", {}, "Tasks"), h("a", { class: "button", href: "#/submit" }, "New task")),
    status, table);

  const poller = new Poller(async () => {
    const page = await api.get(`/v1/tasks?limit=${PAGE}`);
    clear(body);
    page.data.forEach((task) => body.append(row(task)));
    status.textContent = page.data.length
      ? (page.has_more ? `The newest ${PAGE} tasks.` : `${page.data.length} task(s).`)
      : "No tasks yet: submit one with “New task”.";
  }, { intervalMs: 5000 }).start();
  return { dispose: () => poller.stop() };
}
