// The operator's view of the fleet: utilisation, workers (one GPU, or several of one host) with their live pack,
// and every live pack slot by slot. Re-read every 5 seconds while the tab is visible.

import { api } from "../api.js";
import { badge, clear, fmt, h, progressBar } from "../dom.js";
import { Poller } from "../live.js";

function stat(label, value) {
  return h("div", { class: "stat" }, h("div", { class: "stat-value" }, value), h("div", { class: "muted small" }, label));
}

// A quarantined worker (it lost packs repeatedly) gets no pack until its quarantine ends: say so, and until when.
function workerState(w) {
  if (!w.quarantined_until) return badge(w.state);
  return h("span", { title: `${w.recent_lost_packs} packs lost recently; no packs until ${fmt.datetime(w.quarantined_until)}` },
    badge("quarantined"), h("span", { class: "small" }, ` until ${fmt.time(w.quarantined_until)}`));
}

function workersTable(workers) {
  return h("table", { class: "data", id: "workers" },
    h("caption", {}, "Workers"),
    h("thead", {}, h("tr", {}, ["Worker", "State", "Device", "Memory", "Slots in use", "Pack", "Models",
      "Last heartbeat"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, workers.map((w) => h("tr", { dataset: { worker: w.id } },
      h("td", { class: "mono" }, w.id), h("td", {}, workerState(w)), h("td", {}, w.device),
      // A worker over several GPUs: its GPU count times one GPU's memory.
      h("td", { class: "num" }, (w.gpus > 1 ? `${w.gpus} × ` : "") + fmt.bytes(w.memory_bytes)),
      h("td", { class: "progress-cell" }, progressBar(w.utilisation, `Slots in use on ${w.id}`),
        `${w.used_slots}/${w.max_slots}`),
      h("td", { class: "mono small" }, w.pack_id || "idle"),
      // The registered models it can load (null: it does not say, taken as every one).
      h("td", { class: "small" }, w.models == null ? "any" : (w.models.join(", ") || "none")),
      h("td", { class: "small" }, fmt.time(w.last_heartbeat))))));
}

function packCard(pack) {
  const slots = [];
  for (let i = 0; i < pack.capacity; i += 1) {
    const slot = pack.slots[i];
    slots.push(slot
      ? h("li", { class: "slot used", title: `${slot.task_id} trial ${slot.index}` },
        h("span", { class: "mono small" }, `${slot.task_id.slice(0, 13)}… #${slot.index}`),
        progressBar(slot.total_steps ? slot.steps_done / slot.total_steps : 0, `Trial ${slot.index} steps`),
        h("span", { class: "small" }, `${slot.steps_done}/${slot.total_steps}${slot.awaiting_admission ? " (admitting)" : ""}`))
      : h("li", { class: "slot free" }, h("span", { class: "muted small" }, "free")));
  }
  return h("article", { class: "card pack", dataset: { pack: pack.id } },
    h("h3", {}, h("span", { class: "mono" }, pack.id), " ", badge(pack.state)),
    h("p", { class: "small" }, `${pack.base_model} on ${pack.worker_id} · ${pack.slots.length}/${pack.capacity} slots · `,
      pack.tokens_per_s ? `${Math.round(pack.tokens_per_s)} tokens/s` : "no speed measured yet",
      pack.max_rank ? ` · rank ≤ ${pack.max_rank}` : ""),
    h("ol", { class: "slots", "aria-label": `Slots of ${pack.id}` }, slots));
}

export function mount(root) {
  const alert = h("p", { class: "error", role: "alert" });
  const stats = h("section", { class: "stats", "aria-label": "Utilisation" });
  const workers = h("section", {});
  const packs = h("section", { "aria-labelledby": "packs-title" });
  const tenants = h("section", {});
  root.append(h("h1", {}, "Cluster"), alert, stats, workers, packs, tenants);

  const poller = new Poller(async () => {
    const [cluster, live] = await Promise.all([api.get("/v1/admin/cluster"), api.get("/v1/admin/packs?state=live")]);
    alert.textContent = "";
    clear(stats).append(
      stat("slot utilisation", fmt.pct(cluster.utilisation)),
      stat("slots in use", `${cluster.slots_used}/${cluster.slots_total}`),
      stat("workers busy", `${cluster.workers_busy}/${cluster.workers_alive}`),
      stat("workers lost", String(cluster.workers_lost)),
      stat("workers quarantined", String(cluster.workers_quarantined)),
      stat("trials running", String(cluster.trials_running)),
      stat("trials waiting", String(cluster.trials_pending)));
    clear(workers).append(cluster.workers.length ? workersTable(cluster.workers)
      : h("p", { class: "muted" }, "No worker has registered yet."));
    clear(packs).append(h("h2", { id: "packs-title" }, "Live packs"),
      live.data.length ? h("div", { class: "packs" }, live.data.map(packCard)) : h("p", { class: "muted" }, "No pack is training."));
    clear(tenants).append(h("h2", {}, "Demand by tenant"), cluster.tenants.length
      ? h("table", { class: "data" }, h("thead", {}, h("tr", {}, ["Tenant", "Running trials", "Waiting trials"]
        .map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, cluster.tenants.map((t) => h("tr", {}, h("td", {}, t.name),
        h("td", { class: "num" }, String(t.running_trials)), h("td", { class: "num" }, String(t.pending_trials))))))
      : h("p", { class: "muted" }, "No tenant has trials waiting or running."));
  }, { intervalMs: 5000 }).start();
  return { dispose: () => poller.stop() };
}
