// A new task: upload a dataset (or pick one), choose a base model, build a search space, see how many
// trials it expands to (the server's own count, POST /v1/search-spaces/expand) and what the task is estimated to
// take (its dry run, POST /v1/tasks?dry_run=true: wall time, its band and what it rests on), and submit.

import { ApiError, api, request } from "../api.js";
import { clear, fmt, h } from "../dom.js";

const DIMENSIONS = [
  { name: "learning_rate", label: "Learning rate", integer: false, placeholder: "by model size", example: "1e-4, 3e-4, 1e-3" },
  { name: "lora_rank", label: "LoRA rank", integer: true, placeholder: "8", example: "4, 8, 16" },
  { name: "lora_alpha", label: "LoRA alpha", integer: false, placeholder: "2 × rank", example: "16, 32" },
  { name: "batch_size", label: "Batch size", integer: true, placeholder: "4", example: "2, 4" },
  { name: "lora_dropout", label: "LoRA dropout", integer: false, placeholder: "0", example: "0, 0.05" },
];
const MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
// The task's `evaluation.metric` choices (common/metrics.py).
const METRICS = [["loss", "validation loss"], ["exact_match", "exact match"], ["contains", "contains the answer"],
  ["regex", "matches a pattern"], ["json_valid", "valid JSON"]];

// crypto.getRandomValues, not randomUUID: the latter exists only on https or localhost pages.
const randomKey = () => Array.from(crypto.getRandomValues(new Uint8Array(16)),
  (b) => b.toString(16).padStart(2, "0")).join("");

let uid = 0;
const id = (name) => `f-${name}-${++uid}`;

/** A labelled input; `describedBy` links its help and error text for screen readers. */
function field(label, input, help) {
  const helpId = help ? id("help") : null;
  if (helpId) input.setAttribute("aria-describedby", helpId);
  return h("div", { class: "field" }, h("label", { for: input.id }, label), input,
    help ? h("p", { class: "help", id: helpId }, help) : null);
}

/** "1e-4, 3e-4" → [0.0001, 0.0003]; throws a message naming the bad token. */
export function parseList(text, integer) {
  const tokens = text.split(/[\s,;]+/).filter(Boolean);
  return tokens.map((token) => {
    const value = Number(token);
    if (!Number.isFinite(value)) throw new Error(`'${token}' is not a number`);
    if (integer && !Number.isInteger(value)) throw new Error(`'${token}' is not a whole number`);
    return value;
  });
}

function dimensionRow(dim) {
  const mode = h("select", { id: id(`${dim.name}-mode`), "aria-label": `${dim.label}: values or range` },
    h("option", { value: "list" }, "values"), h("option", { value: "range" }, "range"));
  const values = h("input", { id: id(dim.name), name: dim.name, placeholder: dim.placeholder, inputmode: "decimal",
    "aria-label": `${dim.label} values` });
  const min = h("input", { id: id(`${dim.name}-min`), "aria-label": `${dim.label} range minimum`, placeholder: "min",
    inputmode: "decimal" });
  const max = h("input", { id: id(`${dim.name}-max`), "aria-label": `${dim.label} range maximum`, placeholder: "max",
    inputmode: "decimal" });
  const num = h("input", { id: id(`${dim.name}-num`), type: "number", min: 1, max: 1000,
    "aria-label": `${dim.label} range points`, placeholder: "points" });
  const scale = h("select", { id: id(`${dim.name}-scale`), "aria-label": `${dim.label} range scale` },
    h("option", { value: "linear" }, "linear"), h("option", { value: "log" }, "log"));
  const listBox = h("span", { class: "inline" }, values);
  const rangeBox = h("span", { class: "inline", hidden: true }, min, max, num, scale);
  const error = h("span", { class: "error small", role: "alert" });
  mode.addEventListener("change", () => {
    listBox.hidden = mode.value !== "list";
    rangeBox.hidden = mode.value !== "range";
  });
  const row = h("div", { class: "dim", dataset: { dim: dim.name } },
    h("span", { class: "dim-label" }, dim.label), mode, listBox, rangeBox,
    h("span", { class: "help small" }, `e.g. ${dim.example}; empty: ${dim.placeholder}`), error);

  /** The dimension's JSON value, undefined when left out (the server's default). */
  function value() {
    error.textContent = "";
    try {
      if (mode.value === "list") {
        const list = parseList(values.value, dim.integer);
        return list.length ? list : undefined;
      }
      if (!min.value && !max.value) return undefined;
      const range = { min: parseList(min.value, dim.integer)[0], max: parseList(max.value, dim.integer)[0],
        scale: scale.value };
      if (range.min === undefined || range.max === undefined) throw new Error("give both min and max");
      if (num.value) range.num = parseList(num.value, true)[0];
      return range;
    } catch (e) {
      error.textContent = `${dim.label}: ${e.message}`;
      throw e;
    }
  }
  return { row, value, error };
}

