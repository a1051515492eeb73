// tokenscope built-in dashboard: three pages over /api/dashboard/{page}.
// State lives in the URL fragment (#page=…&range=…&until=…&model=…), so every view is a link.
// Every number shown carries data-key (its path in the page's JSON) and data-value (the raw
// JSON value) so tests can compare the page with the API.
"use strict";

(function () {
  const PAGES = ["overview", "performance", "cost"];
  const FILTERS = ["model", "request_type", "business_line"];
  const COLORS = ["#2563eb", "#d97706", "#dc2626", "#059669", "#7c3aed", "#0891b2"];
  let cfg = { refresh_seconds: 10, trace_url: null, tracing: false };
  let charts = [];
  let timer = null;
  let seq = 0;

  // ---- state -------------------------------------------------------------------------
  function readState() {
    const p = new URLSearchParams(location.hash.replace(/^#/, ""));
    const st = {
      page: PAGES.includes(p.get("page")) ? p.get("page") : "overview",
      range: ["5m", "1h", "24h", "7d"].includes(p.get("range")) ? p.get("range") : "1h",
      until: p.get("until") || "",
    };
    for (const f of FILTERS) st[f] = p.get(f) || "";
    return st;
  }
  function writeState(st) {
    const p = new URLSearchParams();
    p.set("page", st.page);
    p.set("range", st.range);
    if (st.until) p.set("until", st.until);
    for (const f of FILTERS) if (st[f]) p.set(f, st[f]);
    const h = "#" + p.toString();
    if (location.hash !== h) location.hash = h; else render();
  }
  function token() {
    const m = location.hash.match(/(?:^#|&)token=([^&]*)/);
    if (m) {
      sessionStorage.setItem("tokenscope-token", decodeURIComponent(m[1]));
      history.replaceState(null, "", location.pathname + location.hash.replace(/(^#|&)token=[^&]*/, "$1").replace(/#&/, "#"));
    }
    return sessionStorage.getItem("tokenscope-token") || "";
  }

  // ---- formatting --------------------------------------------------------------------
  const UNITS = {
    ms: (v) => (Math.abs(v) < 10 ? v.toFixed(2) : v.toFixed(1)) + " ms",
    pct: (v) => (v * 100).toFixed(2) + " %",
    rate: (v) => v.toFixed(2) + " /s",
    usd: (v) => "$" + v.toFixed(4),
    int: (v) => String(Math.round(v)),
    num: (v) => v.toFixed(2),
  };
  function get(obj, path) {
    return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
  }
  function num(data, key, unit) {
    const v = get(data, key);
    const span = document.createElement("span");
    span.className = "num";
    span.dataset.key = key;
    span.dataset.unit = unit;
    span.dataset.value = JSON.stringify(v === undefined ? null : v);
    span.textContent = v == null ? "–" : UNITS[unit](v);
    return span;
  }
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else if (k.startsWith("data-")) e.setAttribute(k, v); else e[k] = v;
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }
  function tile(label, data, key, unit) {
    return el("div", { class: "tile" }, el("span", { class: "label" }, label), num(data, key, unit));
  }
  function fmtTime(unixS) {
    return new Date(unixS * 1000).toISOString().replace("T", " ").slice(0, 19) + "Z";
  }

  // ---- charts ------------------------------------------------------------------------
  function chart(parent, id, title, hint, data, t, series, unit, onPick) {
    const box = el("div", { class: "chart", id: "chart-" + id }, el("h3", {}, title, " ", el("span", { class: "hint" }, hint || "")));
    parent.append(box);
    const cols = [t].concat(series.map((s) => get(data, s.key)));
    const points = series.reduce((n, s) => n + get(data, s.key).filter((v) => v != null).length, 0);
    box.dataset.points = String(points);
    box.dataset.series = series.map((s) => s.key).join(",");
    const width = Math.max(300, box.clientWidth - 16);
    const opts = {
      width: width,
      height: 220,
      series: [{}].concat(series.map((s, i) => ({
        label: s.label,
        stroke: COLORS[i % COLORS.length],
        width: 1.5,
        spanGaps: false,
        value: (u, v) => (v == null ? "–" : UNITS[unit](v)),
        points: { show: true, size: 3 },
      }))),
      axes: [{}, { values: (u, vals) => vals.map((v) => (unit === "pct" ? (v * 100).toFixed(0) + "%" : String(+v.toPrecision(4)))) , size: 60 }],
      scales: { x: { time: true } },
      legend: { live: true },
    };
    const u = new uPlot(opts, cols, box);
    charts.push(u);
    if (onPick) {
      u.over.style.cursor = "pointer";
      u.over.addEventListener("click", () => {
        const i = u.cursor.idx;
        if (i != null && i >= 0) onPick(t[i]);
      });
    }
    return u;
  }

  // ---- pages -------------------------------------------------------------------------
  function drillTo(unixS, st) {
    // Five minutes around the picked time, on the performance page, same filters.
    const next = Object.assign({}, st, { page: "performance", range: "5m", until: String(Math.ceil(unixS + 150)) });
    document.getElementById("refresh").checked = false;
    writeState(next);
  }

  // "2 requests for 0.9 s; largest batch-job (offline), 1500 tokens, request abc…".
  function blameText(b) {
    if (!b) return "–";
    if (!b.requests) return "nobody";
    let s = b.requests + (b.requests === 1 ? " request" : " requests");
    if (b.blocked_ms != null) s += " for " + (b.blocked_ms >= 1000 ? (b.blocked_ms / 1000).toFixed(1) + " s" : Math.round(b.blocked_ms) + " ms");
    if (b.blocker_request_id) {
      s += "; largest " + (b.blocker_caller || "(unknown)");
      if (b.blocker_business_line) s += " (" + b.blocker_business_line + ")";
      if (b.blocker_prompt_tokens != null) s += ", " + b.blocker_prompt_tokens + " tokens";
      s += ", request " + b.blocker_request_id.slice(0, 13);
    }
    return s;
  }

  // The record's engine_timing in words.
  function engineTimingText(t) {
    if (t === "consistent") return "own";
    if (t === "per_step") return "per step (shared)";
    if (t === "exceeds_gateway") return "above the gateway's";
    return "–";
  }

  function slowTable(data, key, st) {
    const rows = get(data, key) || [];
    const t = el("table", { id: "slowest" }, el("tr", {},
      el("th", {}, "request"), el("th", {}, "start"), el("th", {}, "model"), el("th", {}, "outcome"),
      el("th", {}, "in"), el("th", {}, "out"), el("th", {}, "e2e"), el("th", {}, "TTFT"),
      el("th", { title: "part of TTFT the engine did not account for: network, its HTTP front end, tokenisation, waiting for its current step (TTFT = gateway + this + engine queue + prefill)" }, "not seen by engine"),
      el("th", {}, "queue"), el("th", {}, "prefill"), el("th", {}, "decode"),
      el("th", { title: "whether the engine's queue / prefill / decode are this request's own numbers" }, "engine numbers"),
      el("th", { title: "requests in prefill on its replica while it waited; the largest of them" }, "waited behind"),
      el("th", {}, "trace")));
    rows.forEach((r, i) => {
      const k = key + "." + i;
      let trace;
      if (r.trace_url) trace = el("a", { href: r.trace_url, target: "_blank", rel: "noopener", class: "trace-link" }, "trace");
      else if (r.trace_kept) trace = el("span", { title: "kept; set [dashboard] trace_url to link it" }, r.trace_id.slice(0, 8) + "…");
      else trace = el("span", { class: "muted" }, r.trace_kept === false ? "not kept" : "–");
      const tr = el("tr", { class: "drill", title: "show the performance split around this request" },
        el("td", {}, r.request_id.slice(0, 13)), el("td", {}, fmtTime(r.created_at)), el("td", {}, r.model), el("td", {}, r.outcome),
        el("td", {}, num(data, k + ".input_tokens", "int")), el("td", {}, num(data, k + ".output_tokens", "int")),
        el("td", {}, num(data, k + ".total_ms", "ms")), el("td", {}, num(data, k + ".ttft_ms", "ms")),
        el("td", { class: "unaccounted" }, num(data, k + ".ttft_unaccounted_ms", "ms")),
        el("td", r.queue_source === "derived" ? { class: "derived", title: "derived by the gateway (TTFT − prefill): the engine reports no queue time" } : {},
          num(data, k + ".queue_ms", "ms")),
        el("td", {}, num(data, k + ".prefill_ms", "ms")),
        el("td", {}, num(data, k + ".decode_ms", "ms")), el("td", { class: "engine-timing" }, engineTimingText(r.engine_timing)),
        el("td", { class: "blame" }, blameText(r.blame)), el("td", {}, trace));
      tr.addEventListener("click", (ev) => { if (ev.target.tagName !== "A") drillTo(r.created_at, st); });
      t.append(tr);
    });
    if (!rows.length) return el("div", { class: "empty" }, "no requests in this range");
    return t;
  }

  function overview(main, d, st) {
    main.append(el("h2", {}, "Range ", d.range));
    main.append(el("div", { class: "tiles" },
      tile("requests", d, "summary.requests", "int"),
      tile("success rate", d, "summary.success_rate", "pct"),
      tile("QPS", d, "summary.qps", "rate"),
      tile("input tokens /s", d, "summary.input_tokens_per_s", "rate"),
      tile("output tokens /s", d, "summary.output_tokens_per_s", "rate"),
      tile("TTFT P99", d, "summary.ttft_ms.p99", "ms"),
      tile("TPOT P99", d, "summary.tpot_ms.p99", "ms")));
    main.append(el("h2", {}, "Quantiles: last 5 min and last hour side by side"));
    const q = el("table", { id: "quantiles" }, el("tr", {}, el("th", {}, ""),
      el("th", {}, "5m P50"), el("th", {}, "5m P90"), el("th", {}, "5m P95"), el("th", {}, "5m P99"),
      el("th", {}, "1h P50"), el("th", {}, "1h P90"), el("th", {}, "1h P95"), el("th", {}, "1h P99")));
    for (const [label, m] of [["TTFT", "ttft_ms"], ["TPOT", "tpot_ms"], ["end to end", "e2e_ms"]]) {
      const tr = el("tr", {}, el("td", {}, label));
      for (const w of [0, 1]) for (const p of ["p50", "p90", "p95", "p99"]) tr.append(el("td", {}, num(d, `trailing.${w}.${m}.${p}`, "ms")));
      q.append(tr);
    }
    const reqs = el("tr", {}, el("td", {}, "requests"));
    for (const w of [0, 1]) reqs.append(el("td", { colSpan: 4 }, num(d, `trailing.${w}.requests`, "int")));
    q.append(reqs);
    main.append(q);
    const c = el("div", { class: "charts" });
    main.append(el("h2", {}, "Over time"), c);
    const t = d.series.t;
    const pick = (x) => drillTo(x, st);
    chart(c, "ttft", "TTFT", "click a point: performance split of that moment", d, t,
      [{ key: "series.ttft_p50", label: "P50" }, { key: "series.ttft_p90", label: "P90" }, { key: "series.ttft_p95", label: "P95" }, { key: "series.ttft_p99", label: "P99" }], "ms", pick);
    chart(c, "tpot", "TPOT", "click a point to drill down", d, t,
      [{ key: "series.tpot_p50", label: "P50" }, { key: "series.tpot_p90", label: "P90" }, { key: "series.tpot_p95", label: "P95" }, { key: "series.tpot_p99", label: "P99" }], "ms", pick);
    chart(c, "qps", "QPS", "", d, t, [{ key: "series.qps", label: "req/s" }], "rate", pick);
    chart(c, "success", "Success rate", "", d, t, [{ key: "series.success_rate", label: "ok" }], "pct", pick);
    chart(c, "tokens", "Token rate", "", d, t,
      [{ key: "series.input_tokens_per_s", label: "input /s" }, { key: "series.output_tokens_per_s", label: "output /s" }], "rate", pick);
    main.append(el("h2", {}, "Slowest requests (click: performance split around it)"), slowTable(d, "slowest", st));
  }

  function performance(main, d, st) {
    main.append(el("h2", {}, "Range ", d.range, st.until ? " ending " + fmtTime(d.until) : ""));
    main.append(el("div", { class: "tiles" },
      tile("requests", d, "requests", "int"),
      tile("mean not seen by engine", d, "split.unaccounted_ms", "ms"),
      tile("mean queue", d, "split.queue_ms", "ms"),
      tile("mean prefill", d, "split.prefill_ms", "ms"),
      tile("mean decode", d, "split.decode_ms", "ms"),
      tile("mean end to end", d, "split.e2e_ms", "ms"),
      tile("engine running", d, "engine.running", "num"),
      tile("engine waiting", d, "engine.waiting", "num"),
      tile("KV-cache usage", d, "engine.kv_usage", "pct")));
    const c = el("div", { class: "charts" });
    main.append(el("h2", {}, "Where the time goes"), c);
    const t = d.series.t;
    chart(c, "split", "Queue / prefill / decode (mean)", "", d, t,
      [{ key: "series.queue_ms", label: "queue" }, { key: "series.prefill_ms", label: "prefill" }, { key: "series.decode_ms", label: "decode" }], "ms");
    chart(c, "engine", "Engine running / waiting (at arrival)", "", d, t,
      [{ key: "series.engine_running", label: "running" }, { key: "series.engine_waiting", label: "waiting" }], "num");
    chart(c, "kv", "KV-cache usage (at arrival)", "", d, t, [{ key: "series.engine_kv_usage", label: "KV usage" }], "pct");
    main.append(el("h2", {}, "Latency by input length"));
    const b = el("table", { id: "by-bucket" }, el("tr", {}, el("th", {}, "input tokens"), el("th", {}, "requests"),
      el("th", {}, "TTFT P50"), el("th", {}, "TTFT P99"), el("th", {}, "e2e P50"), el("th", {}, "e2e P99"),
      el("th", {}, "queue"), el("th", {}, "prefill"), el("th", {}, "decode")));
    d.by_input_bucket.forEach((r, i) => {
      const k = "by_input_bucket." + i;
      b.append(el("tr", {}, el("td", {}, r.input_bucket), el("td", {}, num(d, k + ".requests", "int")),
        el("td", {}, num(d, k + ".ttft_ms.p50", "ms")), el("td", {}, num(d, k + ".ttft_ms.p99", "ms")),
        el("td", {}, num(d, k + ".e2e_ms.p50", "ms")), el("td", {}, num(d, k + ".e2e_ms.p99", "ms")),
        el("td", {}, num(d, k + ".split.queue_ms", "ms")), el("td", {}, num(d, k + ".split.prefill_ms", "ms")),
        el("td", {}, num(d, k + ".split.decode_ms", "ms"))));
    });
    main.append(b);
    // The resource layer: the GPUs now (the gateway's [gpu] reading) and latency by their
    // utilisation at the requests' arrival (from the store).
    main.append(el("h2", {}, "GPU"));
    const gpus = get(d, "gpu.now") || [];
    if (gpus.length) {
      const g = el("table", { id: "gpu-now" }, el("tr", {}, el("th", {}, "GPU"), el("th", {}, "model"),
        el("th", {}, "utilization"), el("th", {}, "memory bandwidth"), el("th", {}, "memory used")));
      gpus.forEach((r, i) => {
        const k = "gpu.now." + i;
        g.append(el("tr", {}, el("td", {}, r.gpu), el("td", {}, r.model_name || "–"),
          el("td", {}, num(d, k + ".utilization", "pct")), el("td", {}, num(d, k + ".memory_bandwidth", "pct")),
          el("td", {}, num(d, k + ".memory_used_ratio", "pct"))));
      });
      main.append(g);
    } else {
      main.append(el("div", { class: "empty", id: "gpu-none" }, "no GPU telemetry (configure [gpu]: NVML or a DCGM exporter)"));
    }
    const gb = el("table", { id: "by-gpu-band" }, el("tr", {}, el("th", {}, "GPU utilization at arrival"), el("th", {}, "requests"),
      el("th", {}, "TTFT P50"), el("th", {}, "TTFT P99"), el("th", {}, "TPOT P50"), el("th", {}, "TPOT P99")));
    (get(d, "gpu.by_gpu_band") || []).forEach((r, i) => {
      const k = "gpu.by_gpu_band." + i;
      gb.append(el("tr", {}, el("td", {}, r.gpu_band), el("td", {}, num(d, k + ".requests", "int")),
        el("td", {}, num(d, k + ".ttft_ms.p50", "ms")), el("td", {}, num(d, k + ".ttft_ms.p99", "ms")),
        el("td", {}, num(d, k + ".tpot_ms.p50", "ms")), el("td", {}, num(d, k + ".tpot_ms.p99", "ms"))));
    });
    main.append(gb);
    main.append(el("h2", {}, "Slowest requests"), slowTable(d, "slowest", st));
  }

  function costRows(d, key, id, heading) {
    const rows = get(d, key) || [];
    const t = el("table", { id: id }, el("tr", {}, el("th", {}, heading), el("th", {}, "requests"),
      el("th", {}, "input tokens"), el("th", {}, "output tokens"), el("th", {}, "cost"), el("th", {}, "share")));
    rows.forEach((r, i) => {
      const k = key + "." + i;
      t.append(el("tr", {}, el("td", {}, r.key), el("td", {}, num(d, k + ".requests", "int")),
        el("td", {}, num(d, k + ".input_tokens", "int")), el("td", {}, num(d, k + ".output_tokens", "int")),
        el("td", {}, num(d, k + ".cost_usd", "usd")), el("td", {}, num(d, k + ".share", "pct"))));
    });
    return rows.length ? t : el("div", { class: "empty" }, "no requests in this range");
  }

  function cost(main, d) {
    main.append(el("h2", {}, "Range ", d.range));
    main.append(el("div", { class: "tiles" },
      tile("cost", d, "totals.cost_usd", "usd"),
      tile("requests", d, "totals.requests", "int"),
      tile("input tokens", d, "totals.input_tokens", "int"),
      tile("output tokens", d, "totals.output_tokens", "int"),
      tile("requests without a price", d, "totals.unpriced_requests", "int")));
    const c = el("div", { class: "charts" });
    main.append(el("h2", {}, "Over time"), c);
    const t = d.series.t;
    chart(c, "cost", "Cost per interval", "", d, t, [{ key: "series.cost_usd", label: "USD" }], "usd");
    chart(c, "tokens", "Tokens per interval", "", d, t,
      [{ key: "series.input_tokens", label: "input" }, { key: "series.output_tokens", label: "output" }], "int");
    main.append(el("h2", {}, "By business line"), costRows(d, "by_business_line", "by-line", "business line"));
    main.append(el("h2", {}, "By user (top 20)"), costRows(d, "by_user", "by-user", "user"));
    main.append(el("h2", {}, "Budgets"));
    if (!d.budgets.length) {
      main.append(el("div", { class: "empty", id: "budgets" }, "no [[budgets]] configured"));
    } else {
      const bt = el("table", { id: "budgets" }, el("tr", {}, el("th", {}, "business line"), el("th", {}, "usage of the period's budget")));
      d.budgets.forEach((b, i) => {
        const w = Math.min(100, b.usage_ratio * 100);
        const cls = b.usage_ratio >= 1 ? "bar over" : b.usage_ratio >= 0.9 ? "bar warn" : "bar";
        bt.append(el("tr", {}, el("td", {}, b.business_line),
          el("td", {}, el("span", { class: cls, style: "" }), num(d, "budgets." + i + ".usage_ratio", "pct"))));
        bt.lastChild.querySelector(".bar").style.width = (w * 2) + "px";
      });
      main.append(bt);
    }
  }

  // ---- loading -----------------------------------------------------------------------
  function setStatus(text, error) {
    const s = document.getElementById("status");
    s.textContent = text;
    s.className = error ? "error" : "";
  }
  async function api(path) {
    const headers = {};
    const tk = token();
    if (tk) headers["Authorization"] = "Bearer " + tk;
    const r = await fetch(path, { headers: headers, cache: "no-store" });
    if (r.status === 401) {
      document.getElementById("auth").hidden = false;
      throw new Error("this dashboard needs a token");
    }
    if (!r.ok) throw new Error(r.status + ": " + (await r.text()));
    return r.json();
  }
  function fillSelect(id, values, current) {
    const s = document.getElementById(id);
    const want = [""].concat(values);
    if (current && !want.includes(current)) want.push(current);
    const have = Array.from(s.options).map((o) => o.value);
    if (have.join("\u0000") !== want.join("\u0000")) {
      s.replaceChildren(...want.map((v) => el("option", { value: v }, v === "" ? "all" : v)));
    }
    s.value = current;
  }
  async function render() {
    const st = readState();
    const my = ++seq;
    document.body.dataset.ready = "";
    for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === st.page);
    document.getElementById("range").value = st.range;
    const q = new URLSearchParams({ range: st.range });
    if (st.until) q.set("until", st.until);
    for (const f of FILTERS) if (st[f]) q.set(f, st[f]);
    setStatus("loading…");
    let d;
    try {
      d = await api("api/dashboard/" + st.page + "?" + q.toString());
    } catch (e) {
      if (my === seq) setStatus(String(e.message || e), true);
      return;
    }
    if (my !== seq) return;
    document.body.dataset.api = "api/dashboard/" + st.page + "?" + q.toString();
    fillSelect("model", d.options.models, st.model);
    fillSelect("request_type", d.options.request_types, st.request_type);
    fillSelect("business_line", d.options.business_lines, st.business_line);
    for (const u of charts) u.destroy();
    charts = [];
    const main = document.getElementById("main");
    main.replaceChildren();
    main.dataset.page = st.page;
    ({ overview: overview, performance: performance, cost: cost })[st.page](main, d, st);
    setStatus("window " + fmtTime(d.since) + " – " + fmtTime(d.until) + ", step " + d.step_seconds + " s" +
      (st.until ? " (fixed; press \"now\" for live)" : "") + ", updated " + new Date().toLocaleTimeString());
    document.body.dataset.ready = st.page + ":" + my;
    schedule();
  }
  function schedule() {
    if (timer) clearTimeout(timer);
    timer = null;
    const st = readState();
    if (document.getElementById("refresh").checked && !st.until && cfg.refresh_seconds > 0) {
      timer = setTimeout(render, cfg.refresh_seconds * 1000);
    }
  }

  // ---- wiring ------------------------------------------------------------------------
  document.getElementById("range").addEventListener("change", (e) => writeState(Object.assign(readState(), { range: e.target.value, until: "" })));
  for (const f of FILTERS) {
    document.getElementById(f).addEventListener("change", (e) => writeState(Object.assign(readState(), { [f]: e.target.value })));
  }
  document.getElementById("refresh").addEventListener("change", schedule);
  document.getElementById("now").addEventListener("click", () => writeState(Object.assign(readState(), { until: "" })));
  document.getElementById("auth-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("tokenscope-token", document.getElementById("token").value);
    document.getElementById("auth").hidden = true;
    start();
  });
  for (const a of document.querySelectorAll("#nav a")) {
    a.addEventListener("click", (e) => {
      e.preventDefault();
      writeState(Object.assign(readState(), { page: a.dataset.page }));
    });
  }
  window.addEventListener("hashchange", render);
  async function start() {
    try {
      cfg = await api("api/dashboard/config");
    } catch (e) {
      setStatus(String(e.message || e), true);
      return;
    }
    render();
  }
  token();
  start();
})();
