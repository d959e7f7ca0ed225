// The task page's playground (issue 35): one prompt sent to the chosen trials' adapters (and, as a chat, to the base
// model alone), their answers side by side. Each answer is sampled by a worker (POST .../completions; the base through
// /v1/chat/completions with the base model as `model`), streamed in as it comes.

import { ApiError, request } from "../api.js";
import { clear, fmt, h } from "../dom.js";
import { sseBlocks } from "../live.js";

const BASE = "base";

/** The playground's section. `trials()` gives the task's trials now, `bestId()` its best trial's id. */
export function playground(task, { trials, bestId }) {
  const prompt = h("textarea", { id: "playground-prompt", rows: 3, "aria-label": "Prompt" });
  const chat = h("input", { type: "checkbox", id: "playground-chat", onchange: () => renderChoices() });
  const maxTokens = h("input", { type: "number", id: "playground-max-tokens", min: 1, max: 4096, value: 64 });
  const temperature = h("input", { type: "number", id: "playground-temperature", min: 0, max: 2, step: 0.1, value: 0 });
  const choices = h("fieldset", { class: "playground-choices" });
  const answers = h("div", { class: "playground-answers", id: "playground-answers", "aria-live": "polite" });
  const run = h("button", { type: "button", id: "playground-run", onclick: () => send() }, "Sample");
  const chosen = new Set();
  let seeded = false; // the best trial is ticked once it exists; after that the user's ticks stand

  function renderChoices() {
    const ready = trials().filter((t) => t.adapter_ready);
    if (!seeded && bestId()) {
      chosen.add(bestId());
      seeded = true;
    }
    clear(choices).append(h("legend", {}, "Answer with"));
    const option = (id, text, disabled = false, title = null) => {
      const box = h("input", { type: "checkbox", dataset: { choice: id }, disabled, checked: chosen.has(id) && !disabled,
        onchange: () => { if (box.checked) chosen.add(id); else chosen.delete(id); } });
      return h("label", { class: "check", title }, box, text);
    };
    choices.append(option(BASE, `the base model (${task.base_model})`, !chat.checked,
      "The base model alone answers chats only: tick “As a chat”"));
    for (const t of ready) {
      choices.append(option(t.id, `trial ${t.index}${t.id === bestId() ? " (best)" : ""}`));
    }
    run.disabled = !ready.length && !chat.checked;
  }

  function requestOf(id) {
    const text = prompt.value;
    const sampling = { max_tokens: Number(maxTokens.value) || 64, temperature: Number(temperature.value) || 0,
      stream: true };
    const input = chat.checked ? { messages: [{ role: "user", content: text }] } : { prompt: text };
    if (id === BASE) return ["/v1/chat/completions", { model: task.base_model, ...input, ...sampling }];
    return [`/v1/tasks/${task.id}/trials/${id}/completions`, { ...input, ...sampling }];
  }

  async function answer(id, card) {
    const [path, body] = requestOf(id);
    const text = card.querySelector(".answer-text");
    const meta = card.querySelector(".answer-meta");
    try {
      const response = await request(path, { method: "POST", json: body, raw: true });
      for await (const block of sseBlocks(response.body.getReader())) {
        if (!block.data || block.data === "[DONE]") continue;
        const chunk = JSON.parse(block.data);
        if (chunk.error) throw new ApiError(503, chunk);
        const choice = chunk.choices[0];
        text.textContent += choice.delta ? (choice.delta.content || "") : (choice.text || "");
        if (choice.finish_reason) {
          const ext = chunk.loraplane || {};
          meta.textContent = `${chunk.usage.completion_tokens} tokens, ${choice.finish_reason}` +
            (ext.load_s >= 0.5 ? `, waited ${fmt.duration(ext.load_s)} for the model to load` : "");
          card.dataset.done = choice.finish_reason;
        }
      }
    } catch (e) {
      card.dataset.done = "error";
      meta.textContent = "";
      text.textContent = "";
      card.append(h("p", { class: "error", role: "alert" }, e.message));
    }
  }

  function send() {
    clear(answers);
    const ids = [...chosen].filter((id) => id !== BASE || chat.checked);
    for (const id of ids) {
      const trial = trials().find((t) => t.id === id);
      const title = id === BASE ? "Base model" : `Trial ${trial ? trial.index : id}${id === bestId() ? " (best)" : ""}`;
      const card = h("article", { class: "answer", dataset: { choice: id } }, h("h3", {}, title),
        h("pre", { class: "answer-text" }), h("p", { class: "answer-meta muted small" }, "sampling…"));
      answers.append(card);
      answer(id, card);
    }
  }

  const section = h("section", { id: "playground", "aria-labelledby": "playground-title" },
    h("h2", { id: "playground-title" }, "Playground"),
    h("p", { class: "muted small" }, "Send one prompt to several trials' adapters and compare their answers. A worker ",
      "samples each; the first answer after a while may wait for it to load the model."),
    prompt,
    h("div", { class: "chart-tools" }, h("label", { class: "check" }, chat, "As a chat"),
      h("label", { for: "playground-max-tokens" }, "Max tokens"), maxTokens,
      h("label", { for: "playground-temperature" }, "Temperature"), temperature, run),
    choices, answers);
  return { section, update: renderChoices };
}
