// slotserve admin page: live slot listing, messages, actions and an attention heatmap.
// Data: GET /admin/events (server-sent events: "slots" on change, "attention" per generated token),
// GET /admin/api/slots/{id}/messages, and the slot API's POST /slots/{id}?action=... for actions.
"use strict";

const params = new URLSearchParams(location.search);
if (params.has("admin_key")) {
  sessionStorage.setItem("slotserve_admin_key", params.get("admin_key"));
  params.delete("admin_key");
  history.replaceState(null, "", location.pathname + (params.toString() ? "?" + params : ""));
}
const KEY = sessionStorage.getItem("slotserve_admin_key") || "";
const MAX_ROWS = 96;

const $ = (id) => document.getElementById(id);
const state = { slots: [], selected: null, selectedTokens: -1, messages: [], rows: [], rowSlot: null, source: null };

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (KEY) h["X-Admin-Key"] = KEY;
  return h;
}

async function api(path, opts) {
  const r = await fetch(path, Object.assign({}, opts, { headers: headers((opts || {}).headers) }));
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(`${r.status} ${body.error_code || ""}: ${body.error || r.statusText}`);
  return body;
}

function fmtBytes(n) {
  if (!n) return "0";
  const u = ["B", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function fmtIdle(s) {
  if (s === null || s === undefined) return "";
  if (s < 1) return "now";
  if (s < 120) return `${Math.round(s)} s ago`;
  if (s < 7200) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

const PLACE = { kv_cache: "KV cache", store: "parked (store)", leased: "leased elsewhere", empty: "empty" };

function renderSlots() {
  const tbody = $("slots").querySelector("tbody");
  tbody.textContent = "";
  for (const s of state.slots) {
    const tr = document.createElement("tr");
    tr.dataset.slot = s.id;
    if (s.id === state.selected) tr.classList.add("selected");
    const cells = [
      s.id,
      null,
      s.generating ? "generating" : "idle",
      s.n_tokens,
      s.n_messages === null ? "?" : s.n_messages,
      fmtBytes(s.state_bytes),
      fmtBytes(s.stored_bytes),
      s.generating ? "now" : fmtIdle(s.last_used === null ? null : Date.now() / 1000 - s.last_used),
      s.owner || "",
    ];
    cells.forEach((v, i) => {
      const td = document.createElement("td");
      if (i === 1) {
        const span = document.createElement("span");
        span.className = `place ${s.place}`;
        span.textContent = PLACE[s.place] || s.place;
        td.appendChild(span);
      } else {
        td.textContent = v;
      }
      if (i === 2 && s.generating) td.className = "gen";
      tr.appendChild(td);
    });
    tr.addEventListener("click", () => select(s.id));
    tbody.appendChild(tr);
  }
  $("empty").style.display = state.slots.length ? "none" : "";
}

function setResult(text, isError) {
  $("result").textContent = text;
  $("result").className = isError ? "err" : "";
}

function select(id) {
  state.selected = id;
  state.selectedTokens = -1;
  $("sel").textContent = id === null ? "(click a slot)" : JSON.stringify(id);
  for (const b of ["save", "erase", "shift", "fork"]) $(b).disabled = id === null;
  renderSlots();
  refreshMessages();
}

async function refreshMessages() {
  const id = state.selected;
  const box = $("messages");
  if (id === null) {
    box.textContent = "Select a slot to see its messages.";
    box.className = "muted";
    return;
  }
  const slot = state.slots.find((s) => s.id === id);
  if (slot && slot.generating) {
    box.textContent = "Generating: messages are shown when it is idle.";
    box.className = "muted";
    return;
  }
  try {
    const info = await api(`/admin/api/slots/${encodeURIComponent(id)}/messages`);
    if (state.selected !== id) return;
    state.selectedTokens = info.n_tokens;
    state.messages = info.messages;
    box.textContent = "";
    box.className = "";
    if (!info.messages.length) box.textContent = "(no tokens)";
    for (const m of info.messages) {
      const div = document.createElement("div");
      div.className = "msg";
      const head = document.createElement("div");
      head.className = "range";
      head.textContent = `message ${m.index}: tokens ${m.start}..${m.end}`;
      const pre = document.createElement("pre");
      pre.textContent = m.text;
      div.append(head, pre);
      box.appendChild(div);
    }
  } catch (e) {
    box.textContent = String(e.message || e);
    box.className = "muted";
  }
}

// A listed slot's id is `tenant/id` (a bare id for the default tenant): the slot API takes the
// tenant's own id and, from an admin, the tenant as `?tenant=`.
function slotAddress(key) {
  const s = state.slots.find((x) => x.id === key);
  const tenant = s && s.tenant ? s.tenant : "default";
  const bare = key.startsWith(tenant + "/") ? key.slice(tenant.length + 1) : key;
  return { tenant, bare };
}

async function action(name, body) {
  const id = state.selected;
  if (id === null) return;
  const { tenant, bare } = slotAddress(id);
  try {
    const q = `action=${name}&tenant=${encodeURIComponent(tenant)}`;
    const res = await api(`/slots/${encodeURIComponent(bare)}?${q}`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body || {}),
    });
    setResult(`${name}: ${JSON.stringify(res)}`, false);
    if (name === "erase") select(null);
    else refreshMessages();
  } catch (e) {
    setResult(`${name} failed: ${e.message || e}`, true);
  }
}

$("save").addEventListener("click", () => {
  const filename = $("filename").value.trim() || `slot-${slotAddress(state.selected).bare.replace(/[^A-Za-z0-9._-]/g, "_")}.bin`;
  action("save", { filename });
});
$("erase").addEventListener("click", () => {
  if (confirm(`Erase slot ${state.selected}? Its KV state and stored copy are deleted.`)) action("erase");
});
$("shift").addEventListener("click", () => {
  const from = parseInt($("from").value, 10), to = parseInt($("to").value, 10);
  const msgs = state.messages;
  if (!(from >= 0 && to >= from && to < msgs.length)) {
    setResult(`choose messages within 0..${msgs.length - 1}`, true);
    return;
  }
  const n_keep = msgs[from].start;
  action("context-shift", { n_keep, n_discard: msgs[to].end + 1 - n_keep });
});
$("fork").addEventListener("click", () => {
  const target = $("target").value.trim();
  if (!target) { setResult("give the new slot's id", true); return; }
  action("fork", { target });
});

// ---------------------------------------------------------------- heatmap

function color(v) {
  // 0 -> dark blue, 1 -> yellow-white (a perceptual-ish ramp without a library)
  const t = Math.max(0, Math.min(1, v));
  const r = Math.round(255 * Math.min(1, 1.8 * t));
  const g = Math.round(255 * Math.max(0, Math.min(1, 1.6 * t - 0.25)));
  const b = Math.round(90 + 120 * (1 - t) * t * 2);
  return [r, g, b];
}

function drawHeatmap() {
  const canvas = $("heatmap");
  const rows = state.rows;
  canvas.dataset.rows = String(rows.length);
  // one pixel row per generated token (newest at the bottom once full), one column per context position
  const width = Math.max(1, ...rows.map((r) => r.values.length));
  canvas.width = width;
  canvas.height = MAX_ROWS;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(width, canvas.height);
  for (let o = 0; o < img.data.length; o += 4) { img.data[o] = 16; img.data[o + 1] = 19; img.data[o + 2] = 26; img.data[o + 3] = 255; }
  rows.forEach((row, y) => {
    let max = 0;
    for (const v of row.values) max = Math.max(max, v);
    for (let x = 0; x < row.values.length; x++) {
      const [r, g, b] = color(max > 0 ? Math.sqrt(row.values[x] / max) : 0);
      const o = 4 * (y * width + x);
      img.data[o] = r; img.data[o + 1] = g; img.data[o + 2] = b; img.data[o + 3] = 255;
    }
  });
  ctx.putImageData(img, 0, 0);
}

function onAttention(ev) {
  if (state.selected !== null && ev.slot_id !== state.selected && state.slots.some((s) => s.id === state.selected && s.generating)) return;
  if (ev.slot_id !== state.rowSlot) {
    state.rows = [];
    state.rowSlot = ev.slot_id;
    $("hm-slot").textContent = `slot ${JSON.stringify(ev.slot_id)}`;
  }
  const bytes = Uint8Array.from(atob(ev.data), (c) => c.charCodeAt(0));
  state.rows.push({ index: ev.index, values: new Float32Array(bytes.buffer) });
  if (state.rows.length > MAX_ROWS) state.rows.shift();
  $("hm-info").textContent = `token ${ev.index} ${JSON.stringify(ev.text)} over ${ev.n_ctx} positions` +
    (ev.layer === null ? " (mean of all layers and heads)" : ` (layer ${ev.layer}, mean of heads)`);
  drawHeatmap();
}

// ---------------------------------------------------------------- live stream

function connect() {
  if (state.source) state.source.close();
  const q = new URLSearchParams();
  if (KEY) q.set("admin_key", KEY);
  if ($("layer").value !== "") q.set("layer", $("layer").value);
  const src = new EventSource(`/admin/events?${q}`);
  state.source = src;
  src.onopen = () => { $("conn").textContent = "live"; $("conn").className = "live"; };
  src.onerror = () => { $("conn").textContent = "reconnecting"; $("conn").className = "down"; };
  src.onmessage = (m) => {
    const ev = JSON.parse(m.data);
    if (ev.type === "slots") {
      $("node").textContent = ev.node || "(no store)";
      state.slots = ev.slots;
      const sel = state.slots.find((s) => s.id === state.selected);
      if (state.selected !== null && !sel) select(null);
      renderSlots();
      if (sel && !sel.generating && sel.n_tokens !== state.selectedTokens) refreshMessages();
    } else if (ev.type === "attention") {
      onAttention(ev);
    } else if (ev.type === "error") {
      setResult(`listing: ${ev.error_code}: ${ev.error}`, true);
    }
  };
}

async function init() {
  try {
    const model = await api("/api/v1/model");
    for (let i = 0; i < model.num_layers; i++) {
      const o = document.createElement("option");
      o.value = String(i);
      o.textContent = `layer ${i}`;
      $("layer").appendChild(o);
    }
  } catch (e) {
    setResult(`model info: ${e.message || e}`, true);
  }
  $("layer").addEventListener("change", () => { state.rows = []; drawHeatmap(); connect(); });
  connect();
}

init();
setInterval(renderSlots, 5000); // "x s ago" ages locally; nothing is fetched
