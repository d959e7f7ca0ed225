// The operator's view of the fleet: utilisation, workers (one GPU, or several of one host) with their live packs (a
// worker on one GPU runs up to its max_packs at once, each of another base model) and the memory they left free,
// every live pack (its used and free slots, the trials in the used ones), where the newest finished packs' wall time
// went, and each tenant's demand with why its tasks wait. Re-read every 5 seconds while the tab is visible.

import { api } from "../api.js";
import { badge, clear, fmt, h, progressBar } from "../dom.js";
import { Poller } from "../live.js";

/** What a second of training time is called for these workers: usage is counted per device, and a CPU worker's
 * seconds are no GPU's. "device seconds" when the fleet mixes kinds (or nothing is known yet). */
export function secondsLabel(workers) {
  const kinds = new Set(workers.map((w) => (/^cpu\b/i.test(w.device || "") ? "CPU" : "GPU")));
  return kinds.size === 1 ? `${[...kinds][0]} seconds` : "device seconds";
}

function stat(label, value) {
  return h("div", { class: "stat" }, h("div", { class: "stat-value" }, value), h("div", { class: "muted small" }, label));
}

// A quarantined worker (it lost packs repeatedly) gets no pack until its quarantine ends: say so, and until when.
function workerState(w) {
  if (!w.quarantined_until) return badge(w.state);
  return h("span", { title: `${w.recent_lost_packs} packs lost recently; no packs until ${fmt.datetime(w.quarantined_until)}` },
    badge("quarantined"), h("span", { class: "small" }, ` until ${fmt.time(w.quarantined_until)}`));
}

// The workers table shows a page of them (GET /v1/admin/cluster's `limit`, registered first first): a fleet of
// hundreds is read and drawn a page at a time, the figures above it counting every worker.
const WORKERS_SHOWN = 100;

