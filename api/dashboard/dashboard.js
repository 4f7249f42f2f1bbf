"use strict";
// The statekeeper admin dashboard: plain script, no build step. Every data call carries the admin token
// (Authorization: Bearer), kept in sessionStorage; the page itself holds no data.
(function () {
  // At least half a second: the next poll starts once the last has answered, so a slow service is polled slower.
  const POLL_MS = Math.max(500, Number(new URLSearchParams(location.search).get("poll_ms")) || 3000);
  const PAGE_SIZE = 25;
  const $ = (id) => document.getElementById(id);
  let token = sessionStorage.getItem("statekeeper-admin-token") || "";
  let timer = null;
  let polling = 0;  // which run of polls is current: a sign-out or a new sign-in starts another
  let page = { prefix: "", after: "", next: null };
  let pageLoads = 0;  // the table shows the latest load's answer only (a poll's may come after a search's)
  const charts = {};
  let tierNames = [];  // the service's tiers, fastest first (from the tier cards' data)

  class Unauthorized extends Error {}

  async function api(method, path, body) {
    const headers = { Authorization: "Bearer " + token };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch("/v1/admin" + path,
                                 { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    if (!response.ok) {
      let detail = response.statusText;
      try { detail = (await response.json()).detail; } catch (e) { /* not JSON: a proxy's page */ }
      detail = typeof detail === "string" ? detail : JSON.stringify(detail);
      // The token refused (401), or the admin API as a whole (a read's 403: disabled). An action's 403 is that
      // action's own failure (the browser guard refusing this page's origin behind a proxy), not the token's.
      if (response.status === 401 || (response.status === 403 && method === "GET")) throw new Unauthorized(detail);
      throw new Error(detail);
    }
    return response.status === 204 ? null : response.json();
  }

  const fmtBytes = (n) => {
    if (n == null) return "—";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n) + " " + units[i];
  };
  const pct = (x) => (x == null ? "—" : (100 * x).toFixed(1) + " %");
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else if (k.startsWith("data-") || k === "scope" || k.startsWith("aria-")) node.setAttribute(k, v); else node[k] = v;
    }
    for (const child of children) node.append(child);
    return node;
  }

  // -- sign-in -------------------------------------------------------------------------------------------
  function showLogin(message) {
    clearTimeout(timer); timer = null; polling++;
    $("dashboard").hidden = true; $("login").hidden = false; $("signout").hidden = true;
    $("status").textContent = "Admin token required";
    document.body.dataset.state = "token-required";
    $("login-error").textContent = message || "";
  }
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    token = $("token").value.trim();
    sessionStorage.setItem("statekeeper-admin-token", token);
    start();
  });
  $("signout").addEventListener("click", () => { sessionStorage.removeItem("statekeeper-admin-token"); token = ""; showLogin(); });

  async function start() {
    $("login").hidden = true; $("dashboard").hidden = false;  // shown first: the charts size to it
    try {
      await refresh();
    } catch (e) {
      if (e instanceof Unauthorized) { showLogin("The admin API refused the token: " + e.message); return; }
    }
    $("signout").hidden = false;
    document.body.dataset.state = "ready";
    $("token").value = "";
    clearTimeout(timer);
    poll(++polling);
  }

  function poll(run) {  // the next refresh once this one has answered: polls never pile up on a slow service
    timer = setTimeout(async () => {
      try { await refresh(); } catch (e) { return; }  // signed out: showLogin stopped the polls
      if (run === polling) poll(run);
    }, POLL_MS);
  }

  // -- live refresh ----------------------------------------------------------------------------------------
  async function refresh() {
    try {
      const [tiers, history] = await Promise.all([api("GET", "/tiers"), api("GET", "/history")]);
      renderTiers(tiers, history.codecs);
      renderPlacement(tiers.placement, tiers.compression);
      renderCharts(history);
      $("status").textContent = "Live, updated " + new Date().toLocaleTimeString();
      if (!$("dashboard").hidden) await refreshRows();
    } catch (e) {
      if (e instanceof Unauthorized) { showLogin("The admin API refused the token: " + e.message); throw e; }
      $("status").textContent = "Update failed (" + e.message + "), retrying";
    }
  }

  function renderTiers(stats, codecs) {
    tierNames = stats.tiers.map((tier) => tier.name);
    const list = $("tiers");
    list.replaceChildren(...stats.tiers.map((tier) => {
      const reads = tier.hits + tier.misses;
      const up = tier.available;
      const meter = el("meter", { min: 0, max: Math.max(1, tier.budget_bytes), value: tier.usage_bytes,
                                  "aria-label": tier.name + " usage" });
      return el("li", { class: "card" + (up ? "" : " down"), "data-tier": tier.name, "data-available": String(up),
                        "data-blobs": String(tier.blobs) },
        el("h3", {}, tier.name),
        el("dl", {},
          el("dt", {}, "Status"), el("dd", { class: "availability " + (up ? "up" : "down") }, up ? "available" : "DOWN"),
          el("dt", {}, "Usage"), el("dd", { class: "usage" }, fmtBytes(tier.usage_bytes) + " of " + fmtBytes(tier.budget_bytes)),
          el("dt", {}, ""), el("dd", {}, meter),
          el("dt", {}, "Blobs"), el("dd", { class: "blobs" }, String(tier.blobs)),
          el("dt", {}, "Hit rate"), el("dd", {}, reads ? pct(tier.hits / reads) + " of " + reads : "no reads"),
          el("dt", {}, "Moved down / dropped"),
          el("dd", { class: "moves" }, tier.demotions + " / " + tier.evictions),
          el("dt", {}, "Codec"), el("dd", {}, (codecs || {})[tier.name] || "none")));
    }));
  }

  function fmtSeconds(s) {
    if (s < 60) return s + " s";
    if (s < 3600) return Math.round(s / 60) + " min";
    if (s < 86400) return +(s / 3600).toFixed(1) + " h";
    return +(s / 86400).toFixed(1) + " d";
  }

  function renderPlacement(placement, compression) {
    const gaps = placement.return_gaps;
    const residence = Object.entries(placement.residence_s).map(([tier, s]) => tier + " " + fmtSeconds(Math.round(s)));
    $("placement").replaceChildren(
      el("dt", {}, "Policy"), el("dd", { id: "placement-policy" }, placement.policy),
      el("dt", {}, "Conversations known"), el("dd", {}, String(placement.held)),
      el("dt", {}, "Returns within an hour"),
      el("dd", { id: "placement-calibration" }, placement.returns_within_hour + " seen, " +
         placement.predicted_returns_within_hour.toFixed(1) + " predicted"),
      el("dt", {}, "Residence"), el("dd", {}, residence.join(", ")),
      el("dt", {}, "Compressed / declined"),
      el("dd", { id: "placement-compression" }, compression.compressed + " / " + compression.declined),
      el("dt", {}, "Expired (TTL)"), el("dd", { id: "placement-expired" }, String(placement.expired)),
      el("dt", {}, "Compression weighed"),
      el("dd", { id: "placement-costs" }, placement.compression.compression_ratio + "x smaller, " +
         (placement.compression.compress_prefills === null ? "CPU not measured"
          : placement.compression.compress_prefills + " prefills of CPU") +
         " (" + placement.compression.compressions_seen + " measured)"));
    const most = Math.max(1, ...gaps.map((gap) => gap.returns));
    $("return-gaps").tBodies[0].replaceChildren(...gaps.map((gap, i) => {
      const upper = i + 1 < gaps.length ? fmtSeconds(gaps[i + 1].from_s) : "longer";
      return el("tr", { "data-from": String(gap.from_s), "data-returns": String(gap.returns) },
        el("td", {}, fmtSeconds(gap.from_s) + " to " + upper), el("td", {}, String(gap.returns)),
        el("td", {}, el("meter", { min: 0, max: most, value: gap.returns, "aria-label": "returns" })));
    }));
  }

  // -- charts ------------------------------------------------------------------------------------------------
  const CHARTS = [
    { id: "ttft-p50", title: "TTFT p50 by restore source (ms)", keyed: (s) => mapValues(s.ttft_ms, (v) => v[0]) },
    { id: "ttft-p95", title: "TTFT p95 by restore source (ms)", keyed: (s) => mapValues(s.ttft_ms, (v) => v[1]) },
    { id: "restores", title: "Restores per second by source", keyed: (s) => s.restores_per_s },
    { id: "hit-rate", title: "Hit rate (turns that did not recompute)", keyed: (s) => ({ "hit rate": s.hit_rate }) },
    { id: "tier-bytes", title: "Bytes per tier", keyed: (s) => s.tier_bytes },
    { id: "compression", title: "Compression ratio", keyed: (s) => ({ ratio: s.compression_ratio }) },
    { id: "queue", title: "Model thread queue depth", keyed: (s) => ({ queued: s.queue_depth }) },
  ];
  const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#57606a"];
  function mapValues(obj, fn) { const out = {}; for (const k in obj) out[k] = fn(obj[k]); return out; }

  function renderCharts(history) {
    const container = $("charts");
    const xs = history.samples.map((s) => s.t);
    for (const spec of CHARTS) {
      const rows = history.samples.map(spec.keyed);
      const keys = [...new Set(rows.flatMap((r) => Object.keys(r || {})))].sort();
      const data = [xs, ...keys.map((k) => rows.map((r) => (r && r[k] != null ? r[k] : null)))];
      const points = data.slice(1).reduce((n, series) => n + series.filter((v) => v != null).length, 0);
      let chart = charts[spec.id];
      if (!chart) {
        const figure = el("figure", { class: "chart", id: "chart-" + spec.id, "data-points": "0" },
                          el("figcaption", {}, spec.title));
        container.append(figure);
        chart = charts[spec.id] = { figure, plot: null, keys: "" };
      }
      chart.figure.setAttribute("data-points", String(points));
      chart.figure.setAttribute("aria-label", spec.title + ": " + points + " points");
      if (chart.plot && chart.keys === keys.join()) { chart.plot.setData(data); continue; }
      if (chart.plot) chart.plot.destroy();
      chart.keys = keys.join();
      const ink = getComputedStyle(document.body).color;  // a canvas knows no currentColor: light or dark
      const opts = {
        width: Math.max(360, chart.figure.clientWidth - 16), height: 200,
        series: [{}, ...keys.map((k, i) => ({ label: k, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: false,
                                              points: { show: true, size: 4 } }))],
        axes: [{ stroke: ink, grid: { stroke: "rgba(128,128,128,0.2)" } },
               { stroke: ink, grid: { stroke: "rgba(128,128,128,0.2)" },
                 size: 70, values: spec.id === "tier-bytes" ? (u, v) => v.map(fmtBytes) : undefined }],
      };
      chart.plot = new uPlot(opts, data, chart.figure);
    }
  }

  // -- conversations -----------------------------------------------------------------------------------------
  function choosingTier() {
    const active = document.activeElement;
    return active && active.tagName === "SELECT" && $("conversations").contains(active);
  }
  async function loadPage(options = {}) {
    const load = ++pageLoads;
    const query = new URLSearchParams({ prefix: page.prefix, after: page.after, limit: String(PAGE_SIZE) });
    const result = await api("GET", "/conversations?" + query);
    if (load !== pageLoads) return;  // a later load (a search, the next page) or an action answers for the table
    if (choosingTier() && !options.force) return;  // a tier being chosen is not pulled away: the next poll shows it
    page.next = result.next_after;
    $("next-page").disabled = !page.next;
    const body = $("conversations").tBodies[0];
    const focused = body.contains(document.activeElement) ? document.activeElement.getAttribute("aria-label") : null;
    body.replaceChildren(...result.data.map(rowOf));
    if (!result.data.length) body.append(el("tr", {}, el("td", { colSpan: 9 }, "No conversations")));
    if (focused) {  // the same control, drawn again, keeps the focus (a keyboard user's place in the table)
      const again = [...body.querySelectorAll("[aria-label]")].find((node) => node.getAttribute("aria-label") === focused);
      if (again) again.focus();
    }
  }
  async function refreshRows() {  // the rows on screen, as they are now (another admin, or turns, changed them)
    if (choosingTier()) return;
    try { await loadPage(); } catch (e) { if (e instanceof Unauthorized) throw e; }
  }

  function rowOf(row) {
    const tr = el("tr", { "data-id": row.id, "data-state": row.state, "data-tier": row.tier || "" });
    const action = (label, run) => el("button", { type: "button", onclick: run, "aria-label": label + " " + row.id }, label);
    tr.append(
      el("th", { scope: "row" }, el("code", {}, row.id)),
      el("td", { class: "state" }, row.state),
      el("td", { class: "tier" }, row.tier || "—"),
      el("td", {}, String(row.tokens)),
      el("td", {}, fmtBytes(row.stored_bytes)),
      el("td", {}, row.codec || "—"),
      el("td", {}, row.policy),
      el("td", {}, row.last_active ? new Date(row.last_active).toLocaleString() : "—"),
      el("td", { class: "actions" },
        action("Offload", () => act(row.id, "POST", "/offload")),
        action("Prefetch", () => act(row.id, "POST", "/prefetch")),
        moveControl(row),
        action("Delete", () => {
          if (confirm("Delete conversation " + row.id + "? Its history and stored KV are removed for good.")) {
            act(row.id, "DELETE", "");
          }
        })));
    return tr;
  }

  // Row id -> the tier an admin chose and has not moved to yet: a poll's redraw between the choice and Move (a
  // keyboard user tabs from the one to the other) drew the first tier again, and Move moved nowhere.
  const chosenTiers = new Map();
  function moveControl(row) {  // "move to tier": a labelled choice of tier and its button
    const choice = el("select", { "aria-label": "Tier for " + row.id,
                                  onchange: () => chosenTiers.set(row.id, choice.value) },
                      ...tierNames.map((name) => el("option", { value: name }, name)));
    if (chosenTiers.has(row.id)) choice.value = chosenTiers.get(row.id);
    const move = el("button", { type: "button", "aria-label": "Move " + row.id, onclick: () => {
      chosenTiers.delete(row.id);
      act(row.id, "POST", "/move", { tier: choice.value });
    } }, "Move");
    return el("span", { class: "move" }, choice, move);
  }

  async function act(id, method, suffix, body) {
    const label = suffix ? suffix.slice(1) : "delete";
    try {
      const updated = await api(method, "/conversations/" + encodeURIComponent(id) + suffix, body);
      pageLoads++;  // a poll's answer from before the action would draw the row as it was
      const old = document.querySelector('#conversations tr[data-id="' + CSS.escape(id) + '"]');
      if (old) {
        if (updated) { const fresh = rowOf(updated); old.replaceWith(fresh); fresh.querySelector("button").focus(); }
        else old.remove();
      }
      $("action-status").textContent = label + " " + id + ": done";
      const [tiers, history] = await Promise.all([api("GET", "/tiers"), api("GET", "/history")]);
      renderTiers(tiers, history.codecs);
      renderPlacement(tiers.placement, tiers.compression);
    } catch (e) {
      if (e instanceof Unauthorized) { showLogin("The admin API refused the token: " + e.message); return; }
      $("action-status").textContent = label + " " + id + " failed: " + e.message;
    }
  }

  async function showForecast() {
    const button = $("forecast-button");
    button.disabled = true;
    $("forecast-status").textContent = "Replaying the recent turns…";
    try {
      const forecast = await api("GET", "/forecast");
      const table = $("forecast");
      table.tBodies[0].replaceChildren(...forecast.rows.map((row) => el("tr",
        { "data-multiple": String(row.multiple), "data-hit-rate": row.hit_rate == null ? "" : String(row.hit_rate) },
        el("td", {}, "×" + row.multiple + " (" + Object.entries(row.tiers).map(([n, b]) => n + " " + fmtBytes(b)).join(", ") + ")"),
        el("td", {}, row.hit_rate == null ? "no resumed turns" : pct(row.hit_rate)),
        el("td", {}, String(row.recomputed_tokens)),
        el("td", {}, Math.round(row.first_token_ms_p50) + " ms"),
        el("td", {}, Math.round(row.first_token_ms_p95) + " ms"))));
      table.hidden = false;
      $("forecast-status").textContent = forecast.turns + " turns of " + forecast.conversations +
        " conversations replayed under the " + forecast.policy + " policy";
    } catch (e) {
      $("forecast-status").textContent = "Forecast failed: " + e.message;
      if (e instanceof Unauthorized) showLogin("The admin API refused the token: " + e.message);
    } finally {
      button.disabled = false;
    }
  }
  $("forecast-button").addEventListener("click", () => { showForecast(); });

  $("search").addEventListener("submit", (event) => {
    event.preventDefault();
    page = { prefix: $("prefix").value.trim(), after: "", next: null };
    loadPage({ force: true }).catch((e) => { $("action-status").textContent = "Search failed: " + e.message; });
  });
  $("first-page").addEventListener("click", () => { page.after = ""; loadPage({ force: true }).catch(() => {}); });
  $("next-page").addEventListener("click", () => {
    if (page.next) { page.after = page.next; loadPage({ force: true }).catch(() => {}); }
  });

  if (token) start(); else showLogin();
})();
