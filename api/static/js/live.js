// Live data with bounded cost: a page left open for hours holds a fixed amount of memory and sends a
// fixed rate of requests. Everything here is stopped by close(), which the router calls on every page change.

import { ApiError, authHeaders, request } from "./api.js";

const sleep = (ms, signal) => new Promise((resolve) => {
  const timer = setTimeout(resolve, ms);
  signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
});

/**
 * Runs `fn` now and then every `intervalMs`, never two at once. While the tab is hidden it waits (nothing
 * is sent for a page nobody looks at) and runs once when the tab shows again. trigger() asks for a run
 * soon, at most one per `minGapMs`, so a burst of events costs one request.
 */
export class Poller {
  constructor(fn, { intervalMs = 5000, minGapMs = 1000 } = {}) {
    this.fn = fn;
    this.intervalMs = intervalMs;
    this.minGapMs = minGapMs;
    this.timer = null;
    this.running = false;
    this.again = false;
    this.stopped = true;
    this.lastRun = 0;
    this.waitingForVisible = false;
    this.onVisible = () => { if (!document.hidden && this.waitingForVisible) { this.waitingForVisible = false; this.run(); } };
  }

  start({ immediate = true } = {}) {
    this.stopped = false;
    document.addEventListener("visibilitychange", this.onVisible);
    if (immediate) this.run();
    else this.timer = setTimeout(() => this.run(), this.intervalMs);
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.timer = null;
    document.removeEventListener("visibilitychange", this.onVisible);
  }

  trigger() {
    if (this.stopped) return;
    if (this.running) { this.again = true; return; }
    clearTimeout(this.timer);
    const wait = Math.max(0, this.lastRun + this.minGapMs - Date.now());
    this.timer = setTimeout(() => this.run(), wait);
  }

  async run() {
    if (this.stopped) return;
    if (document.hidden) { this.waitingForVisible = true; return; }
    clearTimeout(this.timer);
    this.running = true;
    this.lastRun = Date.now();
    try {
      await this.fn();
    } catch (error) {
      if (!(error instanceof DOMException && error.name === "AbortError")) console.warn("refresh failed:", error.message);
    } finally {
      this.running = false;
    }
    if (this.stopped) return;
    if (this.again) { this.again = false; this.trigger(); return; }
    this.timer = setTimeout(() => this.run(), this.intervalMs);
  }
}

/** Parses SSE blocks ("id:", "event:", "data:" lines, a blank line between blocks; ":" lines are comments). */
export function parseSse(block) {
  const out = { id: null, event: "message", data: "" };
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "id") out.id = value;
    else if (field === "event") out.event = value;
    else if (field === "data") data.push(value);
  }
  out.data = data.join("\n");
  return out;
}

/** The SSE blocks of a streamed answer's body, parsed, as they arrive (with keep-alive comments as empty blocks). */
export async function* sseBlocks(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      yield parseSse(buffer.slice(0, cut));
      buffer = buffer.slice(cut + 2);
    }
  }
}

const STALL_MS = 45_000; // the server writes a keep-alive every 15 s: silence this long is a dead connection
const POLL_MS = 3000;
const POLL_SPELL_MS = 30_000; // after the stream failed, poll this long before trying it again

/**
 * A task's events: the SSE stream read with fetch (EventSource cannot send the Authorization header),
 * resumed with Last-Event-ID after a drop; if the stream keeps failing (a proxy that buffers or cuts it),
 * polling /events for a spell, then the stream again. Calls onEvent(event) once per event, in order,
 * onEnd({state}) once when the task is final, onMode("stream" | "polling" | "ended").
 */
export class TaskStream {
  constructor(taskId, { onEvent, onEnd, onMode = () => {}, onError = () => {} }) {
    this.taskId = taskId;
    this.onEvent = onEvent;
    this.onEnd = onEnd;
    this.onMode = onMode;
    this.onError = onError;
    this.lastId = 0;
    this.controller = new AbortController();
  }

  start() {
    this.loop();
    return this;
  }

  close() {
    this.controller.abort();
  }

  get closed() {
    return this.controller.signal.aborted;
  }

  deliver(event) {
    if (event.id <= this.lastId) return; // already seen (a resume overlaps by design)
    this.lastId = event.id;
    this.onEvent(event);
  }

  async loop() {
    let failures = 0;
    while (!this.closed) {
      try {
        this.onMode("stream");
        const opened = Date.now();
        if (await this.streamOnce()) return;
        // Closed without `end` (a server restart, a proxy's time limit): resume, but a stream that keeps
        // closing at once counts as failing, so it cannot turn into a reconnect loop.
        failures = Date.now() - opened < 5000 ? failures + 1 : 0;
      } catch (error) {
        if (this.closed) return;
        if (error instanceof ApiError && error.status >= 400 && error.status < 500) {
          this.onError(error); // 401 / 404: retrying cannot help
          return;
        }
        failures += 1;
      }
      if (failures >= 2) {
        this.onMode("polling");
        if (await this.pollSpell()) return;
        failures = 0;
      } else {
        await sleep(1000 * Math.max(1, failures), this.controller.signal);
      }
    }
  }

  async streamOnce() {
    const signal = this.controller.signal;
    const headers = { ...authHeaders(), Accept: "text/event-stream" };
    if (this.lastId) headers["Last-Event-ID"] = String(this.lastId);
    const response = await request(`/v1/tasks/${this.taskId}/events/stream`, { signal, headers, raw: true });
    const reader = response.body.getReader();
    let stall = null;
    const resetStall = () => { clearTimeout(stall); stall = setTimeout(() => reader.cancel(), STALL_MS); };
    try {
      resetStall();
      for await (const block of sseBlocks(reader)) {
        resetStall();
        if (!block.data) continue;
        if (block.event === "end") {
          this.finish(JSON.parse(block.data));
          return true;
        }
        // The key was revoked (or its tenant deleted) while the stream was open: like a 401, final.
        if (block.event === "error") throw new ApiError(401, JSON.parse(block.data));
        this.deliver(JSON.parse(block.data));
      }
      return false;
    } finally {
      clearTimeout(stall);
      reader.cancel().catch(() => {});
    }
  }

  async pollSpell() {
    const signal = this.controller.signal;
    const until = Date.now() + POLL_SPELL_MS;
    while (!this.closed && Date.now() < until) {
      if (!document.hidden) {
        try {
          // The state first: once it is final, every event before it is in this or an earlier page.
          const task = await request(`/v1/tasks/${this.taskId}`, { signal });
          let page;
          do {
            page = await request(`/v1/tasks/${this.taskId}/events?after=${this.lastId}&limit=500`, { signal });
            page.data.forEach((event) => this.deliver(event));
          } while (page.has_more && !this.closed);
          if (["succeeded", "failed", "cancelled"].includes(task.state)) {
            this.finish({ task_id: this.taskId, state: task.state });
            return true;
          }
        } catch (error) {
          if (this.closed) return true;
          if (error instanceof ApiError && error.status >= 400 && error.status < 500) {
            this.onError(error);
            return true;
          }
        }
      }
      await sleep(POLL_MS, signal);
    }
    return false;
  }

  finish(end) {
    this.onMode("ended");
    this.onEnd(end);
    this.controller.abort();
  }
}
