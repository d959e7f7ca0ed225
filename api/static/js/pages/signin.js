// Sign in with a tenant API key (tasks) or the operator's admin token (cluster, tenants). The role is
// found by asking the API, never guessed; the key is kept in sessionStorage only.

import { ApiError, request, saveSession } from "../api.js";
import { h } from "../dom.js";

const PROBES = {
  tenant: "/v1/models", // any tenant key may read the model registry
  admin: "/v1/admin/cluster",
};

async function accepts(role, key) {
  try {
    await request(PROBES[role], { key });
    return true;
  } catch (error) {
    if (error instanceof ApiError && (error.status === 401 || error.status === 403)) return false;
    throw error;
  }
}

/** The role the key has. Tenant keys start with "lp_", so the likely probe goes first: a valid key of
 * either kind signs in with one request and no refused one. */
export async function roleOf(key) {
  const order = key.startsWith("lp_") ? ["tenant", "admin"] : ["admin", "tenant"];
  for (const role of order) {
    if (await accepts(role, key)) return role;
  }
  return null;
}

export function mount(root, { go }) {
  const error = h("p", { id: "signin-error", class: "error", role: "alert" });
  const input = h("input", { id: "api-key", name: "api-key", type: "password", required: true, autocomplete: "off",
    spellcheck: "false", "aria-describedby": "api-key-help signin-error" });
  const button = h("button", { type: "submit" }, "Sign in");
  const form = h("form", { class: "card narrow", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title" }, "Sign in"),
    h("label", { for: "api-key" }, "API key"),
    input,
    h("p", { id: "api-key-help", class: "help" },
      "A tenant key (lp_…) shows your tasks; the operator's admin token shows the cluster and tenants. ",
      "It is kept in this browser tab only and forgotten when the tab closes."),
    button,
    error);

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    error.textContent = "";
    if (!key) {
      error.textContent = "Enter an API key.";
      input.focus();
      return;
    }
    button.disabled = true;
    form.setAttribute("aria-busy", "true");
    try {
      const role = await roleOf(key);
      if (!role) {
        error.textContent = "That key was not accepted: it is unknown or revoked.";
        input.select();
        input.focus();
        return;
      }
      saveSession({ key, role });
      go(role === "admin" ? "#/cluster" : "#/tasks");
    } catch (e) {
      error.textContent = `The API could not be reached (${e.message}).`;
    } finally {
      button.disabled = false;
      form.removeAttribute("aria-busy");
    }
  });
  root.append(form);
  return { focus: input, dispose() {} };
}