function workersTable(workers, caption) {
  return h("table", { class: "data", id: "workers" },
    h("caption", {}, caption),
    h("thead", {}, h("tr", {}, ["Worker", "State", "Device", "Memory", "Slots in use", "Packs", "Models", "Warm",
      "Last heartbeat"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, workers.map((w) => h("tr", { dataset: { worker: w.id } },
      h("td", { class: "mono" }, w.id), h("td", {}, workerState(w)), h("td", {}, w.device),
      memoryCell(w),
      h("td", { class: "progress-cell" }, progressBar(w.utilisation, `Slots in use on ${w.id}`),
        `${w.used_slots}/${w.max_slots}`),
      packsCell(w),
      // The registered models it can load (null: it does not say, taken as every one).
      h("td", { class: "small" }, w.models == null ? "any" : (w.models.join(", ") || "none")),
      warmCell(w),
      h("td", { class: "small" }, fmt.time(w.last_heartbeat))))));
}

// A worker over several GPUs: its GPU count times one GPU's memory; below, what its live packs left free for another.
function memoryCell(w) {
  const total = (w.gpus > 1 ? `${w.gpus} × ` : "") + fmt.bytes(w.memory_bytes);
  if (w.free_memory_bytes == null) return h("td", { class: "num" }, total);
  return h("td", { class: "num memory" }, total, h("div", { class: "small muted" }, `${fmt.bytes(w.free_memory_bytes)} free`));
}

// Its live packs (up to max_packs, each of another base model), each with the memory the worker reserved for it.
function packsCell(w) {
  const most = w.max_packs > 1 ? ` (at most ${w.max_packs})` : "";
  if (!w.packs || !w.packs.length) return h("td", { class: "small packs-cell" }, `idle${most}`);
  return h("td", { class: "small packs-cell" }, h("ul", { class: "plain" }, w.packs.map((p) =>
    h("li", { dataset: { pack: p.id } }, h("span", { class: "mono" }, p.id), ` ${p.base_model} `,
      h("span", { class: "muted" }, p.memory_bytes == null ? "" : `${fmt.bytes(p.memory_bytes)} reserved`)))),
  h("div", { class: "muted" }, `${w.packs.length} running${most}`));
}

// The base models it holds loaded between packs, most recently used first: a pack of one starts without loading it.
function warmCell(w) {
  if (w.warm_models == null) return h("td", { class: "small muted warm" }, "—");
  if (!w.warm_models.length) return h("td", { class: "small muted warm" }, "none");
  return h("td", { class: "small warm" }, h("ul", { class: "plain" }, w.warm_models.map((m) =>
    h("li", { title: `revision ${m.revision}; last used ${fmt.datetime(m.last_used_at)}` },
      `${m.name} `, h("span", { class: "muted" }, fmt.bytes(m.bytes))))));
}

/** A pack's slots in one line — "4 used · 28 free" over a bar — and then only the used ones, each with its trial:
 * a pack of 32 slots holding 4 trials is 4 rows, not 28 empty boxes. */
function packCard(pack) {
  const used = pack.slots.length;
  const free = Math.max(0, pack.capacity - used);
  const slots = pack.slots.map((slot) => h("li", { class: "slot used", title: `${slot.task_id} trial ${slot.index}` },
    h("span", { class: "mono small" }, `${slot.task_id.slice(0, 13)}… #${slot.index}`),
    progressBar(slot.total_steps ? slot.steps_done / slot.total_steps : 0, `Trial ${slot.index} steps`, "running"),
    h("span", { class: "small" }, `${slot.steps_done}/${slot.total_steps}${slot.awaiting_admission ? " (admitting)" : ""}`)));
  return h("article", { class: "card pack", dataset: { pack: pack.id } },
    h("h3", {}, h("span", { class: "mono" }, pack.id), " ", badge(pack.state)),
    h("p", { class: "small" }, `${pack.base_model} on ${pack.worker_id} · `,
      pack.tokens_per_s ? `${Math.round(pack.tokens_per_s)} tokens/s` : "no speed measured yet",
      pack.max_rank ? ` · rank ≤ ${pack.max_rank}` : ""),
    h("div", { class: "slots-summary" }, progressBar(pack.capacity ? used / pack.capacity : 0, `Slots of ${pack.id} in use`),
      h("span", { class: "small slot-counts", dataset: { used: String(used), free: String(free) } },
        `${used} used · ${free} free`)),
    h("ol", { class: "slots", "aria-label": `Used slots of ${pack.id}` }, slots));
}

// Where a finished pack's wall time went, from its worker's profile: the training thread's phases side by side in
// one bar (they add up to the wall time), each phase with its seconds below. Persist is the writer thread's time,
// alongside the others: listed, not in the bar.
const FINISHED_SHOWN = 6; // the newest finished packs
const PHASES = ["load", "capture", "steps", "validation", "metric", "snapshot", "persist", "export", "idle", "other"];

function seconds(x) {
  return x === null || x === undefined ? "—" : `${Number(x).toFixed(x < 10 ? 2 : 1)} s`;
}

function phaseBar(phases) {
  const shown = PHASES.filter((p) => p !== "persist" && phases[`${p}_s`] > 0);
  // The bar is the wall time, or the phases' sum should a worker report them past it (a phase it times outside).
  const wall = Math.max(phases.wall_s || 0, shown.reduce((sum, p) => sum + phases[`${p}_s`], 0));
  return h("div", { class: "phase-bar", role: "img", "aria-label": `Wall time by phase: ${shown.map((p) =>
    `${p} ${fmt.pct(phases[`${p}_s`] / wall)}`).join(", ") || "not measured"}` }, shown.map((p) => {
    const part = h("span", { class: `phase phase-${p}`, title: `${p} ${seconds(phases[`${p}_s`])}` });
    part.style.width = `${((100 * phases[`${p}_s`]) / wall).toFixed(2)}%`; // through the CSSOM, as progressBar
    return part;
  }));
}

function phaseLegend(phases) {
  return h("ul", { class: "legend phases small" }, PHASES.map((p) => {
    const value = phases[`${p}_s`];
    const share = p === "persist" || value == null || !phases.wall_s ? "" : ` (${fmt.pct(value / phases.wall_s)})`;
    return h("li", { dataset: { phase: p } }, h("span", { class: `swatch phase-${p}` }),
      `${p}${p === "persist" ? " (writer)" : ""} `, h("span", { class: "num" }, seconds(value)), share);
  }));
}

function finishedCard(pack) {
  const profile = pack.profile;
  const phases = profile && profile.phases;
  return h("article", { class: "card finished-pack", dataset: { pack: pack.id } },
    h("h3", {}, h("span", { class: "mono" }, pack.id), " ", badge(pack.state)),
    h("p", { class: "small" }, `${pack.base_model} on ${pack.worker_id} · ended ${fmt.time(pack.finished_at)}`,
      phases && phases.wall_s != null ? ` · ${seconds(phases.wall_s)} wall` : "",
      phases && phases.outside_steps_frac != null ? `, ${fmt.pct(phases.outside_steps_frac)} outside steps` : "",
      profile && profile.first_step_s != null ? ` · first step after ${seconds(profile.first_step_s)}` : "",
      profile && profile.tokens_per_s ? ` · ${Math.round(profile.tokens_per_s)} tokens/s` : ""),
    phases ? [phaseBar(phases), phaseLegend(phases)]
      : h("p", { class: "muted small" }, profile ? "Its worker reported no phases." : "No profile reported."));
}

// Why each of the tenant's tasks waits (the scheduler's own explanation of the task, as its page shows it).
function waitingCell(t) {
  if (!t.waiting || !t.waiting.length) return h("td", { class: "small muted waiting" }, "—");
  return h("td", { class: "small waiting" }, h("ul", { class: "plain" }, t.waiting.map((w) =>
    h("li", { dataset: { task: w.task_id, reason: w.waiting.reason } },
      h("span", { class: "mono" }, `${w.task_id.slice(0, 13)}… `), w.waiting.message))));
}

// "Workers", or which of them this page shows: "Workers 101–200 of 256".
function workersCaption(cluster, first) {
  if (first === 0 && !cluster.has_more) return "Workers";
  return `Workers ${first + 1}–${first + cluster.workers.length} of ${cluster.workers_total}`;
}

export function mount(root) {
  const alert = h("p", { class: "error", role: "alert" });
  const stats = h("section", { class: "stats", "aria-label": "Utilisation" });
  const workers = h("section", {});
  const packs = h("section", { "aria-labelledby": "packs-title" });
  const finished = h("section", { id: "finished-packs", "aria-labelledby": "finished-title" });
  const tenants = h("section", {});
  root.append(h("h1", {}, "Cluster"), alert, stats, workers, packs, finished, tenants);

  const cursors = [null]; // the `after` of each workers page up to the one shown (null: the first page)
  const page = (step, cluster) => () => {
    if (step > 0) cursors.push(cluster.workers[cluster.workers.length - 1].id);
    else cursors.pop();
    poller.trigger();
  };
  function pager(cluster) {
    if (cursors.length === 1 && !cluster.has_more) return null;
    return h("div", { class: "pager", id: "workers-pager" },
      h("button", { type: "button", class: "secondary", disabled: cursors.length === 1, onclick: page(-1, cluster) },
        "Previous workers"),
      h("button", { type: "button", class: "secondary", disabled: !cluster.has_more, onclick: page(1, cluster) },
        "Next workers"));
  }

  const clusterPath = () => {
    const after = cursors[cursors.length - 1];
    return `/v1/admin/cluster?limit=${WORKERS_SHOWN}${after ? `&after=${encodeURIComponent(after)}` : ""}`;
  };
  async function readCluster() {
    try {
      return await api.get(clusterPath());
    } catch (e) {
      if (e.code !== "invalid_cursor") throw e;
      cursors.length = 1; // the worker the page started after is gone: back to the first page
      return api.get(clusterPath());
    }
  }

  const poller = new Poller(async () => {
    const [cluster, live, ended] = await Promise.all([readCluster(),
      api.get("/v1/admin/packs?state=live"), api.get(`/v1/admin/packs?state=finished&limit=${FINISHED_SHOWN}`)]);
    alert.textContent = "";
    clear(stats).append(
      stat("slot utilisation", fmt.pct(cluster.utilisation)),
      stat("slots in use", `${cluster.slots_used}/${cluster.slots_total}`),
      stat("workers busy", `${cluster.workers_busy}/${cluster.workers_alive}`),
      stat("workers lost", String(cluster.workers_lost)),
      stat("workers quarantined", String(cluster.workers_quarantined)),
      stat("trials running", String(cluster.trials_running)),
      stat("trials waiting", String(cluster.trials_pending)));
    const caption = workersCaption(cluster, (cursors.length - 1) * WORKERS_SHOWN);
    clear(workers).append(...(cluster.workers.length
      ? [h("div", { class: "table-box" }, workersTable(cluster.workers, caption)), pager(cluster)].filter(Boolean)
      : [h("p", { class: "muted" }, "No worker has registered yet.")]));
    clear(packs).append(h("h2", { id: "packs-title" }, "Live packs"),
      live.data.length ? h("div", { class: "packs" }, live.data.map(packCard)) : h("p", { class: "muted" }, "No pack is training."));
    clear(finished).append(h("h2", { id: "finished-title" }, "Where finished packs' time went"),
      ended.data.length ? h("div", { class: "packs" }, ended.data.map(finishedCard))
        : h("p", { class: "muted" }, "No pack has finished yet."));
    // GPU time over the fairness window per unit of weight is what preemption compares: a tenant with waiting
    // trials and less of it than a running pack's tenants takes that pack's worker after its slice.
    clear(tenants).append(h("h2", {}, "Demand by tenant"), cluster.tenants.length
      ? h("table", { class: "data" }, h("thead", {}, h("tr", {}, ["Tenant", "Running trials", "Waiting trials",
        "Held for another tenant", "Weight", "GPU time, last window", "Per unit of weight", "Why waiting"]
        .map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, cluster.tenants.map((t) => h("tr", { dataset: { tenant: t.tenant_id } }, h("td", {}, t.name),
        h("td", { class: "num" }, String(t.running_trials)), h("td", { class: "num" }, String(t.pending_trials)),
        h("td", { class: "num" }, String(t.held_trials)), h("td", { class: "num" }, String(t.weight)),
        h("td", { class: "num" }, seconds(t.gpu_seconds_window)),
        h("td", { class: "num" }, seconds(t.gpu_seconds_window / t.weight)), waitingCell(t)))))
      : h("p", { class: "muted" }, "No tenant has trials waiting or running."));
  }, { intervalMs: 5000 }).start();
  return { dispose: () => poller.stop() };
}