// Seconds in words: tenths under 10 s (a tiny model's task takes a second or less), else as elsewhere.
const wallText = (s) => (s < 10 ? `${Number(s).toFixed(1)}s` : fmt.duration(s));

/** An estimate in words: its wall time with the band the actual is expected in, and what it rests on (the
 * priors of a device kind, or a fit from the model's own packs on it). */
export function estimateText(est) {
  const kind = est.basis ? (est.basis.device_kind === "cpu" ? "CPU" : "GPU") : null;
  const basis = !est.basis ? ""
    : est.basis.source === "fitted"
      ? ` Fitted from ${est.basis.packs} pack${est.basis.packs === 1 ? "" : "s"} of this model on ${kind} workers.`
      : ` From the ${kind} priors: no pack of this model has run on a ${kind} worker yet, so the range is wide.`;
  const device = `${Number(est.gpu_seconds).toFixed(1)} ${kind || "device"} seconds, ${est.tokens} tokens.`;
  if (est.wall_seconds === null || est.wall_seconds === undefined) {
    return `No live worker can take these trials now: no wall time to estimate (${device})${basis}`;
  }
  const band = est.wall_seconds_low === null || est.wall_seconds_low === undefined ? ""
    : ` (likely ${wallText(est.wall_seconds_low)} to ${wallText(est.wall_seconds_high)})`;
  return `Estimated wall time ${wallText(est.wall_seconds)}${band}; ${device}${basis}`;
}

