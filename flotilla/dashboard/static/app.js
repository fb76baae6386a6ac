// The dashboard's page: asks for a token once (kept for this tab in sessionStorage), reads
// /api/v1 with it, follows /api/v1/events with a streaming fetch (EventSource cannot send an
// Authorization header) and refetches only what changed. Hash routes, no reloads.

import { morph, replace } from "./dom.js";
import { devicesView, jobsView, jobView, volunteersView } from "./views.js";

const TOKEN_KEY = "flotilla.token";
const BACKOFF_MIN_MS = 1000;
const BACKOFF_MAX_MS = 30000;

const state = {
  token: sessionStorage.getItem(TOKEN_KEY),
  scope: "",
  source: "",
  jobs: [],
  rounds: new Map(), // job id -> rounds, oldest first
  devices: [],
  history: [],
  volunteers: [],
  filters: { state: "", device_class: "", job: "" },
  confirmCancel: null,
};

class AuthNeeded extends Error {}

let live = null; // the AbortController of the event stream
const pending = new Set();
let flushTimer = null;
const inflight = new Map();

const $ = (id) => document.getElementById(id);

function notice(message) {
  const box = $("notice");
  replace(box, message || "");
  box.hidden = !message;
}

function setLive(text, cls) {
  const el = $("live");
  replace(el, text);
  el.className = `live ${cls}`;
}

/** A token in the URL fragment (#token=...) moves to sessionStorage and out of the URL. */
function takeFragmentToken() {
  const hash = location.hash.replace(/^#/, "");
  const match = hash.match(/(^|[&?])token=([^&]*)/);
  if (!match) return false;
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[2]));
  state.token = sessionStorage.getItem(TOKEN_KEY);
  const rest = hash.replace(match[0], "").replace(/^[&?]/, "");
  history.replaceState(null, "", `${location.pathname}${location.search}#${rest || "/jobs"}`);
  return true;
}

async function api(path, method = "GET") {
  const res = await fetch(path, {
    method,
    headers: { Authorization: `Bearer ${state.token}`, Accept: "application/json" },
    cache: "no-store",
  });
  if (res.status === 401) {
    askToken("That token was refused. Enter a valid one.");
    throw new AuthNeeded("token refused");
  }
  let body = null;
  try {
    body = await res.json();
  } catch (_) {
    body = null;
  }
  if (!res.ok) {
    const err = body && body.error ? body.error : { message: `${res.status} ${res.statusText}` };
    const e = new Error(err.message);
    e.status = res.status;
    throw e;
  }
  return body;
}

function askToken(message) {
  stopLive();
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = null;
  $("app").hidden = true;
  $("token-panel").hidden = false;
  replace($("token-error"), message || "");
  $("token-input").value = "";
  $("token-input").focus();
}

// --- fetching -------------------------------------------------------------------------

async function fetchJobs() {
  state.jobs = (await api("/api/v1/jobs")).jobs;
}

/** New rounds only (?since=last known), unless the job went back (a new simulation run). */
function fetchRounds(id) {
  const running = inflight.get(id);
  if (running) return running.then(() => fetchRounds(id));
  const job = state.jobs.find((j) => j.id === id);
  let known = state.rounds.get(id) || [];
  let last = known.length ? known[known.length - 1].round : 0;
  if (job && job.rounds_committed < last) {
    known = [];
    last = 0;
  }
  const path = `/api/v1/jobs/${encodeURIComponent(id)}/rounds${last ? `?since=${last}` : ""}`;
  const done = api(path)
    .then((body) => {
      const fresh = body.rounds.filter((r) => r.round > last);
      state.rounds.set(id, known.concat(fresh));
    })
    .finally(() => inflight.delete(id));
  inflight.set(id, done);
  return done;
}

async function fetchDevices() {
  const [devices, history] = await Promise.all([
    api("/api/v1/devices"),
    api("/api/v1/devices/history"),
  ]);
  state.devices = devices.devices;
  state.history = history.samples;
}

async function fetchVolunteers() {
  state.volunteers = (await api("/api/v1/volunteer-runs")).volunteer_runs;
}

/** Everything the current view shows. */
async function load() {
  const r = route();
  await fetchJobs();
  if (r.view === "jobs") await Promise.all(state.jobs.slice(0, 50).map((j) => fetchRounds(j.id)));
  if (r.view === "job" && state.jobs.some((j) => j.id === r.id)) await fetchRounds(r.id);
  if (r.view === "devices") await fetchDevices();
  if (r.view === "volunteers") await fetchVolunteers();
}

async function guarded(work) {
  try {
    await work();
    notice("");
  } catch (e) {
    if (!(e instanceof AuthNeeded)) notice(`Could not load: ${e.message}`);
  }
  render();
}

// --- live -----------------------------------------------------------------------------

function onChange(change) {
  pending.add(change.kind === "job" ? `job:${change.job_id}` : change.kind);
  if (!flushTimer) flushTimer = setTimeout(() => guarded(flush), 250);
}

async function flush() {
  flushTimer = null;
  const items = [...pending];
  pending.clear();
  const r = route();
  const jobIds = items.filter((k) => k.startsWith("job:")).map((k) => k.slice(4));
  if (jobIds.length) {
    await fetchJobs();
    const wanted = jobIds.filter((id) => state.rounds.has(id) || r.view === "jobs" || r.id === id);
    await Promise.all(wanted.map(fetchRounds));
  }
  if (items.includes("devices") && r.view === "devices") await fetchDevices();
  if (items.includes("volunteers") && r.view === "volunteers") await fetchVolunteers();
}

