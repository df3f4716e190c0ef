// loraplex admin dashboard: polls the data endpoint and redraws six Chart.js charts; shows speculative decoding's
// acceptance (overall and per adapter) where engines speculate; lists adapters with their version history (click a
// row). State for tests and debugging:
// window.loraplexDashboard = {charts, data, updates, failures, lastError, adapters, history}.
(function () {
  "use strict";

  const body = document.body;
  const baseUrl = body.dataset.dataUrl || "/admin/dashboard/data";
  // zoom through the URL fragment, e.g. /admin/dashboard#bin=2&span=120 (bin and span in seconds)
  function dataUrl() {
    const h = new URLSearchParams(window.location.hash.slice(1));
    const q = new URLSearchParams();
    if (/^\d+$/.test(h.get("bin") || "")) q.set("bin_s", h.get("bin"));
    if (/^\d+$/.test(h.get("span") || "")) q.set("span_s", h.get("span"));
    return q.toString() ? `${baseUrl}?${q}` : baseUrl;
  }
  const pollMs = Math.max(500, parseInt(body.dataset.pollMs || "2000", 10));
  const state = (window.loraplexDashboard = { charts: {}, data: null, updates: 0, failures: 0, lastError: null,
                                              adapters: null, history: null, selected: null });
  const adaptersUrl = body.dataset.adaptersUrl || "/admin/dashboard/adapters";
  const colors = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
  const tierColors = { gpu: "#16a34a", cpu: "#2563eb", disk: "#6b7280", loading: "#ea580c" };

  const $ = (id) => document.getElementById(id);
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });
  const ms = (v) => (v === null || v === undefined ? null : Math.round(v * 10000) / 10);
  const fmt = (n) => (n >= 1e6 ? (n / 1e6).toFixed(1) + "M" : n >= 1e3 ? (n / 1e3).toFixed(1) + "k" : String(n));

  function line(label, color, extra) {
    return Object.assign({ label, data: [], borderColor: color, backgroundColor: color, borderWidth: 2,
                           pointRadius: 0, tension: 0.15, spanGaps: true }, extra || {});
  }

  function makeCharts() {
    Chart.defaults.animation = false;
    Chart.defaults.maintainAspectRatio = false;
    Chart.defaults.font.size = 11;
    const timeX = { ticks: { maxTicksLimit: 6, maxRotation: 0 } };
    state.charts.throughput = new Chart($("chart-throughput"), {
      type: "line",
      data: { labels: [], datasets: [line("requests/s", colors[0], { yAxisID: "y" }),
                                     line("tokens/s", colors[1], { yAxisID: "y1" })] },
      options: { scales: { x: timeX, y: { beginAtZero: true, title: { display: true, text: "req/s" } },
                           y1: { beginAtZero: true, position: "right", grid: { drawOnChartArea: false },
                                 title: { display: true, text: "tok/s" } } } },
    });
    state.charts.latency = new Chart($("chart-latency"), {
      type: "line",
      data: { labels: [], datasets: [line("e2e p50", colors[0]), line("e2e p90", colors[5]),
                                     line("e2e p99", colors[2]), line("TTFT p50", colors[1], { borderDash: [4, 3] }),
                                     line("TTFT p99", colors[4], { borderDash: [4, 3] })] },
      options: { scales: { x: timeX, y: { beginAtZero: true, title: { display: true, text: "ms" } } } },
    });
    state.charts.adapters = new Chart($("chart-adapters"), {
      type: "bar",
      data: { labels: ["gpu", "cpu", "disk", "loading"],
              datasets: [{ label: "adapters", data: [], backgroundColor: Object.values(tierColors) }] },
      options: { plugins: { legend: { display: false } }, scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } },
    });
    state.charts.tenants = new Chart($("chart-tenants"), {
      type: "bar",
      data: { labels: [], datasets: [{ label: "tokens last minute", data: [], backgroundColor: colors[0] },
                                     { label: "tokens/min quota", data: [], backgroundColor: "#cbd5e1" }] },
      options: { indexAxis: "y", scales: { x: { beginAtZero: true } } },
    });
    state.charts.errors = new Chart($("chart-errors"), {
      type: "bar",
      data: { labels: [], datasets: [{ label: "4xx", data: [], backgroundColor: colors[4], stack: "e" },
                                     { label: "5xx", data: [], backgroundColor: colors[2], stack: "e" }] },
      options: { scales: { x: Object.assign({ stacked: true }, timeX),
                           y: { stacked: true, beginAtZero: true, ticks: { precision: 0 } } } },
    });
    state.charts.uploads = new Chart($("chart-uploads"), {
      type: "doughnut",
      data: { labels: [], datasets: [{ label: "uploads", data: [], backgroundColor: colors }] },
      options: { plugins: { legend: { position: "right" } } },
    });
  }

  function setRows(tableId, rows, onClick) {
    const tbody = $(tableId).tBodies[0];
    tbody.replaceChildren(...rows.map((cells, i) => {
      const tr = document.createElement("tr");
      if (onClick) { tr.className = "clickable"; tr.addEventListener("click", () => onClick(i)); }
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = c === null || c === undefined ? "–" : String(c);
        td.title = td.textContent;
        tr.appendChild(td);
      }
      return tr;
    }));
  }

  const uploadName = (u) => (u.adapter ? `${u.tenant || "?"} / ${u.adapter}` + (u.version ? ` v${u.version}` : "")
                                       : u.upload_id);
  const day = (iso) => (iso ? iso.replace("T", " ").slice(0, 19) : null);
  const keyName = (k) => (k ? `${k.name || "(unnamed)"} (${k.prefix})` : null);

  async function getJson(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (r.status === 401) { window.location.reload(); throw new Error("signed out"); }
    if (!r.ok) throw new Error(`${url} answered ${r.status}`);
    return r.json();
  }

  async function showHistory(adapter) {
    state.selected = adapter.id;
    const h = await getJson(`${adaptersUrl}/${encodeURIComponent(adapter.id)}/versions`);
    state.history = h;
    $("history-title").textContent = `Version history: ${h.tenant} / ${h.adapter}`;
    setRows("history-table", h.data.map((v) => [v.number, v.status, v.sha256 ? v.sha256.slice(0, 12) : null,
      v.size_bytes === null ? null : fmt(v.size_bytes) + " B", day(v.created_at), keyName(v.created_by),
      v.aliases.join(", ") || null, v.deleted_at ? `${day(v.deleted_at)} by ${keyName(v.deleted_by) || "?"}` : null]));
  }

  async function refreshAdapters() {
    try {
      const d = await getJson(adaptersUrl);
      state.adapters = d.data;
      setRows("registry-table", d.data.map((a) => [a.tenant, a.adapter, a.latest_version,
        Object.entries(a.aliases).map(([k, v]) => `${k}→${v}`).join(", "), a.versions, day(a.changed_at)]),
        (i) => showHistory(d.data[i]).catch((e) => { state.lastError = String(e); }));
      if (state.selected) {
        const still = d.data.find((a) => a.id === state.selected);
        if (still) await showHistory(still);
      }
    } catch (e) {
      state.lastError = String(e);
    }
  }

  function renderUploads(uploads) {
    const box = $("upload-progress");
    const items = uploads.active.map((u) => {
      const div = document.createElement("div");
      div.className = "upload";
      const pct = u.fraction === null ? null : Math.round(u.fraction * 100);
      div.textContent = `${uploadName(u)}: ${u.stage}` + (pct === null ? "" : ` ${pct}%`) +
                        ` · ${fmt(u.received_bytes)} B · ${u.elapsed_s.toFixed(1)} s`;
      const bar = document.createElement("progress");
      bar.max = 100;
      if (pct !== null && u.stage === "receiving") bar.value = pct;  // indeterminate while validating
      div.appendChild(bar);
      return div;
    });
    for (const u of uploads.recent.slice(0, 5)) {
      const div = document.createElement("div");
      div.className = "upload";
      div.textContent = `${uploadName(u)}: ${u.outcome} (${u.reason}) in ${u.elapsed_s.toFixed(1)} s`;
      items.push(div);
    }
    box.replaceChildren(...items);
  }

  const ratio = (v, digits) => (v === null || v === undefined ? "–" : v.toFixed(digits));
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");

  // speculative decoding: summed over the replicas that speculate; "not speculating" when none does
  function renderSpeculative(sp) {
    $("spec-tiles").hidden = !sp;
    $("spec-table").hidden = !sp;
    if (!sp) {
      $("spec-summary").textContent = "Not speculating: no engine replica runs speculative decoding.";
      setRows("spec-table", []);
      return;
    }
    const methods = [...new Set(sp.replicas.map((r) => `${r.method}, k = ${r.num_speculative_tokens}`))];
    $("spec-summary").textContent = `${sp.replicas.length} replica(s) speculating (${sp.replicas.map((r) => r.replica)
      .join(", ")}); counts since each engine started.`;
    $("spec-method").textContent = methods.join(" · ");
    $("spec-length").textContent = ratio(sp.acceptance_length, 2);
    $("spec-rate").textContent = pct(sp.acceptance_rate);
    $("spec-proposed").textContent = fmt(sp.proposed);
    $("spec-accepted").textContent = fmt(sp.accepted);
    const rows = sp.adapters.map((a) => [a.adapter_id === null ? "–" : a.tenant,
      a.adapter_id === null ? "(base model)" : a.adapter, a.version === null ? null : `v${a.version}`,
      a.proposed, a.accepted, ratio(a.acceptance_length, 2), pct(a.acceptance_rate)]);
    const o = sp.adapters_other;
    if (o && o.proposed > 0) {
      rows.push(["–", `(${o.adapters} more)`, null, o.proposed, o.accepted, ratio(o.acceptance_length, 2),
                 pct(o.acceptance_rate)]);
    }
    setRows("spec-table", rows);
  }

  function update(d) {
    const s = d.series;
    const labels = s.t.map(clock);
    const c = state.charts;

    c.throughput.data.labels = labels;
    c.throughput.data.datasets[0].data = s.requests_per_s;
    c.throughput.data.datasets[1].data = s.tokens_per_s;

    c.latency.data.labels = labels;
    ["e2e_p50", "e2e_p90", "e2e_p99", "ttft_p50", "ttft_p99"].forEach((k, i) => {
      c.latency.data.datasets[i].data = s[k].map(ms);
    });

    const tiers = d.adapters.tiers;
    c.adapters.data.datasets[0].data = ["gpu", "cpu", "disk", "loading"].map((t) => tiers[t] || 0);
    setRows("adapter-table", d.adapters.resident.map((a) => [a.tenant, a.adapter || a.adapter_id,
                                                             a.version === null ? null : `v${a.version}`,
                                                             a.replica, a.tier]));

    const tenants = d.tenants.slice(0, 12);
    c.tenants.data.labels = tenants.map((t) => t.tenant);
    c.tenants.data.datasets[0].data = tenants.map((t) => t.tokens_last_min);
    c.tenants.data.datasets[1].data = tenants.map((t) => t.tokens_per_minute);

    c.errors.data.labels = labels;
    c.errors.data.datasets[0].data = s.errors_4xx;
    c.errors.data.datasets[1].data = s.errors_5xx;
    setRows("error-table", d.errors.map((e) => [clock(e.time), e.tenant, e.adapter, e.status, e.error]));

    c.uploads.data.labels = d.uploads.outcomes.map((o) => `${o.outcome}: ${o.reason}`);
    c.uploads.data.datasets[0].data = d.uploads.outcomes.map((o) => o.count);
    renderUploads(d.uploads);
    renderSpeculative(d.speculative);

    for (const chart of Object.values(c)) chart.update("none");

    const t = d.totals;
    $("tile-requests").textContent = fmt(t.requests);
    $("tile-error-rate").textContent = (100 * t.error_rate).toFixed(1) + "%";
    $("tile-tokens").textContent = fmt(t.prompt_tokens + t.completion_tokens);
    $("tile-engines").textContent = `${d.engines.filter((e) => e.up).length} / ${d.engines.length}`;
    const used = d.engines.reduce((a, e) => a + (e.kv_blocks_used || 0), 0);
    const total = d.engines.reduce((a, e) => a + (e.kv_blocks_total || 0), 0);
    $("tile-kv").textContent = total ? `${used} / ${total}` : "–";
    $("tile-uploads").textContent = String(d.uploads.active.length);
  }

  function setStatus(text, bad) {
    const el = $("status");
    el.textContent = text;
    el.classList.toggle("bad", !!bad);
  }

  async function poll() {
    try {
      const r = await fetch(dataUrl(), { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (r.status === 401) { window.location.reload(); return; }  // session expired: back to the login form
      if (!r.ok) throw new Error(`data endpoint answered ${r.status}`);
      const d = await r.json();
      update(d);
      state.data = d;
      state.updates += 1;
      if (state.updates % 5 === 1) await refreshAdapters();
      setStatus(`updated ${clock(d.time)}`, false);
    } catch (e) {
      state.failures += 1;
      state.lastError = String(e);
      setStatus(`no data: ${e.message || e}`, true);
    } finally {
      setTimeout(poll, pollMs);
    }
  }

  makeCharts();
  poll();
})();
