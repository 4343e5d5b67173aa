/* oomless ui: the Plan, Check, Diagnose and Runs tabs, and the start. */
"use strict";

/* ---- plan ------------------------------------------------------------------ */
function configKnobs(c) {
  return { method: c.method, precision: c.precision, optim: c.optimizer,
    quant: c.quantization.bits === 8 ? "int8" : c.quantization.type, lora_r: c.lora.r,
    lora_targets: Array.isArray(c.lora.targets) ? c.lora.targets.join(",") : c.lora.targets,
    batch_size: c.micro_batch_size, grad_accum: c.grad_accum, seq_len: c.seq_len,
    grad_ckpt: c.grad_ckpt, attn: c.attn, zero: c.zero, offload: c.offload, stack: c.stack,
    stage: c.stage };
}

function planCard(p, i) {
  const files = Object.entries(p.files).map(([name, text]) =>
    el("button", { onclick: () => download(name, text), "data-file": name }, `⬇ ${name}`));
  return el("div", { class: "card plan" },
    el("h4", {}, `${i + 1}. ${p.family} — ${p.text} · ${Math.round(p.tokens_per_s)
      .toLocaleString()} tokens/s · step ${p.step}`),
    el("div", {}, p.read_as),
    el("div", { class: "hint" }, `changes: ${p.changes.join("; ") || "none"}`),
    p.tradeoffs.length ? el("div", { class: "hint" }, `trade-offs: ${p.tradeoffs.join("; ")}`)
      : null,
    el("div", { class: "plan-files" }, files,
      el("button", { onclick: () => { setKnobs(configKnobs(p.config));
        $("gpus").value = p.config.hardware.gpus_per_node; switchTab("estimate");
        scheduleEstimate(); } }, "open in Estimate")));
}

async function runPlan() {
  const req = { ...modelRequest(), method: $("plan-method").value,
    objective: $("plan-objective").value, top: Number($("plan-top").value) || 5,
    headroom: (Number($("plan-headroom").value) || 0) / 100,
    effective_batch: $("plan-effective").value || null, seq_len: $("plan-seq").value || null };
  const r = await api("/api/plan", req);
  const out = [el("p", {}, `${r.model} on ${r.hardware} · effective batch ` +
    `${r.effective_batch} · budget ${fmtBytes(r.budget_bytes)} per GPU · searched ` +
    `${r.searched.toLocaleString()} configurations in ${r.elapsed_s.toFixed(2)} s, ` +
    `${r.fitting.toLocaleString()} fit`)];
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
  $("plan-out").replaceChildren(...out);
}

/* ---- check ----------------------------------------------------------------- */
async function runCheck() {
  $("check-out").hidden = true;
  const chosen = [...$("check-file").files];
  const files = chosen.length
    ? await Promise.all(chosen.map(async (f) => ({ name: f.name, text: await f.text() })))
    : [{ name: "", text: $("check-text").value }];
  renderCheck(await api("/api/check", { files, gpu: $("gpu").value,
    gpus: Number($("gpus").value) || 1, model: $("check-model").value || null,
    seq_len: $("check-seq").value || null,
    headroom: (Number($("check-headroom").value) || 0) / 100 }));
}

function renderCheck(r) {
  $("check-out").hidden = false;
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
async function runDiagnose() {
  const req = { log: $("diag-log").value, config: $("diag-config").value };
  if ($("diag-use-gpu").checked) Object.assign(req, { gpu: $("gpu").value,
    gpus: Number($("gpus").value) || 1 });
  const r = await api("/api/diagnose", req);
  const out = [];
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
  $("diag-out").replaceChildren(...out);
}

/* ---- runs -------------------------------------------------------------------- */
async function openRun() {
  $("runs-frame").hidden = true;
  const r = await api("/api/report", { path: $("runs-path").value });
  const s = r.summary;
  const parts = [`${s.steps} steps`, `${s.events} events (${s.ooms} out of memory)`];
  if (s.measured_peak_bytes) parts.push(`${s.measured_peak_label} ${fmtBytes(s.measured_peak_bytes)}`);
  if (s.predicted_peak_bytes) parts.push(`predicted ${fmtBytes(s.predicted_peak_bytes)}`);
  $("runs-summary").textContent = `${s.title}: ${parts.join(" · ")}`;
  $("runs-frame").srcdoc = r.html;
  $("runs-frame").hidden = false;
}

/* ---- tabs and start ---------------------------------------------------------- */
function switchTab(name) {
  for (const b of document.querySelectorAll("#tabs button")) {
    b.classList.toggle("active", b.dataset.tab === name);
  }
  for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t.id === `tab-${name}`);
  redrawCharts();  // a chart drawn while its tab was hidden has no width
}

async function start() {
  for (const b of document.querySelectorAll("#tabs button")) {
    b.addEventListener("click", () => switchTab(b.dataset.tab));
  }
  const response = await fetch("/api/choices");
  state.choices = await response.json();
  setupBar();
  setupKnobs();
  for (const [name, run] of [["plan", runPlan], ["check", runCheck], ["diag", runDiagnose],
    ["runs", openRun]]) {
    $(`${name}-run`).addEventListener("click", () => action(`${name}-run`, `${name}-error`, run));
  }
  $("diag-file").addEventListener("change", async () => {
    const file = $("diag-file").files[0];
    if (file) $("diag-log").value = await file.text();
  });
  scheduleEstimate();
}

start().catch((err) => showError("est-error", err));
