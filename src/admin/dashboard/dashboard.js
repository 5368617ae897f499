// fencegate dashboard: polls the admin listener's small JSON reads and
// renders them. Everything shown comes from clients (keys, paths, lock
// names), so it is only ever set as text, never as markup.
"use strict";

(function () {
  const POLL_MS = 1000;        // routes, refusals, instance
  const SLOW_EVERY = 2;        // readiness and locks every second poll
  const HIDDEN_POLL_MS = 5000; // a background tab polls less
  const TIMEOUT_MS = 3000;
  const HISTORY = 60;          // sparkline samples per route
  const SHOWN_REFUSALS = 50;
  const FRESH_MS = 5000;       // how long a new refusal stays highlighted
  const LOCKS_PAGE = 200;

  const $ = (id) => document.getElementById(id);
  const state = {
    polls: 0,
    lastSeq: 0,
    refusals: [],
    prev: new Map(),    // route name -> {t, fenced, refused}
    history: new Map(), // route name -> [writes per second]
    locks: null,        // {at, items, next} or {disabled: true}
    lastOk: null,
  };

  // --- helpers -------------------------------------------------------

  async function api(path) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), TIMEOUT_MS);
    try {
      // Relative: the page works behind a proxy that serves it under a
      // prefix (kubectl port-forward, a path-routing ingress).
      const r = await fetch(path, { cache: "no-store", signal: ctl.signal });
      let body = null;
      try { body = await r.json(); } catch (_) { body = null; }
      return { status: r.status, body };
    } finally {
      clearTimeout(timer);
    }
  }

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  function cell(label, text, cls) {
    const td = el("td", text, cls);
    td.dataset.label = label;
    return td;
  }

  function fmtCount(n) {
    return n === undefined || n === null ? "–" : Number(n).toLocaleString("en-US");
  }

  function fmtRate(r) {
    if (r === null || r === undefined || !isFinite(r)) return "–";
    return r < 10 ? r.toFixed(1) : Math.round(r).toLocaleString("en-US");
  }

  function fmtTime(iso) {
    const d = new Date(iso);
    return isNaN(d) ? String(iso) : d.toLocaleTimeString([], { hour12: false });
  }

  function fmtAgo(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }

  function fmtLeft(ms) {
    if (ms <= 0) return "expiring";
    if (ms < 10000) return (ms / 1000).toFixed(1) + " s";
    return fmtAgo(ms);
  }

  function sum(obj, skip) {
    let n = 0;
    for (const [k, v] of Object.entries(obj || {})) if (k !== skip) n += v;
    return n;
  }

  function sparkline(values) {
    const NS = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("class", "spark");
    svg.setAttribute("viewBox", "0 0 120 26");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("aria-hidden", "true");
    const max = Math.max(1, ...values);
    const step = 120 / (HISTORY - 1);
    const offset = HISTORY - values.length;
    const pts = values.map((v, i) => ((offset + i) * step).toFixed(1) + "," + (24 - (v / max) * 22).toFixed(1));
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", pts.join(" "));
    svg.appendChild(line);
    return svg;
  }

  // --- sections ------------------------------------------------------

  function renderInstance(b) {
    $("version").textContent = "v" + b.version;
    const locks = b.locks.enabled ? "locks on " + b.locks.backend : "lock API off";
    $("instance").textContent =
      "store: " + b.store.backend + ", " + b.store.mode + " mode · " + locks +
      " · up " + fmtAgo(b.uptime_s * 1000) + " · started " + new Date(b.started_at).toLocaleString();
    $("t-gate").textContent = fmtCount(b.gate_keys);
    // Failed: a config with problems, or one refused for changing a
    // fenced route's key identity.
    const failed = b.config_reloads.error + b.config_reloads.refused;
    $("t-reloads").textContent = fmtCount(b.config_reloads.ok) + " / " + fmtCount(failed);
    $("t-reloads").classList.toggle("bad", failed > 0);
  }

  function renderRoutes(b, now) {
    const body = $("routes").querySelector("tbody");
    body.replaceChildren();
    $("routes-empty").hidden = b.routes.length > 0;
    let writes = 0, refused = 0, stale = 0, upstream = 0, rated = false;
    for (const r of b.routes) {
      const d = r.counts.decisions || {};
      const fenced = sum(d);
      const notForwarded = fenced - (d.forwarded || 0) - (d.replayed || 0);
      const errors = sum(r.counts.upstream_errors);
      stale += d.stale || 0;
      upstream += errors;
      const prev = state.prev.get(r.name);
      let rate = null;
      if (prev && now > prev.t) {
        const dt = (now - prev.t) / 1000;
        rate = Math.max(0, (fenced - prev.fenced) / dt);
        writes += rate;
        refused += Math.max(0, (notForwarded - prev.refused) / dt);
        rated = true;
        const h = state.history.get(r.name) || [];
        h.push(rate);
        while (h.length > HISTORY) h.shift();
        state.history.set(r.name, h);
      }
      state.prev.set(r.name, { t: now, fenced, refused: notForwarded });

      const tr = document.createElement("tr");
      tr.dataset.route = r.name;
      const name = cell("Route", null);
      name.appendChild(el("strong", r.name));
      name.appendChild(el("div", r.path + " · " + r.methods.join(", ") + " · token " + r.token, "muted mono"));
      tr.appendChild(name);
      tr.appendChild(cell("Upstream", r.upstream, "mono"));
      tr.appendChild(cell("Writes / s", fmtRate(rate), "num rate"));
      tr.appendChild(cell("Forwarded", fmtCount(d.forwarded || 0), "num forwarded"));
      tr.appendChild(cell("Stale", fmtCount(d.stale || 0), "num stale" + (d.stale ? " bad" : "")));
      const other = notForwarded - (d.stale || 0);
      const otherCell = cell("Other refusals", fmtCount(other), "num");
      otherCell.title = Object.entries(d)
        .filter(([k]) => k !== "forwarded" && k !== "stale" && k !== "replayed")
        .map(([k, v]) => k + ": " + v).join("\n") || "none";
      tr.appendChild(otherCell);
      tr.appendChild(cell("Pass-through", fmtCount(r.counts.passthrough), "num"));
      tr.appendChild(cell("Upstream errors", fmtCount(errors), "num" + (errors ? " bad" : "")));
      const held = sum(r.counts.held_keys);
      const heldCell = cell("Held keys", fmtCount(held), "num held" + (held ? " bad" : ""));
      heldCell.title = Object.entries(r.counts.held_keys || {})
        .map(([k, v]) => k + ": " + v).join("\n") || "none";
      tr.appendChild(heldCell);
      const spark = cell("Last minute", null);
      spark.appendChild(sparkline(state.history.get(r.name) || []));
      tr.appendChild(spark);
      body.appendChild(tr);
    }
    $("t-writes").textContent = rated ? fmtRate(writes) : "–";
    $("t-refused").textContent = rated ? fmtRate(refused) : "–";
    $("t-refused").classList.toggle("bad", refused > 0);
    $("t-stale").textContent = fmtCount(stale);
    $("t-upstream").textContent = fmtCount(upstream);
    $("t-upstream").classList.toggle("bad", upstream > 0);
  }

  function keyLink(key) {
    const a = el("a", key, "mono");
    a.href = "#fence";
    a.title = "Look up this key's fence";
    a.addEventListener("click", (ev) => {
      ev.preventDefault();
      $("fence-key").value = key;
      lookUp(key);
    });
    return a;
  }

  // Answers whether anything changed.
  function mergeRefusals(b) {
    let changed = false;
    if (b.last_seq < state.lastSeq) {
      // A restarted process numbers from 1 again.
      state.refusals = [];
      changed = true;
    }
    const now = Date.now();
    for (const r of b.refusals.slice().reverse()) {
      r.seenAt = now;
      state.refusals.unshift(r);
      changed = true;
    }
    state.refusals.length = Math.min(state.refusals.length, SHOWN_REFUSALS);
    state.lastSeq = b.last_seq;
    return changed;
  }

  // Rebuilt only when refusals arrive, so a click on a key is not lost to
  // a redraw; the highlight of new rows fades on a timer.
  function renderRefusals() {
    const body = $("refusals").querySelector("tbody");
    body.replaceChildren();
    $("refusals-empty").hidden = state.refusals.length > 0;
    const now = Date.now();
    for (const r of state.refusals) {
      const tr = document.createElement("tr");
      tr.dataset.seq = r.seq;
      tr.dataset.outcome = r.outcome;
      if (now - r.seenAt < FRESH_MS) {
        tr.className = "fresh";
        setTimeout(() => tr.classList.remove("fresh"), FRESH_MS - (now - r.seenAt));
      }
      tr.appendChild(cell("When", fmtTime(r.at)));
      const o = cell("Outcome", null);
      o.appendChild(el("span", r.outcome.replace("_", " ") + " · " + r.status, "badge badge-" + r.outcome));
      tr.appendChild(o);
      tr.appendChild(cell("Route", r.route || "(none)"));
      const k = cell("Key or path", null, "key");
      if (r.resource_key) k.appendChild(keyLink(r.resource_key));
      else k.appendChild(el("span", (r.method ? r.method + " " : "") + (r.path || ""), "mono"));
      tr.appendChild(k);
      tr.appendChild(cell("Token", r.presented_token ?? "–", "num presented"));
      const highest = r.highest_token ?? (r.highest_issued !== null && r.highest_issued !== undefined ? "issued " + r.highest_issued : "–");
      tr.appendChild(cell("Highest", highest, "num highest"));
      tr.appendChild(cell("Why", r.detail, "muted"));
      body.appendChild(tr);
    }
  }

  // Rebuilt when a listing arrives; the time left counts down in place.
  function renderLocks() {
    const body = $("locks").querySelector("tbody");
    body.replaceChildren();
    const note = $("locks-note");
    const l = state.locks;
    if (!l) return;
    if (l.disabled) {
      note.textContent = "The lock API is disabled ([locks] enabled = false).";
      note.hidden = false;
      return;
    }
    if (l.error) {
      note.textContent = l.error;
      note.hidden = false;
      return;
    }
    const held = l.items.filter((x) => x.held);
    for (const x of held) {
      const tr = document.createElement("tr");
      tr.dataset.lock = x.name;
      const n = cell("Lock", null);
      n.appendChild(keyLink(x.name));
      tr.appendChild(n);
      tr.appendChild(cell("Fence", x.fence, "num"));
      const left = cell("Time left", "–", "num left");
      if (x.expires_in_ms !== null) left.dataset.until = String(l.at + x.expires_in_ms);
      tr.appendChild(left);
      body.appendChild(tr);
    }
    const more = l.next ? " (first " + l.items.length + " names; narrow with a prefix)" : "";
    note.textContent = held.length
      ? held.length + " held of " + l.items.length + " names" + more + "."
      : "No lock is held" + (l.items.length ? " (" + l.items.length + " names known" + more + ")." : ".");
    note.hidden = false;
    countDown();
  }

  function countDown() {
    const now = Date.now();
    for (const td of $("locks").querySelectorAll("td.left[data-until]")) {
      td.textContent = fmtLeft(Number(td.dataset.until) - now);
    }
  }

  async function lookUp(key) {
    const out = $("fence-result");
    out.replaceChildren(el("p", "Looking up…", "muted"));
    let r;
    try {
      r = await api("fences/" + encodeURIComponent(key));
    } catch (e) {
      out.replaceChildren(el("p", "The admin listener did not answer.", "bad"));
      return;
    }
    out.replaceChildren();
    out.dataset.key = key;
    if (r.status === 200 && r.body) {
      const dl = document.createElement("dl");
      const row = (k, v, cls) => { dl.appendChild(el("dt", k)); dl.appendChild(el("dd", v, cls)); };
      row("Key", r.body.resource_key, "mono");
      row("Highest token", r.body.highest_token, "big highest-token");
      row("Updated", new Date(r.body.updated_at).toLocaleString());
      const reset = r.body.last_reset;
      if (reset) {
        row("Last reset", new Date(reset.at).toLocaleString() + " by " + reset.by +
          ": " + (reset.from ?? "none") + " → " + reset.to + " (" + reset.reason + ")");
      }
      out.appendChild(dl);
      out.dataset.found = "yes";
    } else if (r.status === 404) {
      out.appendChild(el("p", "No token has been recorded for " + key + "."));
      out.dataset.found = "no";
    } else {
      out.appendChild(el("p", (r.body && r.body.detail) || "Error " + r.status, "bad"));
      out.dataset.found = "error";
    }
  }

  // --- the loop ------------------------------------------------------

  async function poll() {
    const slow = state.polls % SLOW_EVERY === 0;
    state.polls += 1;
    const prefix = $("locks-prefix").value;
    const calls = [
      api("instance"),
      api("routes"),
      api("refusals?after=" + state.lastSeq + "&limit=" + SHOWN_REFUSALS),
      slow ? api("readyz") : null,
      slow ? api("locks?limit=" + LOCKS_PAGE + (prefix ? "&prefix=" + encodeURIComponent(prefix) : "")) : null,
    ];
    const [inst, routes, refusals, ready, locks] = await Promise.allSettled(calls.map((c) => c || Promise.resolve(null)));
    const now = Date.now();
    const ok = (x) => x.status === "fulfilled" && x.value && x.value.status === 200 && x.value.body;
    const reached = inst.status === "fulfilled" && routes.status === "fulfilled";
    $("offline").hidden = reached;

    if (ok(inst)) renderInstance(inst.value.body);
    if (ok(routes)) renderRoutes(routes.value.body, now);
    if (ok(refusals) && mergeRefusals(refusals.value.body)) renderRefusals();

    if (ready.status === "fulfilled" && ready.value) {
      const pill = $("ready");
      const isReady = ready.value.status === 200;
      pill.textContent = isReady ? "ready" : "not ready";
      pill.className = "pill " + (isReady ? "pill-ok" : "pill-bad");
      const banner = $("not-ready");
      banner.hidden = isReady;
      banner.textContent = isReady ? "" :
        "Not ready: " + ((ready.value.body && ready.value.body.detail) || "status " + ready.value.status) +
        ". Fenced writes answer 503 while the store cannot be reached.";
    } else if (ready.status === "rejected") {
      $("ready").textContent = "unreachable";
      $("ready").className = "pill pill-bad";
    }

    if (locks.status === "fulfilled" && locks.value) {
      const v = locks.value;
      if (v.status === 200 && v.body) state.locks = { at: now, items: v.body.locks, next: v.body.next };
      else if (v.status === 404) state.locks = { disabled: true };
      else state.locks = { error: (v.body && v.body.detail) || "Locks could not be listed (" + v.status + ")." };
      renderLocks();
    }

    if (reached && ok(inst) && ok(routes)) {
      state.lastOk = now;
      document.body.dataset.live = "yes";
    }
    $("updated").textContent = state.lastOk
      ? "updated " + new Date(state.lastOk).toLocaleTimeString([], { hour12: false })
      : "connecting…";
    setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  function start() {
    $("fence-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("fence-key").value.trim();
      if (key) lookUp(key);
    });
    $("locks-filter").addEventListener("submit", (ev) => ev.preventDefault());
    setInterval(countDown, 250);
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
