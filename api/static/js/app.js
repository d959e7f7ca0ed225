// The dashboard's shell: sign-in state, navigation, and a hash router that disposes each page (its
// streams and timers) before mounting the next, so navigating around never piles up connections.
// A route names the roles that may open it: the operator (admin token) reads every tenant's tasks, read-only.

import { clearSession, currentSession, setUnauthorisedHandler } from "./api.js";
import { clear, h } from "./dom.js";
import * as cluster from "./pages/cluster.js";
import * as signin from "./pages/signin.js";
import * as submit from "./pages/submit.js";
import * as task from "./pages/task.js";
import * as tasks from "./pages/tasks.js";
import * as tenants from "./pages/tenants.js";

const ROUTES = [
  { pattern: /^\/signin$/, page: signin, roles: null },
  { pattern: /^\/tasks$/, page: tasks, roles: ["tenant", "admin"], nav: "Tasks", href: "#/tasks" },
  { pattern: /^\/tasks\/([\w-]+)$/, page: task, roles: ["tenant", "admin"] },
  { pattern: /^\/submit$/, page: submit, roles: ["tenant"], nav: "New task", href: "#/submit" },
  { pattern: /^\/cluster$/, page: cluster, roles: ["admin"], nav: "Cluster", href: "#/cluster" },
  { pattern: /^\/tenants$/, page: tenants, roles: ["admin"], nav: "Tenants", href: "#/tenants" },
];
const HOME = { tenant: "#/tasks", admin: "#/cluster" };

const main = document.getElementById("main");
let current = null; // the mounted page's handle: {dispose(), focus?}
let routing = 0; // bumped per navigation: a page that finishes mounting after the next one began is dropped

export function go(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

function signOut() {
  clearSession();
  go("#/signin");
}

function renderChrome(session, path) {
  const nav = clear(document.getElementById("nav"));
  const who = clear(document.getElementById("who"));
  if (!session) return;
  for (const r of ROUTES) {
    if (r.nav && r.roles.includes(session.role)) {
      const here = path === r.href.slice(1) || (r.href === "#/tasks" && path.startsWith("/tasks/"));
      nav.append(h("a", { href: r.href, "aria-current": here ? "page" : null }, r.nav));
    }
  }
  who.append(
    h("span", { class: "muted" }, session.role === "admin" ? "operator" : `key ${session.key.slice(0, 11)}…`),
    h("button", { type: "button", class: "link", onclick: signOut }, "Sign out"),
  );
}

async function route() {
  const token = ++routing;
  if (current) {
    current.dispose?.();
    current = null;
  }
  const session = currentSession();
  const path = location.hash.replace(/^#/, "") || "/";
  let match = null;
  let params = [];
  for (const r of ROUTES) {
    const m = r.pattern.exec(path);
    if (m) { match = r; params = m.slice(1); break; }
  }
  if (!session && (!match || match.roles)) return go("#/signin");
  if (session && (!match || match.page === signin || (match.roles && !match.roles.includes(session.role)))) {
    return go(HOME[session.role]);
  }
  renderChrome(session, path);
  clear(main);
  const root = main.appendChild(h("div", { class: "page" }));
  const handle = (await match.page.mount(root, { params, session, go })) || null;
  if (token !== routing) {
    handle?.dispose?.();
    root.remove();
    return;
  }
  current = handle;
  // Focus moves to the page (its first field, else its heading), so keyboard and screen-reader users land
  // on the content rather than back at the top of the document.
  const target = handle?.focus || root.querySelector("h1");
  if (target) {
    if (target.tagName === "H1") target.setAttribute("tabindex", "-1");
    target.focus({ preventScroll: true });
  }
}

setUnauthorisedHandler(() => {
  clearSession();
  go("#/signin");
});
window.addEventListener("hashchange", route);
window.addEventListener("pagehide", () => current?.dispose?.());
route();
