/* oomless ui: the Estimate tab — the knobs, the stacked bar, the verdict and what
   each knob does. */
"use strict";

/* ---- estimate ------------------------------------------------------------- */
const KNOB_SELECTS = { method: "methods", quant: "quant", precision: "precisions",
  optim: "optimizers", stage: "stages", stack: "stacks", attn: "attentions", zero: "zero",
  offload: "offloads" };

function setupKnobs() {
  const c = state.choices;
  for (const [id, key] of Object.entries(KNOB_SELECTS)) fillSelect(id, c[key].map(String));
  fillSelect("plan-method", ["keep", "auto", ...c.methods],
    ["the Estimate's", "auto (any method)", ...c.methods]);
  setKnobs(c.defaults);
  for (const id of ["batch_size", "seq_len"]) {  // a slider beside a number one can type
    $(`${id}-range`).addEventListener("input", () => { $(id).value = $(`${id}-range`).value; });
    $(id).addEventListener("input", () => { $(`${id}-range`).value = $(id).value; });
  }
  for (const input of $("knobs").querySelectorAll("input, select")) {
    input.addEventListener("input", () => { showKnobValues(); scheduleEstimate(); });
  }
}

function setKnobs(values) {
  for (const [id, value] of Object.entries(values)) {
    const input = $(id);
    if (!input || value === undefined || value === null || ["model", "gpu"].includes(id)) continue;
    if (id === "lora_r") {
      const i = LORA_RANKS.indexOf(Number(value));
      input.value = i >= 0 ? i : LORA_RANKS.indexOf(16);
    } else if (input.type === "checkbox") input.checked = !!value;
    else input.value = String(value);
    if ($(`${id}-range`)) $(`${id}-range`).value = String(value);
  }
  showKnobValues();
}

function showKnobValues() {
  $("lora_r-out").textContent = LORA_RANKS[Number($("lora_r").value)];
  $("quant-row").hidden = $("method").value !== "qlora";
  for (const id of ["lora_r", "lora_targets"]) $(id).disabled = $("method").value === "full";
}

function estimateRequest() {
  const req = { ...modelRequest() };
  for (const id of ["method", "precision", "optim", "stage", "stack", "attn", "offload",
    "lora_targets"]) req[id] = $(id).value;
  if ($("method").value === "qlora") req.quant = $("quant").value;
  for (const id of ["batch_size", "seq_len", "grad_accum", "zero"]) req[id] = Number($(id).value);
  req.lora_r = LORA_RANKS[Number($("lora_r").value)];
  req.grad_ckpt = $("grad_ckpt").checked;
  return req;
}

/* One request at a time; a knob moved meanwhile asks again with its newest value
   (the newest value supersedes any queued one). */
function scheduleEstimate() {
  writeUrl();
  if (state.inflight) { state.pending = true; return; }
  runEstimate();
}

/* An error leaves nothing of the previous result: no chart, numbers, table or command. */
function clearEstimate() {
  ui.lastEstimate = null;
  setVerdict("verdict", null, "", null);
  drawn.delete($("est-chart"));
  for (const id of ["est-chart", "est-numbers", "est-command", "est-assumptions",
    "est-timing"]) $(id).replaceChildren();
  $("effects").tBodies[0].replaceChildren();
  $("est-result").classList.add("failed");
}

async function runEstimate() {
  state.inflight = ui.busy = true;
  state.pending = false;
  const seq = ++state.seq;
  const started = performance.now();
  const req = estimateRequest();
  $("est-result").classList.add("stale");
  $("est-progress").hidden = false;
  $("est-progress").textContent = "estimating…";
  try {
    const data = await api("/api/estimate", req);
    const answered = performance.now();
    showError("est-error", null);
    if (!state.pending) {  // a newer value is queued: draw that one instead
      await renderEstimate(data);
      ui.lastUpdateMs = performance.now() - started;
      ui.lastFetchMs = answered - started;
      $("est-timing").textContent = `updated in ${ui.lastUpdateMs.toFixed(0)} ms`;
      clearTimeout(state.effectsTimer);
      ui.effectsBusy = true;
      state.effectsTimer = setTimeout(() => runEffects(req, seq), 150);
    }
  } catch (err) {
    showError("est-error", err);
    clearTimeout(state.effectsTimer);
    ui.effectsBusy = false;
    clearEstimate();
  } finally {
    ui.updates += 1;
    state.inflight = false;
    if (state.pending) runEstimate();
    else {
      ui.busy = false;
      $("est-result").classList.remove("stale");
      $("est-progress").hidden = true;
    }
  }
}

