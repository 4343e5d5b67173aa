/* oomless ui: the Plan, Check, Diagnose and Runs tabs, and the start. */
"use strict";

/* ---- plan ------------------------------------------------------------------ */
function planCard(p, i) {
  const files = Object.entries(p.files).map(([name, text]) =>
    el("button", { onclick: () => download(name, text), "data-file": name }, `⬇ ${name}`));
  return el("div", { class: "card plan" },
    el("h4", {}, `${i + 1}. ${p.family} — ${p.text} · ${Math.round(p.tokens_per_s)
      .toLocaleString()} tokens/s · step ${p.step}`),
    el("div", {}, p.read_as),
    el("div", { class: "changed" }, p.changes.length
      ? `changed from your Estimate so that it fits: ${p.changes.join("; ")}`
      : "your Estimate's configuration as it is"),
    p.tradeoffs.length ? el("div", { class: "hint" }, `trade-offs: ${p.tradeoffs.join("; ")}`)
      : null,
    el("div", { class: "plan-files" }, files,
      el("button", { class: "open-estimate", onclick: () => openInEstimate(p.knobs) },
        "open in Estimate")),
    commandBox(p.command, "This plan's estimate on the command line"));
}

function openInEstimate(knobs) {
  applyChange(knobs);  // the GPU, the count and every knob of the plan
  switchTab("estimate");
}

function planPlaceholders() {
  const req = estimateRequest();
  $("plan-seq").placeholder = `${req.seq_len}`;
  $("plan-effective").placeholder = `${req.batch_size * req.grad_accum * req.gpus}`;
  $("plan-method").options[0].textContent = `the Estimate's (${req.method})`;
}

async function runPlan(signal) {
  const req = { knobs: estimateRequest(), method: $("plan-method").value,
    objective: $("plan-objective").value, top: Number($("plan-top").value) || 5,
    headroom: (Number($("plan-headroom").value) || 0) / 100,
    effective_batch: $("plan-effective").value || null, seq_len: $("plan-seq").value || null };
  const r = await api("/api/plan", req, signal);
  ui.lastPlan = r;
  const k = r.kept;
  const out = [el("p", {}, `${r.model} on ${r.hardware} · effective batch ` +
    `${r.effective_batch} · budget ${fmtBytes(r.budget_bytes)} per GPU · searched ` +
    `${r.searched.toLocaleString()} configurations in ${r.elapsed_s.toFixed(2)} s, ` +
    `${r.fitting.toLocaleString()} fit`),
  el("div", { class: "kept", id: "plan-kept" }, `kept from your Estimate: sequence ${k.seq_len}` +
    `, effective batch ${k.effective_batch}, method ${k.method}, stage ${k.stage}, ` +
    `stack ${k.stack}`)];
  if (r.method_note) out.push(el("div", { class: "verdict tight", id: "plan-method-note" },
    el("span", { class: "badge" }, "METHOD CHANGED"), el("span", {}, r.method_note)));
  out.push(...r.notes.map((n) => el("div", { class: "hint" }, `note: ${n}`)));
  if (!r.plans.length) {
    out.push(el("div", { class: "verdict out-of-memory" },
      el("span", { class: "badge" }, "NOTHING FITS"), `on ${r.hardware}`));
  }
  out.push(...r.plans.map(planCard));
  if (r.misses.length) {
    out.push(el("h3", {}, "Families that do not fit (nearest miss)"),
      el("ul", { class: "notes" }, r.misses.map((m) => el("li", {}, m))));
  }
  out.push(...r.suggestions.map((s) => el("div", {}, `would fit: ${s}`)));
  out.push(commandBox(r.command, "This search on the command line (oomless.yaml: your " +
    "Estimate's run)"), el("button", { onclick: () => download("oomless.yaml", r.base_yaml) },
    "⬇ oomless.yaml (your Estimate's run)"));
  $("plan-result").replaceChildren(...out);
}

/* ---- inference --------------------------------------------------------------- */
function inferenceRequest() {
  const req = { ...modelRequest(), gpus: 1, engine: $("inf-engine").value,
    seq_len: $("inf-prompt").value || null, max_new_tokens: $("inf-new").value || null };
  if (req.engine === "vllm") {
    Object.assign(req, { max_model_len: $("inf-max-model-len").value || null,
      max_num_seqs: $("inf-max-num-seqs").value || null,
      gpu_memory_utilization: $("inf-utilization").value || null,
      kv_cache_dtype: $("inf-kv-dtype").value });
  } else req.batch_size = $("inf-batch").value || null;
  return req;
}

function showEngineFields() {
  const vllm = $("inf-engine").value === "vllm";
  for (const l of document.querySelectorAll("#inf-form .vllm")) l.hidden = !vllm;
  for (const l of document.querySelectorAll("#inf-form .hf")) l.hidden = vllm;
}

