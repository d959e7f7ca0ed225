// The operator's tenants with their quotas and API keys (prefixes only: the secret is never kept). Read
// once and on "Refresh" rather than on a timer: it costs a request per tenant, and tenants change rarely.

import { api } from "../api.js";
import { clear, fmt, h } from "../dom.js";
import { Poller } from "../live.js";
import { secondsLabel } from "./cluster.js";

export function mount(root) {
  const status = h("p", { class: "muted", role: "status" });
  const box = h("div", {});
  const refresh = h("button", { type: "button", class: "secondary", onclick: () => poller.trigger() }, "Refresh");
  root.append(h("div", { class: "page-head" }, h("h1", {}, "Tenants"), refresh), status, box);

  const poller = new Poller(async () => {
    const tenants = [];
    let after = "";
    for (let page = 0; page < 10; page += 1) { // 1,000 tenants at most on one page; enough for a dashboard
      const got = await api.get(`/v1/admin/tenants?limit=100${after ? `&after=${after}` : ""}`);
      tenants.push(...got.data);
      if (!got.has_more) break;
      after = got.data[got.data.length - 1].id;
    }
    const [keys, usage, cluster] = await Promise.all([
      Promise.all(tenants.map((t) => api.get(`/v1/admin/tenants/${t.id}/api-keys`))),
      api.get("/v1/admin/usage"), // since the beginning (GET /v1/admin/usage?from=&to= narrows it)
      api.get("/v1/admin/cluster"), // its workers' devices name the seconds: CPU, GPU or device seconds
    ]);
    const used = new Map(usage.data.map((u) => [u.tenant_id, u]));
    const nothing = { gpu_seconds: 0, tokens: 0, storage_bytes: 0 };
    status.textContent = `${tenants.length} tenant(s).`;
    clear(box).append(h("table", { class: "data", id: "tenants" },
      h("caption", { class: "sr-only" }, "Tenants, newest first"),
      h("thead", {}, h("tr", {}, ["Tenant", "Weight", "Concurrent trials", "Trials per task", "Max file",
        "Max storage", "Max files", secondsLabel(cluster.workers), "Tokens trained", "Stored", "API keys", "Created"]
        .map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, tenants.map((t, i) => h("tr", { dataset: { tenant: t.id } },
        h("td", {}, h("strong", {}, t.name), h("div", { class: "mono small muted" }, t.id)),
        h("td", { class: "num" }, String(t.weight)),
        h("td", { class: "num" }, String(t.max_concurrent_trials)),
        h("td", { class: "num" }, String(t.max_trials_per_task)),
        h("td", { class: "num" }, fmt.bytes(t.max_file_bytes)),
        h("td", { class: "num" }, fmt.bytes(t.max_storage_bytes)),
        h("td", { class: "num" }, String(t.max_files)),
        h("td", { class: "num usage-gpu" }, (used.get(t.id) || nothing).gpu_seconds.toFixed(1)),
        h("td", { class: "num usage-tokens" }, String((used.get(t.id) || nothing).tokens)),
        h("td", { class: "num" }, fmt.bytes((used.get(t.id) || nothing).storage_bytes)),
        h("td", { class: "small" }, keys[i].data.map((k) => h("div", {}, h("code", {}, `${k.prefix}…`),
          ` ${k.name}`, k.revoked_at ? h("span", { class: "muted" }, " (revoked)") : null))),
        h("td", { class: "small" }, fmt.datetime(t.created_at)))))));
  }, { intervalMs: 24 * 3600 * 1000, minGapMs: 500 }).start();
  return { dispose: () => poller.stop() };
}