function estimateChart(data) {
  const v = data.verdict;
  const groups = data.group_order.map((g) => ({ name: g, color: COLORS[g] || "#999",
    values: data.phases.map((p) => p.groups[g]),
    notes: data.phases.map((p) => p.members[g].map(([n, b]) => `${n}: ${fmtBytes(b)}`)
      .join("\n")) }));
  const hasBand = v.low_bytes !== null && v.high_bytes !== null && v.low_bytes !== undefined;
  return { categories: data.phases.map((p) => p.phase), groups,
    totals: data.phases.map((p) => p.total_bytes), yTitle: "GiB per GPU (nvidia-smi)",
    lines: data.gpu_memory_bytes ? [{ bytes: data.gpu_memory_bytes, color: "#c62828",
      dash: "7 5", label: `GPU memory ${fmtBytes(data.gpu_memory_bytes)}` }] : [],
    band: hasBand ? { category: data.peak_phase, low: v.low_bytes, high: v.high_bytes } : null };
}

async function renderEstimate(data) {
  ui.lastEstimate = data;
  $("est-result").classList.remove("failed");
  const v = data.verdict;
  setVerdict("verdict", v.state, v.text, bandText(v));
  drawBars($("est-chart"), estimateChart(data));
  const numbers = [
    ["device peak (nvidia-smi)", data.text.device_peak_bytes],
    ["peak reserved", data.text.peak_reserved_bytes],
    ["peak allocated", data.text.peak_allocated_bytes],
    ["peak phase", data.peak_phase],
    ["effective batch", data.effective_batch],
    ["trainable / all params", `${(data.trainable_params / 1e6).toFixed(1)}M / ` +
      `${(data.param_count / 1e9).toFixed(2)}B`],
  ];
  if (data.host_ram_bytes) numbers.push(["host RAM (offload)", fmtBytes(data.host_ram_bytes)]);
  $("est-numbers").replaceChildren(...numbers.map(([k, val]) =>
    el("div", {}, el("b", {}, val), el("span", {}, k))));
  $("est-command").replaceChildren(commandBox(data.command));
  $("est-assumptions-title").textContent = `Assumptions (${data.assumptions.length})`;
  $("est-assumptions").replaceChildren(...data.assumptions.map((a) => el("li", {}, a)));
}
ui.renderEstimate = renderEstimate;

async function runEffects(req, seq) {
  try {
    const data = await api("/api/effects", req);
    if (seq !== state.seq) return;  // the knobs moved on
    const rows = data.rows.map((r) => el("tr", { onclick: () => applyChange(r.change) },
      el("td", {}, r.knob), el("td", {}, `${r.from} → ${r.to}`), el("td", {}, r.text),
      el("td", { class: r.delta_bytes < 0 ? "down" : r.delta_bytes > 0 ? "up" : "" },
        r.delta_text),
      el("td", {}, el("span", { class: `badge ${r.state || ""}` }, BADGES[r.state] || "—"))));
    $("effects").tBodies[0].replaceChildren(...rows);
    ui.effectsUpdates += 1;
  } catch (err) {
    if (seq !== state.seq) return;
    showError("est-error", err);
    clearEstimate();
  } finally {
    if (seq === state.seq) ui.effectsBusy = false;
  }
}

function applyChange(change) {
  const values = { ...change };
  if ("gpus" in values) { $("gpus").value = values.gpus; delete values.gpus; }
  if ("gpu" in values) { $("gpu").value = values.gpu; delete values.gpu; }
  setKnobs(values);
  scheduleEstimate();
}