async function runInference(signal) {
  writeUrl();
  const r = await api("/api/inference", inferenceRequest(), signal);
  ui.lastInference = r;
  const badge = { fits: "FITS", tight: "QUEUES", "out-of-memory": "OUT OF MEMORY" }[r.state];
  const out = [el("div", { class: `verdict ${r.state || ""}`, id: "inf-verdict" },
    el("span", { class: "badge" }, badge || "NO GPU"), el("span", {}, r.text))];
  const rows = r.rows.map(([name, _b, text]) => el("tr", {}, el("td", {}, name),
    el("td", {}, text)));
  out.push(el("table", { class: "grid", id: "inf-table" }, el("tbody", {}, rows)));
  if (r.engine === "vllm") {
    const b = r.budget;
    out.push(el("div", { class: "numbers", id: "inf-numbers" }, [
      [b.num_blocks.toLocaleString(), `KV blocks (${fmtBytes(b.block_bytes)} each)`],
      [Math.floor(b.max_concurrency).toLocaleString(),
        `largest max_num_seqs held at ${b.max_model_len.toLocaleString()} tokens`],
      [b.required_utilization === null ? "more than this GPU" :
        b.required_utilization.toFixed(2), `smallest gpu_memory_utilization for ` +
        `${b.max_num_seqs} sequences`],
      [b.gpu_memory_utilization.toFixed(2), "gpu_memory_utilization chosen"],
    ].map(([v, k]) => el("div", {}, el("b", {}, v), el("span", {}, k)))));
    const copy = el("button", { class: "copy", onclick: () => copyText(r.engine_args_text, copy) },
      "copy engine arguments");
    out.push(el("div", { class: "hint" }, "vLLM engine arguments (LLM(**args)) ", copy),
      el("pre", { class: "code", id: "inf-engine-args" }, r.engine_args_text));
  }
  out.push(commandBox(r.command));
  $("inf-result").replaceChildren(...out);
}

/* ---- check ----------------------------------------------------------------- */
async function runCheck(signal) {
  const chosen = [...$("check-file").files];
  const files = chosen.length
    ? await Promise.all(chosen.map(async (f) => ({ name: f.name, text: await f.text() })))
    : [{ name: "", text: $("check-text").value }];
  renderCheck(await api("/api/check", { files, gpu: $("gpu").value,
    gpus: Number($("gpus").value) || 1, model: $("check-model").value || null,
    seq_len: $("check-seq").value || null,
    headroom: (Number($("check-headroom").value) || 0) / 100 }, signal));
}

function renderCheck(r) {
  $("check-result").hidden = false;
  $("check-command").replaceChildren(commandBox(r.command));
  setVerdict("check-verdict", r.state, r.text, null);
  $("check-read").textContent = `${r.label} ${r.files.join(", ")} · ${r.model} on ` +
    `${r.hardware} · read as: ${r.read_as}`;
  const over = r.phases.map((p) => p.over);
  const bytes = r.phases.map((p) => p.device_bytes);
  drawBars($("check-chart"), { categories: r.phases.map((p) => p.phase),
    totals: bytes, yTitle: "GiB per GPU (nvidia-smi)", band: null,
    groups: [["fits the GPU", "#4c6ef5", false], ["above the GPU", "#c62828", true]].map(
      ([name, color, isOver]) => ({ name, color, notes: r.phases.map((p) => p.text),
        values: bytes.map((b, i) => (over[i] === isOver ? b : 0)) })),
    lines: [{ bytes: r.gpu_memory_bytes, color: "#c62828", dash: "7 5",
      label: `GPU ${fmtBytes(r.gpu_memory_bytes)}` },
    { bytes: r.budget_bytes, color: "#b7791f", dash: "2 4",
      label: `budget ${fmtBytes(r.budget_bytes)} (headroom kept free)` }] });
  const fix = [];
  if (r.fix) {
    fix.push(el("p", {}, el("b", {}, "Smallest change that fits (same effective batch): "),
      r.fix.changes.join("; "), ` — ${r.fix.text}`));
    fix.push(el("button", { id: "check-download", class: "primary",
      onclick: () => download(r.diff_name, r.diff) }, `⬇ Download ${r.diff_name}`));
  } else if (r.no_fix) {
    fix.push(el("p", {}, "No change this file can express fits; the Plan tab searches other " +
      "methods, GPUs and sharding."));
  }
  $("check-fix").replaceChildren(...fix);
  const diff = $("check-diff");
  diff.hidden = !r.diff;
  diff.replaceChildren(...r.diff.split("\n").map((line) => el("span", {
    class: line.startsWith("@@") ? "hunk" : line.startsWith("+") ? "add"
      : line.startsWith("-") ? "del" : "" }, `${line}\n`)));
  $("check-notes").replaceChildren(...r.notes.map((n) => el("li", {}, `note: ${n}`)));
}

