/* oomless ui: what every tab uses. Every number comes from the server (the library);
   these files only gather the inputs, ask, and draw. Server text is inserted as text. */
"use strict";

const $ = (id) => document.getElementById(id);
const GiB = 1024 ** 3;
const LORA_RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512];
const COLORS = { weights: "#4c6ef5", gradients: "#fab005", optimizer: "#ae3ec9",
  activations: "#12b886", logits: "#f76707", overheads: "#868e96", other: "#343a40" };
const BADGES = { fits: "FITS", tight: "TIGHT", "out-of-memory": "OUT OF MEMORY" };
const ui = window.oomlessUI = { updates: 0, lastUpdateMs: null, effectsUpdates: 0,
  done: {}, copied: null };
const state = { choices: null, modelConfig: null, seq: 0, inflight: false, pending: false,
  effectsTimer: null };

function fmtBytes(n) {
  const a = Math.abs(n), s = n < 0 ? "-" : "";
  if (a >= GiB) return `${s}${(a / GiB).toFixed(2)} GiB`;
  if (a >= 1024 ** 2) return `${s}${(a / 1024 ** 2).toFixed(1)} MiB`;
  if (a >= 1024) return `${s}${(a / 1024).toFixed(1)} KiB`;
  return `${s}${a} B`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

/* Thrown for a request that a newer one of the same tab replaced: shown nowhere. */
class Superseded extends Error {}

async function api(path, body, signal) {
  let response;
  try {
    response = await fetch(path, { method: "POST", body: JSON.stringify(body), signal,
      headers: { "content-type": "application/json" } });
  } catch (err) {
    if (err.name === "AbortError") throw new Superseded("superseded");
    throw new Error("the oomless ui server does not answer: is it still running?");
  }
  const data = await response.json().catch(() => ({}));
  if (signal && signal.aborted) throw new Superseded("superseded");
  if (!response.ok || data.error) {
    throw new Error(data.error || `the server answered ${response.status}`);
  }
  return data;
}

function showError(id, err) {
  const box = $(id);
  box.hidden = !err;
  box.textContent = err ? err.message || String(err) : "";
}

/* Each tab's request: a new one supersedes (aborts) the one in flight; the tab's
   progress line counts the seconds; its old result is greyed while it works and
   cleared when the request fails, so no old result stays under an error. */
const tasks = {};

async function runTask(name, work, { clear } = {}) {
  const previous = tasks[name];
  if (previous) {
    previous.controller.abort();
    ui.superseded = (ui.superseded || 0) + 1;
  }
  const task = { controller: new AbortController(), started: performance.now() };
  tasks[name] = task;
  const progress = $(`${name}-progress`), out = $(`${name}-result`);
  if (out) out.classList.add("stale");
  if (progress) {
    progress.hidden = false;
    const tick = () => { progress.textContent =
      `working… ${((performance.now() - task.started) / 1000).toFixed(1)} s`; };
    tick();
    task.timer = setInterval(tick, 100);
    ui.progressShown = (ui.progressShown || 0) + 1;
  }
  ui.done[name] = ui.done[name] || 0;
  try {
    await work(task.controller.signal);
    if (tasks[name] !== task) return;
    showError(`${name}-error`, null);
  } catch (err) {
    if (err instanceof Superseded || tasks[name] !== task) return;
    showError(`${name}-error`, err);
    if (clear) clear();
  } finally {
    clearInterval(task.timer);
    if (tasks[name] === task) {
      if (progress) progress.hidden = true;
      if (out) out.classList.remove("stale");
      delete tasks[name];
      ui.done[name] += 1;
    }
  }
}

/* A result's command line with a button that copies it. */
function commandBox(command, title = "Same result on the command line") {
  const copy = el("button", { class: "copy", onclick: () => copyText(command, copy) },
    "copy CLI command");
  return el("div", { class: "command" }, el("div", { class: "hint" }, title, " ", copy),
    el("pre", { class: "code" }, command));
}

async function copyText(text, button) {
  ui.copied = text;
  try {
    await navigator.clipboard.writeText(text);
  } catch (err) {  // no clipboard permission: the old way
    const box = el("textarea", {}, text);
    document.body.append(box);
    box.select();
    document.execCommand("copy");
    box.remove();
  }
  if (button) { button.textContent = "copied"; setTimeout(() => {
    button.textContent = "copy CLI command"; }, 1500); }
}

function download(name, text) {
  const a = el("a", { href: URL.createObjectURL(new Blob([text], { type: "text/plain" })),
    download: name });
  document.body.append(a);
  a.click();
  setTimeout(() => { URL.revokeObjectURL(a.href); a.remove(); }, 2000);
}

function fillSelect(id, values, labels) {
  const select = $(id);
  select.replaceChildren(...values.map((v, i) =>
    el("option", { value: v }, labels ? labels[i] : v)));
}

/* ---- model and GPUs (shared) ------------------------------------------- */
function setupBar() {
  const c = state.choices;
  $("model-list").replaceChildren(...c.models.map((m) =>
    el("option", { value: m.name }, `${m.params} · ${m.hf_id}`)));
  fillSelect("gpu", c.gpus.map((g) => g.name), c.gpus.map((g) => g.label));
  $("model").value = c.defaults.model;
  $("gpu").value = c.defaults.gpu;
  $("gpus").value = c.defaults.gpus;
  $("model").addEventListener("change", () => { state.modelConfig = null; showOwnModel();
    scheduleEstimate(); });
  for (const id of ["gpu", "gpus"]) $(id).addEventListener("input", scheduleEstimate);
  $("model-file").addEventListener("change", async () => {
    const file = $("model-file").files[0];
    if (file) $("model-json").value = await file.text();
  });
  $("model-use").addEventListener("click", () => {
    const text = $("model-json").value;
    let name = "my-model";
    try { name = (JSON.parse(text)._name_or_path || name).split("/").pop() || name; }
    catch (e) { /* the server says what is wrong with it */ }
    state.modelConfig = { name, text };
    $("model-upload").open = false;
    showOwnModel();
    scheduleEstimate();
  });
}

function showOwnModel() {
  const chip = $("model-own");
  chip.hidden = !state.modelConfig;
  $("model").disabled = !!state.modelConfig;
  if (state.modelConfig) {
    chip.replaceChildren(`config.json: ${state.modelConfig.name}`,
      el("button", { title: "back to the catalog", onclick: () => {
        state.modelConfig = null; showOwnModel(); scheduleEstimate(); } }, "✕"));
  }
}

function modelRequest() {
  const req = { gpu: $("gpu").value, gpus: Number($("gpus").value) || 1 };
  if (state.modelConfig) req.model_config = state.modelConfig;
  else req.model = $("model").value;
  return req;
}

function setVerdict(id, verdictState, text, band) {
  const box = $(id);
  box.className = `verdict ${verdictState || ""}`;
  box.querySelector(".badge").textContent = BADGES[verdictState] || (text ? "NO GPU" : "—");
  const badge = BADGES[verdictState];  // the sentence repeats the badge: say it once
  box.querySelector(".badge + span").textContent =
    badge && text.startsWith(badge) ? text.slice(badge.length).trimStart() : text;
  const bandBox = box.querySelector(".band");
  if (bandBox) {
    bandBox.hidden = !band;
    bandBox.textContent = band || "";
  }
}

function bandText(v) {
  if (v.low_bytes === null || v.high_bytes === null || v.low_bytes === undefined) return null;
  return `likely between ${fmtBytes(v.low_bytes)} and ${fmtBytes(v.high_bytes)} ` +
    `(the estimate's uncertainty band: ${fmtBytes(v.high_bytes - v.low_bytes)} wide)`;
}


/* ---- the view in the address (a link reproduces it) ---------------------- */
const URL_FORMS = ["setup", "knobs", "plan-form", "inf-form"];

function urlInputs() {
  return URL_FORMS.flatMap((id) => [...$(id).querySelectorAll("input[id], select[id]")])
    .filter((i) => i.type !== "file" && !i.id.endsWith("-range"));
}

function writeUrl() {
  const params = new URLSearchParams();
  if (state.token) params.set("token", state.token);
  params.set("tab", state.tab || "estimate");
  for (const input of urlInputs()) {
    if (input.id === "model" && state.modelConfig) continue;  // an upload is not in a link
    let value = input.type === "checkbox" ? (input.checked ? "1" : "0") : input.value;
    if (input.id === "lora_r") value = String(LORA_RANKS[Number(value)]);
    if (value !== "") params.set(input.id, value);
  }
  history.replaceState(null, "", `?${params}`);
}

/* The address's values into the inputs; the tab it names (or null). */
function readUrl() {
  const params = new URLSearchParams(location.search);
  state.token = params.get("token");
  for (const input of urlInputs()) {
    if (!params.has(input.id)) continue;
    const value = params.get(input.id);
    if (input.type === "checkbox") input.checked = value === "1";
    else if (input.id === "lora_r") {
      const i = LORA_RANKS.indexOf(Number(value));
      if (i >= 0) input.value = i;
    } else input.value = value;
  }
  return params.get("tab");
}