export async function mount(root, { go }) {
  const [models, files] = await Promise.all([api.get("/v1/models"), api.get("/v1/files?limit=100")]);

  const upload = h("input", { id: id("file"), type: "file", accept: ".jsonl,.json,application/jsonl,application/json" });
  const existing = h("select", { id: id("existing") }, h("option", { value: "" }, "— upload the file above —"),
    files.data.map((f) => h("option", { value: f.id }, `${f.filename} (${f.rows} rows, ${f.id})`)));
  const model = h("select", { id: id("model"), required: true },
    models.data.map((m) => h("option", { value: m.id }, m.id)));
  const preferred = models.data.find((m) => m.id === "tiny-random-llama") || models.data[0];
  if (preferred) model.value = preferred.id;
  const split = h("input", { id: id("split"), type: "number", min: 0.01, max: 0.5, step: 0.01, value: "0.2" });
  const maxSteps = h("input", { id: id("max-steps"), type: "number", min: 1, placeholder: "from epochs" });
  const epochs = h("input", { id: id("epochs"), type: "number", min: 1, max: 100, placeholder: "1" });
  const seqLen = h("input", { id: id("seq-len"), type: "number", min: 16, max: 8192, value: "512" });
  const strategy = h("select", { id: id("strategy") }, h("option", { value: "grid" }, "grid: every combination"),
    h("option", { value: "random" }, "random: sample max trials"));
  const maxTrials = h("input", { id: id("max-trials"), type: "number", min: 1, max: 10000 });
  const seed = h("input", { id: id("seed"), type: "number", min: 0, value: "0" });
  const policy = h("select", { id: id("policy") }, h("option", { value: "none" }, "none"),
    h("option", { value: "alto" }, "alto (ALTO §5)"), h("option", { value: "asha" }, "asha (successive halving)"));
  const metric = h("select", { id: id("metric") }, METRICS.map(([value, text]) => h("option", { value }, text)));
  const pattern = h("input", { id: id("pattern"), type: "text", maxlength: 500, disabled: true,
    placeholder: "a Python regular expression" });
  metric.addEventListener("change", () => { pattern.disabled = metric.value !== "regex"; });
  const auto = h("input", { type: "checkbox", id: id("auto") });

  const dims = DIMENSIONS.map(dimensionRow);
  const allLinear = h("input", { type: "checkbox", id: id("all-linear"), value: "all-linear", checked: true });
  const moduleBoxes = MODULES.map((m) => h("input", { type: "checkbox", id: id(m), value: m }));

  // The hand-made search space: one fieldset, so "Choose it for me" can disable all of it at once (and clear it,
  // so nothing typed there looks as if it still counted).
  const manual = h("fieldset", { class: "manual-space", id: "manual-space" },
    h("legend", { class: "sr-only" }, "Your own search space"),
    dims.map((d) => d.row),
    h("fieldset", { class: "modules" }, h("legend", {}, "Target modules"),
      moduleBoxes.map((box) => h("label", { class: "check" }, box, box.value)),
      h("label", { class: "check" }, allLinear, "all-linear")),
    field("Strategy", strategy),
    field("Max trials", maxTrials, "Needed for random search; caps a grid."),
    field("Seed", seed));
  auto.addEventListener("change", () => {
    manual.disabled = auto.checked;
    if (!auto.checked) return;
    for (const input of manual.querySelectorAll("input:not([type=checkbox])")) input.value = input === seed ? "0" : "";
    for (const select of manual.querySelectorAll("select")) select.selectedIndex = 0;
    for (const d of manual.querySelectorAll(".dim select")) d.dispatchEvent(new Event("change")); // back to "values"
    moduleBoxes.forEach((box) => { box.checked = false; });
    allLinear.checked = true;
    dims.forEach((d) => { d.error.textContent = ""; });
  });

  const count = h("output", { id: "trial-count", "aria-live": "polite" });
  const estimateOut = h("output", { id: "task-estimate", class: "estimate", "aria-live": "polite" });
  const formError = h("div", { class: "error", role: "alert", id: "submit-error" });
  const submit = h("button", { type: "submit", id: "submit-task" }, "Submit task");

  const form = h("form", { class: "card", "aria-labelledby": "submit-title", novalidate: true },
    h("h1", { id: "submit-title" }, "New task"),
    h("fieldset", {}, h("legend", {}, "Data and model"),
      field("Training file (JSONL)", upload, "One {\"messages\": [...]} or {\"prompt\", \"completion\"} object per line."),
      field("or a file already uploaded", existing),
      field("Base model", model),
      field("Validation split", split, "The share of the training rows held out for validation.")),
    h("fieldset", {}, h("legend", {}, "Search space"),
      h("label", { class: "check" }, auto, "Choose it for me: six trials picked from the model's and the data's size"),
      h("p", { class: "help" }, "Values: a list (comma separated). Range: min, max, points and scale. " +
        "A dimension left empty takes its default."),
      manual),
    h("fieldset", {}, h("legend", {}, "Training"),
      field("Max steps", maxSteps, "Or leave empty and give epochs."),
      field("Epochs", epochs),
      field("Max sequence length", seqLen),
      field("Early exit", policy)),
    h("fieldset", {}, h("legend", {}, "Evaluation"),
      field("Best trial by", metric, "A generative metric scores each trial's greedy answers to the validation rows."),
      field("Pattern", pattern, "For the regex metric: an answer passes when the pattern matches in it.")),
    h("p", { class: "count" }, count),
    h("p", { class: "estimate" }, estimateOut),
    submit, formError);
  root.append(form);

  const intOr = (input) => (input.value === "" ? undefined : Number(input.value));

  /** The fields that decide the trials (what the preview takes), or null when one cannot be read. */
  function spaceBody() {
    if (auto.checked) return { search_space: "auto" };
    const space = {};
    let ok = true;
    for (const [i, d] of dims.entries()) {
      try {
        const v = d.value();
        if (v !== undefined) space[DIMENSIONS[i].name] = v;
      } catch {
        ok = false;
      }
    }
    if (allLinear.checked) space.target_modules = "all-linear";
    else {
      const picked = moduleBoxes.filter((b) => b.checked).map((b) => b.value);
      if (picked.length) space.target_modules = [picked];
    }
    if (!ok) return null;
    const body = { search_space: space, strategy: strategy.value, seed: intOr(seed) ?? 0 };
    if (maxTrials.value) body.max_trials = intOr(maxTrials);
    return body;
  }

  /** The task's body for POST /v1/tasks, from the search space's fields and a training file. */
  function taskBody(space, fileId) {
    const body = { ...space, base_model: model.value, training_file: fileId, max_seq_len: intOr(seqLen) ?? 512,
      early_exit: { policy: policy.value } };
    if (metric.value !== "loss") {
      body.evaluation = { metric: metric.value };
      if (metric.value === "regex") body.evaluation.pattern = pattern.value;
    }
    if (split.value) body.validation_split = Number(split.value);
    if (maxSteps.value) body.max_steps = intOr(maxSteps);
    else if (epochs.value) body.epochs = intOr(epochs);
    return body;
  }

  // The estimate before submission: the task's dry run (every check of a submission, nothing written). It needs
  // the file's rows, so a file still to be uploaded gets none until it is.
  let estimateSeq = 0;
  async function previewEstimate() {
    const seq = ++estimateSeq;
    const space = spaceBody();
    estimateOut.dataset.source = "";
    if (!existing.value || !space) {
      estimateOut.textContent = existing.value ? "" : "Pick an uploaded file to see the task's estimate.";
      return;
    }
    try {
      const task = await api.post("/v1/tasks?dry_run=true", taskBody(space, existing.value));
      if (seq !== estimateSeq) return; // a newer edit answered first
      estimateOut.textContent = task.estimate ? estimateText(task.estimate) : "";
      estimateOut.dataset.source = task.estimate?.basis?.source ?? "";
    } catch (e) {
      if (seq !== estimateSeq) return;
      estimateOut.textContent = `No estimate: ${e instanceof ApiError && e.param ? `${e.param}: ` : ""}${e.message}`;
    }
  }

  let previewSeq = 0;
  let previewTimer = null;
  async function preview() {
    const seq = ++previewSeq;
    const body = spaceBody();
    if (body && body.search_space === "auto") {
      count.textContent = "Six trials, chosen when the task is created: three learning rates for the model's size " +
        "times two ranks for the number of training rows.";
      count.dataset.count = "6";
      return;
    }
    if (!body) {
      count.textContent = "Fix the search space to see how many trials it makes.";
      count.dataset.count = "";
      return;
    }
    try {
      const out = await api.post("/v1/search-spaces/expand?limit=0", body);
      if (seq !== previewSeq) return; // a newer edit answered first
      count.textContent = `This search space expands to ${out.count} trial${out.count === 1 ? "" : "s"} ` +
        `(your limit: ${out.max_trials_per_task} per task).`;
      count.dataset.count = String(out.count);
    } catch (e) {
      if (seq !== previewSeq) return;
      count.textContent = e instanceof ApiError ? `${e.param ? `${e.param}: ` : ""}${e.message}` : e.message;
      count.dataset.count = "";
    }
  }
  const schedule = () => {
    clearTimeout(previewTimer);
    previewTimer = setTimeout(() => { preview(); previewEstimate(); }, 250);
  };
  form.addEventListener("input", schedule);
  form.addEventListener("change", schedule);
  preview();
  previewEstimate();

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clear(formError);
    const space = spaceBody();
    if (!space) return;
    if (!upload.files.length && !existing.value) {
      formError.textContent = "Choose a training file to upload, or one already uploaded.";
      upload.focus();
      return;
    }
    submit.disabled = true;
    form.setAttribute("aria-busy", "true");
    try {
      let fileId = existing.value;
      if (upload.files.length) {
        const data = new FormData();
        data.append("file", upload.files[0]);
        data.append("purpose", "fine-tune");
        fileId = (await request("/v1/files", { method: "POST", form: data })).id;
      }
      const body = taskBody(space, fileId);
      // One key per submission: a retried request (a flaky network) returns the first task, not a second.
      const task = await request("/v1/tasks", { method: "POST", json: body,
        headers: { "Idempotency-Key": randomKey() } });
      go(`#/tasks/${task.id}`);
    } catch (e) {
      formError.append(h("p", {}, e.param ? `${e.param}: ${e.message}` : e.message));
      if (e.errors) {
        formError.append(h("ul", {}, e.errors.slice(0, 20).map((x) => h("li", {}, `line ${x.line}: ${x.message}`))));
      }
    } finally {
      submit.disabled = false;
      form.removeAttribute("aria-busy");
    }
  });
  return { focus: upload, dispose: () => { clearTimeout(previewTimer); previewSeq += 1; estimateSeq += 1; } };
}
