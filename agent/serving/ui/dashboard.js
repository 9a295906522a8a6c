// viiwork dashboard: polls /ui/api/state and renders it. Every value from the server (node and
// model names come from peers) is written as text: createElement and textContent only.
"use strict";

const POLL_MS = 1500;
const charts = {};
let polls = 0;

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function fmt(v, unit) {
  return v === null || v === undefined ? "?" : String(v) + (unit || "");
}

// A speed in tokens/s, or "—" when not measured.
function tps(v) {
  return typeof v === "number" && v > 0 ? `${v} tok/s` : "\u2014";
}

// A peer's advertised API address as its dashboard's URL (http/https only), else null.
function dashboardUrl(api) {
  if (typeof api !== "string" || api === "") return null;
  try {
    const url = new URL(/^https?:\/\//.test(api) ? api : "http://" + api);
    if (url.protocol !== "http:" && url.protocol !== "https:") return null;
    url.pathname = "/ui";
    url.search = "";
    url.hash = "";
    return url.href;
  } catch (e) {
    return null;
  }
}

function modelCell(m) {
  const down = m.total > 0 && m.healthy === 0;
  const line = el("span", null, {
    class: "model " + (down ? "down" : m.healthy < m.total ? "warn" : "ok"),
    "data-model": m.name, "data-healthy": m.healthy, "data-total": m.total,
    "data-state": down ? "down" : m.healthy < m.total ? "degraded" : "up",
  });
  let text = `${m.name} (${fmt(m.kind)}, ${fmt(m.engine)}): ${down ? "down" : "up"}, backends ${fmt(m.healthy)}/${fmt(m.total)}`
    + `, slots ${fmt(m.busy)}/${fmt(m.slots)}`;
  if (m.waiting !== null && m.waiting !== undefined) text += `, engine queue ${m.waiting}`;
  if (m.queued !== null && m.queued !== undefined) text += `, queued here ${m.queued}`;
  line.textContent = text + ", ";
  // Measured speeds (tokens/s), "—" when unknown: a cell of their own, for the eye and tests.
  const sp = m.speed || {};
  const speed = el("span", `prefill ${tps(sp.prefill_tps)}, decode ${tps(sp.decode_tps)}`, {
    class: "speed", "data-prefill": fmt(sp.prefill_tps), "data-decode": fmt(sp.decode_tps),
  });
  line.append(speed);
  if (Array.isArray(m.backends)) {
    line.title = m.backends.map((b) => `${b.id}: ${b.state} (${fmt(b.busy)}/${fmt(b.slots)} busy)`).join("\n");
  }
  return line;
}

function renderNodes(state) {
  const body = document.querySelector("#nodes tbody");
  const rows = [];
  for (const n of state.nodes) {
    const tr = el("tr", null, { "data-node": n.name, "data-liveness": n.liveness });
    const name = el("td", n.name);
    if (n.self) name.append(el("span", " (this node)", { class: "muted" }));
    tr.append(name);
    const live = n.liveness === "alive" || n.liveness === "self";
    tr.append(el("td", `${n.liveness} / ${fmt(n.state)}`, { class: live ? "ok" : "down" }));
    tr.append(el("td", fmt(n.version)));
    const gpus = el("td");
    for (const g of n.gpus || []) {
      const used = g.memory_total_mib && g.memory_free_mib !== null && g.memory_free_mib !== undefined
        ? `${g.memory_total_mib - g.memory_free_mib}/${g.memory_total_mib} MiB` : `${fmt(g.memory_total_mib)} MiB`;
      gpus.append(el("span", `#${fmt(g.index)} ${fmt(g.name)}: ${used}`, { class: "model" }));
    }
    if (!(n.gpus || []).length) gpus.append(el("span", "none", { class: "muted" }));
    tr.append(gpus);
    const models = el("td");
    for (const m of n.models || []) models.append(modelCell(m));
    tr.append(models);
    const link = el("td");
    const url = n.self ? null : dashboardUrl(n.api);
    if (url) link.append(el("a", url, { href: url, "data-peer-link": n.name }));
    else link.append(el("span", n.self ? "here" : "-", { class: "muted" }));
    tr.append(link);
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function renderErrors(state) {
  const body = document.querySelector("#errors tbody");
  const rows = state.errors.map((e) => {
    const tr = el("tr", null, { "data-status": e.status, "data-model": e.model });
    tr.append(el("td", new Date(e.time * 1000).toLocaleTimeString()), el("td", e.model), el("td", e.status),
      el("td", e.message));
    return tr;
  });
  if (!rows.length) {
    const tr = el("tr");
    tr.append(el("td", "none", { colspan: 4, class: "muted" }));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function chart(id, series, data) {
  const target = document.getElementById(id);
  if (typeof uPlot === "undefined") return;
  if (!charts[id]) {
    charts[id] = new uPlot({
      width: 380, height: 180, legend: { show: true },
      series: [{}, ...series.map((s) => ({ label: s[0], stroke: s[1], width: 1.5, spanGaps: false, points: { show: true, size: 4 } }))],
      axes: [{}, { size: 50 }],
    }, data, target);
  } else {
    charts[id].setData(data);
  }
}

// "1 request", "3 requests", "0 errors".
function count(n, noun) {
  return `${n} ${noun}${n === 1 ? "" : "s"}`;
}

function renderCharts(state) {
  const b = state.buckets;
  const t = b.map((x) => x.t);
  let requests = 0;
  let errors = 0;
  for (const x of b) { requests += x.requests; errors += x.errors; }
  const totals = document.getElementById("totals");
  totals.dataset.requests = String(requests);
  totals.dataset.errors = String(errors);
  totals.textContent = `${count(requests, "request")}, ${count(errors, "error")} in the window`;
  chart("chart-rate", [["req/s", "#2b6cb0"], ["errors/s", "#b3261e"]],
    [t, b.map((x) => x.rate_per_s), b.map((x) => x.errors / state.bucket_s)]);
  chart("chart-queue", [["avg", "#2b6cb0"], ["max", "#a56300"]],
    [t, b.map((x) => x.queued_ms_avg), b.map((x) => (x.requests ? x.queued_ms_max : null))]);
  chart("chart-ttft", [["avg", "#2b6cb0"], ["max", "#a56300"]],
    [t, b.map((x) => x.ttft_ms_avg), b.map((x) => (x.requests ? x.ttft_ms_max : null))]);
  for (const id of ["chart-rate", "chart-queue", "chart-ttft"]) {
    document.getElementById(id).dataset.requests = String(requests);
  }
}

// A node with client keys on answers /ui/api/state only to a read key (docs/dashboard.md): the
// page asks for one and keeps it in this tab's sessionStorage (gone when the tab closes), sent
// as "Authorization: Bearer" by fetch (EventSource could not send it).
const KEY_ITEM = "viiwork.readKey";

function storedKey() {
  try {
    return sessionStorage.getItem(KEY_ITEM);
  } catch (e) {
    return null;
  }
}

function askForKey(message) {
  document.getElementById("key-form").hidden = false;
  document.getElementById("key-message").textContent = message;
}

function setupKeyForm() {
  const form = document.getElementById("key-form");
  const forget = document.getElementById("key-forget");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("key-input");
    const key = input.value.trim();
    input.value = "";
    if (key === "") return;
    try { sessionStorage.setItem(KEY_ITEM, key); } catch (e) { /* storage off: this poll only */ }
    form.hidden = true;
    forget.hidden = false;
  });
  forget.addEventListener("click", () => {
    try { sessionStorage.removeItem(KEY_ITEM); } catch (e) { /* nothing stored */ }
    forget.hidden = true;
  });
  forget.hidden = storedKey() === null;
}

async function poll() {
  const updated = document.getElementById("updated");
  try {
    const key = storedKey();
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const r = await fetch("/ui/api/state", { cache: "no-store", credentials: "same-origin", headers });
    if (r.status === 401 || r.status === 403) {
      let message = `HTTP ${r.status}`;
      try { message = (await r.json()).error.message; } catch (e) { /* not JSON */ }
      askForKey(key ? `that key was refused: ${message}` : "");
      throw new Error(`HTTP ${r.status}: a read key is needed`);
    }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const state = await r.json();
    document.getElementById("node-name").textContent = `${state.node.name} ${state.node.version}`;
    renderNodes(state);
    renderCharts(state);
    renderErrors(state);
    polls += 1;
    updated.dataset.polls = String(polls);
    updated.textContent = `updated ${new Date().toLocaleTimeString()}` + (state.standalone ? " (standalone node)" : "");
  } catch (e) {
    updated.textContent = `cannot read /ui/api/state: ${e.message}`;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  setupKeyForm();
  poll();
});