function handleEvent(block) {
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue; // a comment: keepalive
    const [field, ...rest] = line.split(":");
    const value = rest.join(":").replace(/^ /, "");
    if (field === "event") event = value;
    if (field === "data") data.push(value);
  }
  if (event !== "change" || data.length === 0) return;
  try {
    onChange(JSON.parse(data.join("\n")));
  } catch (_) {
    // not a change we understand: the next one will do
  }
}

async function readStream(res, signal) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  while (!signal.aborted) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end = buffer.indexOf("\n\n");
    while (end >= 0) {
      handleEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      end = buffer.indexOf("\n\n");
    }
  }
}

async function follow(controller) {
  const { signal } = controller;
  let backoff = BACKOFF_MIN_MS;
  while (!signal.aborted) {
    try {
      setLive("Connecting…", "wait");
      const res = await fetch("/api/v1/events", {
        headers: { Authorization: `Bearer ${state.token}`, Accept: "text/event-stream" },
        cache: "no-store",
        signal,
      });
      if (res.status === 401) {
        askToken("That token was refused. Enter a valid one.");
        return;
      }
      if (!res.ok) throw new Error(`events: ${res.status}`);
      setLive("Live", "ok");
      backoff = BACKOFF_MIN_MS;
      guarded(load); // catch up with whatever changed while disconnected
      await readStream(res, signal);
    } catch (_) {
      if (signal.aborted) return;
    }
    const wait = backoff * (0.75 + Math.random() / 2);
    setLive(`Reconnecting in ${Math.round(wait / 1000)} s`, "wait");
    await new Promise((resolve) => setTimeout(resolve, wait));
    backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
  }
}

function stopLive() {
  if (live) live.abort();
  live = null;
}

// --- drawing --------------------------------------------------------------------------

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean);
  const names = parts.map((p) => {
    try {
      return decodeURIComponent(p);
    } catch (_) {
      return p;
    }
  });
  if (names[0] === "jobs" && names[1]) return { view: "job", id: names[1] };
  if (names[0] === "devices" || names[0] === "volunteers") return { view: names[0] };
  return { view: "jobs" };
}

const actions = {
  filter(key, value) {
    state.filters[key] = value;
    render();
  },
  askCancel(id) {
    state.confirmCancel = id;
    render();
    const next = document.getElementById(id ? "confirm-cancel" : "cancel-job");
    if (next) next.focus();
  },
  async cancel(id) {
    state.confirmCancel = null;
    await guarded(async () => {
      await api(`/api/v1/jobs/${encodeURIComponent(id)}/cancel`, "POST");
      await fetchJobs();
    });
  },
};

function render() {
  const main = $("view");
  const r = route();
  const ctx = { state };
  const view = r.view === "job" ? jobView(ctx, r.id)
    : r.view === "devices" ? devicesView(ctx)
      : r.view === "volunteers" ? volunteersView(ctx) : jobsView(ctx);
  if (main.firstElementChild && main.childNodes.length === 1) morph(main.firstElementChild, view);
  else replace(main, view);
  for (const link of document.querySelectorAll("nav a")) {
    const current = link.dataset.view === (r.view === "job" ? "jobs" : r.view);
    if (current) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

/** One listener for every control the views draw (they carry data-action). */
function listen() {
  const main = $("view");
  main.addEventListener("click", (e) => {
    const el = e.target.closest("button[data-action]");
    if (el && el.dataset.action === "ask-cancel") actions.askCancel(el.dataset.job || null);
    if (el && el.dataset.action === "cancel") actions.cancel(el.dataset.job);
  });
  main.addEventListener("change", (e) => {
    const el = e.target.closest("select[data-action='filter']");
    if (el) actions.filter(el.dataset.key, el.value);
  });
  main.addEventListener("submit", (e) => e.preventDefault());
}

async function start() {
  $("token-panel").hidden = true;
  $("app").hidden = false;
  try {
    const who = await api("/api/v1/whoami");
    state.scope = who.scope;
    state.source = who.source;
  } catch (e) {
    if (!(e instanceof AuthNeeded)) notice(`Could not reach the server: ${e.message}`);
    if (e instanceof AuthNeeded) return;
  }
  replace($("whoami"), `${state.source || "?"} · ${state.scope === "operator" ? "operator" : "read-only"}`);
  stopLive();
  live = new AbortController();
  follow(live);
  await guarded(load);
}

function init() {
  takeFragmentToken();
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const token = $("token-input").value.trim();
    if (!token) return;
    sessionStorage.setItem(TOKEN_KEY, token);
    state.token = token;
    start();
  });
  $("forget-token").addEventListener("click", () => askToken(""));
  listen();
  window.addEventListener("hashchange", () => {
    state.confirmCancel = null;
    if (takeFragmentToken()) {
      start(); // another token: its scope may differ
      return;
    }
    render();
    if (state.token) guarded(load);
  });
  if (!location.hash) history.replaceState(null, "", `${location.pathname}#/jobs`);
  if (state.token) start();
  else askToken("");
}

init();
