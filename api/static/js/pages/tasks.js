// The tenant's tasks, newest first, refreshed every few seconds while the tab is visible. The operator (admin token)
// sees every tenant's, with a tenant column and a tenant filter, read-only: each read is in the audit log.

import { api } from "../api.js";
import { badge, clear, fmt, h, progressBar } from "../dom.js";
import { Poller } from "../live.js";
import { isDpo } from "../objective.js";

const PAGE = 50;
const TRIAL_STATES = ["running", "pending", "waiting", "completed", "stopped_early", "failed", "cancelled"];

export function trialSummary(counts) {
  const parts = TRIAL_STATES.filter((st) => counts[st]).map((st) => `${counts[st]} ${st.replace("_", " ")}`);
  return parts.join(" · ") || "none";
}

/** A table row; `tenantNames` (the operator's view only) adds the owning tenant's cell. */
function row(task, tenantNames = null) {
  const total = Object.values(task.trial_counts).reduce((a, b) => a + b, 0);
  return h("tr", { dataset: { task: task.id } },
    // A DPO task says so under its model: its "best val loss" is a DPO loss, not a next-token loss.
    h("td", {}, h("a", { href: `#/tasks/${task.id}` }, task.id),
      h("div", { class: "muted small" }, isDpo(task) ? `${task.base_model} · DPO` : task.base_model)),
    tenantNames ? h("td", { class: "tenant", dataset: { tenant: task.tenant_id } },
      tenantNames.get(task.tenant_id) || task.tenant_id) : null,
    h("td", {}, badge(task.state)),
    h("td", { class: "progress-cell" }, progressBar(task.progress, `Progress of ${task.id}`, task.state),
      h("span", { class: "small" }, fmt.pct(task.progress))),
    h("td", { class: "num" }, fmt.loss(task.best_trial?.best_val_loss)),
    h("td", {}, h("span", { class: "small" }, `${total}: ${trialSummary(task.trial_counts)}`)),
    h("td", { class: "num" }, task.state === "running" ? fmt.duration(task.estimated_seconds_left) : "—"),
    h("td", { class: "small" }, fmt.datetime(task.created_at)));
}

/** The operator's tenant filter: every tenant (deleted ones too: their finished tasks are kept), by name. */
async function tenantFilter(onchange) {
  const tenants = await api.get("/v1/admin/tenants?limit=100&include_deleted=true");
  const names = new Map(tenants.data.map((t) => [t.id, t.name]));
  const select = h("select", { id: "tenant-filter", onchange },
    h("option", { value: "" }, "Every tenant"),
    tenants.data.map((t) => h("option", { value: t.id }, t.deleted_at ? `${t.name} (deleted)` : t.name)));
  return { names, select };
}

export async function mount(root, { session }) {
  const operator = session.role === "admin";
  const status = h("p", { class: "muted", role: "status" });
  const body = h("tbody");
  const columns = ["Task", ...(operator ? ["Tenant"] : []), "State", "Progress", "Best val loss", "Trials",
    "Time left", "Created"];
  const table = h("table", { class: "data", id: "tasks" },
    h("caption", { class: "sr-only" }, operator ? "Every tenant's tasks, newest first" : "Your tasks, newest first"),
    h("thead", {}, h("tr", {}, ...columns.map((c) => h("th", { scope: "col" }, c)))),
    body);
  let filter = null;
  if (operator) {
    try {
      filter = await tenantFilter(() => poller.trigger());
    } catch (e) {
      status.textContent = `The tenants could not be read (${e.message}): every tenant's tasks, by tenant id.`;
    }
  }
  const names = operator ? (filter?.names || new Map()) : null;
  root.append(
    h("div", { class: "page-head" }, h("h1", {}, "Tasks"),
      operator ? (filter && h("label", { class: "check" }, "Tenant ", filter.select))
        : h("a", { class: "button", href: "#/submit" }, "New task")),
    operator ? h("p", { class: "muted small", id: "operator-note" },
      "Read-only: the operator's reads of a tenant's tasks are recorded in the audit log (GET /v1/admin/audit).")
      : null,
    status, table);

  const poller = new Poller(async () => {
    const tenant = filter?.select.value;
    const page = await api.get(`/v1/tasks?limit=${PAGE}${tenant ? `&tenant_id=${encodeURIComponent(tenant)}` : ""}`);
    clear(body);
    page.data.forEach((task) => body.append(row(task, names)));
    if (operator) table.dataset.tenant = tenant || ""; // the filter the rows shown were read with
    status.textContent = page.data.length
      ? (page.has_more ? `The newest ${PAGE} tasks.` : `${page.data.length} task(s).`)
      : (operator ? "No tasks." : "No tasks yet: submit one with “New task”.");
  }, { intervalMs: 5000 }).start();
  return { dispose: () => poller.stop() };
}