/* ---- diagnose -------------------------------------------------------------- */
async function runDiagnose(signal) {
  const req = { log: $("diag-log").value, config: $("diag-config").value };
  if ($("diag-use-gpu").checked) Object.assign(req, { gpu: $("gpu").value,
    gpus: Number($("gpus").value) || 1 });
  const r = await api("/api/diagnose", req, signal);
  const out = [];
  const read = Object.entries(r.hints).map(([k, v]) => `${k.replace(/_/g, " ")} ${v}`);
  if (read.length) out.push(el("div", { class: "kept", id: "diag-hints" },
    `read from the log (the fixes start from these): ${read.join(", ")}`));
  if (!r.found) out.push(el("div", { class: "verdict" }, el("span", { class: "badge" },
    "NOTHING FOUND"), el("span", {}, r.summary)));
  for (const e of r.events) {
    out.push(el("div", { class: "card event" },
      el("h4", {}, e.title),
      e.numbers ? el("div", { class: "nums" }, e.numbers) : null,
      el("div", { class: "msg" }, `line ${e.line}: ${e.message}`),
      el("ul", {}, e.causes.length ? e.causes.map((c, i) => el("li", {},
        el("b", {}, `${i ? "Also" : "Cause"}: ${c.title}`), ` — ${c.evidence}`))
        : el("li", {}, "Cause: not recognised from this message")),
      e.fixes.length ? el("b", {}, "Fixes, those that keep the training first:") : null,
      el("ol", {}, e.fixes.map((f) => el("li", {}, f.text,
        f.keeps_training ? "" : el("span", { class: "hint" }, "  (changes the training)"))))));
  }
  out.push(...r.notes.map((n) => el("div", { class: "hint" }, `note: ${n}`)));
  out.push(commandBox(r.command));
  $("diag-result").replaceChildren(...out);
}

/* ---- runs -------------------------------------------------------------------- */
async function openRun(signal) {
  const r = await api("/api/report", { path: $("runs-path").value }, signal);
  const s = r.summary;
  const parts = [`${s.steps} steps`, `${s.events} events (${s.ooms} out of memory)`];
  if (s.measured_peak_bytes) parts.push(`${s.measured_peak_label} ${fmtBytes(s.measured_peak_bytes)}`);
  if (s.predicted_peak_bytes) parts.push(`predicted ${fmtBytes(s.predicted_peak_bytes)}`);
  $("runs-summary").textContent = `${s.title}: ${parts.join(" · ")}`;
  $("runs-frame").srcdoc = r.html;
  $("runs-frame").hidden = false;
  $("runs-command").replaceChildren(commandBox(r.command));
}

/* ---- tabs and start ---------------------------------------------------------- */
function switchTab(name) {
  state.tab = name;
  for (const b of document.querySelectorAll("#tabs button")) {
    b.classList.toggle("active", b.dataset.tab === name);
  }
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.id === `tab-${name}`);
  if (name === "plan") planPlaceholders();
  writeUrl();
  redrawCharts();  // a chart drawn while its tab was hidden has no width
}

const CLEAR = { plan: () => $("plan-result").replaceChildren(),
  inf: () => $("inf-result").replaceChildren(),
  check: () => { $("check-result").hidden = true; },
  diag: () => $("diag-result").replaceChildren(),
  runs: () => { $("runs-summary").textContent = ""; $("runs-frame").hidden = true;
    $("runs-command").replaceChildren(); } };

async function start() {
  for (const b of document.querySelectorAll("#tabs button")) {
    b.addEventListener("click", () => switchTab(b.dataset.tab));
  }
  const response = await fetch("/api/choices");
  state.choices = await response.json();
  setupBar();
  setupKnobs();
  const tab = readUrl();
  setKnobs({ batch_size: $("batch_size").value, seq_len: $("seq_len").value });
  showEngineFields();
  $("inf-engine").addEventListener("input", showEngineFields);
  const runs = { plan: runPlan, inf: runInference, check: runCheck, diag: runDiagnose,
    runs: openRun };
  for (const [name, run] of Object.entries(runs)) {
    $(`${name}-run`).addEventListener("click", () => runTask(name, run, { clear: CLEAR[name] }));
  }
  for (const form of ["plan-form", "inf-form"]) $(form).addEventListener("input", writeUrl);
  $("diag-file").addEventListener("change", async () => {
    const file = $("diag-file").files[0];
    if (file) $("diag-log").value = await file.text();
  });
  scheduleEstimate();
  if (tab) switchTab(tab);
  if (tab === "plan") runTask("plan", runPlan, { clear: CLEAR.plan });
  if (tab === "inference") runTask("inf", runInference, { clear: CLEAR.inf });
}

start().catch((err) => showError("est-error", err));
