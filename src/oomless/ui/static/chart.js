/* oomless ui: stacked bars in plain SVG. A moved knob redraws in a few milliseconds
   (a charting library's full redraw took 100–300 ms on a busy 2-core machine).
   drawBars(container, {categories, groups, lines, band, totals, yTitle}):
     groups: [{name, color, values: [bytes per category], notes: [text per category]}]
     lines:  [{bytes, label, color, dash}]   horizontal lines across the plot
     band:   {category, low, high} or null   an error bar: the estimate's band
     totals: [bytes per category]            the label above each bar */
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

function niceStep(top, ticks = 6) {
  const raw = top / ticks, power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 2.5, 5, 10].map((m) => m * power).find((s) => s >= raw);
}

function drawLegend(chart, groups, lines) {
  const legend = el("div", { class: "legend" });
  for (const g of groups) {
    legend.append(el("span", {}, el("i", { style: `background:${g.color}` }), g.name));
  }
  for (const l of lines) {
    legend.append(el("span", {}, el("i", { class: "line", style: `border-color:${l.color}` }),
      l.label));
  }
  chart.append(legend);
}

const drawn = new Map();  // container → spec: redrawn when the window or the tab changes

function redrawCharts() {
  for (const [container, spec] of drawn) if (container.clientWidth) drawBars(container, spec);
}
window.addEventListener("resize", redrawCharts);

function drawBars(container, spec) {
  drawn.set(container, spec);
  const width = Math.max(container.clientWidth, 320), height = container.clientHeight || 400;
  const m = { l: 64, r: 16, t: 44, b: 36 };
  const plotW = width - m.l - m.r, plotH = height - m.t - m.b;
  const top = Math.max(...spec.totals, ...spec.lines.map((l) => l.bytes),
    spec.band ? spec.band.high : 0, 1) * 1.12;
  const step = niceStep(top / GiB) * GiB;
  const y = (bytes) => m.t + plotH - (bytes / top) * plotH;
  const band = plotW / spec.categories.length;
  const barW = Math.min(band * 0.7, 220);
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
  for (let v = 0; v <= top; v += step) {
    root.append(svg("line", { x1: m.l, x2: width - m.r, y1: y(v), y2: y(v), class: "grid" }));
    root.append(svg("text", { x: m.l - 8, y: y(v) + 4, class: "tick", "text-anchor": "end" },
      `${+(v / GiB).toFixed(1)}`));
  }
  root.append(svg("text", { x: 14, y: m.t + plotH / 2, class: "axis-title",
    transform: `rotate(-90 14 ${m.t + plotH / 2})`, "text-anchor": "middle" }, spec.yTitle));
  spec.categories.forEach((cat, i) => {
    const x = m.l + band * i + (band - barW) / 2;
    let base = 0;
    for (const g of spec.groups) {
      const bytes = g.values[i];
      if (!bytes) continue;
      const rect = svg("rect", { x, width: barW, y: y(base + bytes),
        height: Math.max(y(base) - y(base + bytes), 0), fill: g.color, class: "bar",
        "data-category": cat, "data-group": g.name, "data-bytes": bytes });
      rect.append(svg("title", {}, `${cat} · ${g.name}: ${fmtBytes(bytes)}\n${g.notes[i]}`));
      root.append(rect);
      base += bytes;
    }
    const labelAt = spec.band && spec.band.category === cat
      ? Math.max(spec.totals[i], spec.band.high) : spec.totals[i];
    root.append(svg("text", { x: x + barW / 2, y: y(labelAt) - 6, class: "total",
      "text-anchor": "middle" }, fmtBytes(spec.totals[i])));
    root.append(svg("text", { x: x + barW / 2, y: height - m.b + 18, class: "tick",
      "text-anchor": "middle" }, cat));
  });
  for (const l of spec.lines) {
    const line = svg("line", { x1: m.l, x2: width - m.r, y1: y(l.bytes), y2: y(l.bytes),
      stroke: l.color, "stroke-width": 2, "stroke-dasharray": l.dash || "", class: "limit" });
    line.append(svg("title", {}, l.label));
    root.append(line);
  }
  if (spec.band) {
    const i = spec.categories.indexOf(spec.band.category);
    const cx = m.l + band * i + band / 2;
    const group = svg("g", { class: "band" });
    group.append(svg("line", { x1: cx, x2: cx, y1: y(spec.band.low), y2: y(spec.band.high) }));
    for (const b of [spec.band.low, spec.band.high]) {
      group.append(svg("line", { x1: cx - 9, x2: cx + 9, y1: y(b), y2: y(b) }));
    }
    group.append(svg("title", {}, `likely ${fmtBytes(spec.band.low)} – ${fmtBytes(spec.band.high)}`));
    root.append(group);
  }
  const legend = el("div", {});
  drawLegend(legend, spec.groups.filter((g) => g.values.some((v) => v > 0)), spec.lines);
  container.replaceChildren(...legend.childNodes, root);
}
