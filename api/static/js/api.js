// The /v1 API from the browser. The key lives in sessionStorage only: gone when the tab closes, never in
// localStorage or a cookie, never in a URL.

const STORE = "loraplane.session";

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.code = error.code || null;
    this.param = error.param || null;
    this.errors = error.errors || null; // a refused file: one entry per bad line
  }
}

/** {key, role: "tenant" | "admin"} or null. */
export function currentSession() {
  try {
    return JSON.parse(sessionStorage.getItem(STORE));
  } catch {
    return null;
  }
}

export function saveSession(session) {
  sessionStorage.setItem(STORE, JSON.stringify(session));
}

export function clearSession() {
  sessionStorage.removeItem(STORE);
}

let onUnauthorised = () => {};
/** Called when the key stops working mid-session (revoked): the app signs out. */
export function setUnauthorisedHandler(fn) {
  onUnauthorised = fn;
}

export function authHeaders(key = currentSession()?.key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function failure(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not our JSON error body (a proxy's page): the status says enough
  }
  return new ApiError(response.status, body);
}

/** fetch + the key + our error shape. `json` sends a JSON body; `form` a FormData. */
export async function request(path, { method = "GET", json, form, signal, key, headers = {}, raw = false } = {}) {
  const init = { method, signal, headers: { ...authHeaders(key), ...headers } };
  if (json !== undefined) {
    init.body = JSON.stringify(json);
    init.headers["Content-Type"] = "application/json";
  } else if (form !== undefined) {
    init.body = form;
  }
  const response = await fetch(path, init);
  if (!response.ok) {
    const error = await failure(response);
    if (response.status === 401 && key === undefined) onUnauthorised(error);
    throw error;
  }
  return raw ? response : response.json();
}

export const api = {
  get: (path, opts = {}) => request(path, opts),
  post: (path, json, opts = {}) => request(path, { ...opts, method: "POST", json }),
};

/** Every line of an NDJSON answer, parsed. */
export async function ndjson(path, { signal } = {}) {
  const response = await request(path, { signal, raw: true });
  const text = await response.text();
  return text.split("\n").filter((line) => line.trim()).map((line) => JSON.parse(line));
}

/** Downloads an authenticated file: fetched as a blob (a link cannot carry the key), then saved. */
export async function download(path, fallbackName) {
  const response = await request(path, { raw: true });
  const disposition = response.headers.get("Content-Disposition") || "";
  const match = /filename="([^"]+)"/.exec(disposition);
  const blob = await response.blob();
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = match ? match[1] : fallbackName;
  document.body.append(a);
  a.click();
  a.remove();
  // Revoked a moment later: the browser has taken the blob by then, and the page keeps no copy of it.
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
