// What a task's trials minimise (the task's `objective`: {"type": "sft"} or {"type": "dpo", "loss", "label_smoothing"})
// and the words the task page uses for it. A DPO task's validation loss is its DPO loss on the validation pairs, not
// a next-token loss, and its trials differ by beta: the page names both so that a DPO chart never reads as an SFT one.
// Tasks created before objectives have none: they are SFT tasks.

/** Whether the task trains on preference pairs (Direct Preference Optimisation). */
export function isDpo(task) {
  return task?.objective?.type === "dpo";
}

/** "DPO, sigmoid loss" (and its label smoothing when it has one); null for an SFT task. */
export function objectiveText(task) {
  if (!isDpo(task)) return null;
  const { loss, label_smoothing: smoothing } = task.objective;
  return `DPO, ${loss || "sigmoid"} loss${smoothing ? `, label smoothing ${smoothing}` : ""}`;
}

/** What the task's validation "loss" is: "DPO loss" for a DPO task, plain "loss" otherwise. */
export function lossName(task) {
  return isDpo(task) ? "DPO loss" : "loss";
}

// The scored metrics whose API names read badly in a heading; the generative ones keep theirs (exact_match, ...).
const METRIC_NAMES = { reward_accuracy: "reward accuracy" };

/** A scored metric in words: "reward accuracy" for reward_accuracy, the others as the API names them. */
export function metricName(metric) {
  return METRIC_NAMES[metric] || metric;
}
