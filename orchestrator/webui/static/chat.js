// slotserve chat page: chat with the served model, each reply token's attention over its context, and the
// caller's conversations (slots). Every call is the public API's (api.js); nothing here is privileged.
// A turn: the messages go through the model's chat template (POST /apply-template, llama-server's), the
// prompt is tokenized with pieces (POST /api/v1/tokenize), and the ids stream on the binary WebSocket with
// the conversation's slot id, so the slot keeps its KV cache and the next turn prefills only what is new.
"use strict";

import { apiKey, call, generate, setApiKey, slotAction } from "./api.js";
import { GRADIENT, layoutTokens, paint, rowOf } from "./heatmap.js";
import { initSlots, refreshSlots } from "./slots.js";

const $ = (id) => document.getElementById(id);
const CHATS_ITEM = "slotserve.webui.chats";
const CURRENT_ITEM = "slotserve.webui.current";

const state = {
  model: null,
  chats: JSON.parse(sessionStorage.getItem(CHATS_ITEM) || "{}"), // slot id -> messages ([{role, content}])
  current: sessionStorage.getItem(CURRENT_ITEM),
  raw: null, // the text of an open slot this tab did not start (no messages known)
  turn: null, // the latest reply: { tokens, nPrompt, rows: [{data, shape}], held: {layer}, pending: {user, reply} }
  pick: { layer: null, head: null },
  selected: null, // generated token index the user clicked; null: follow the newest
  stream: null,
  painted: false,
};

function status(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "err" : "";
}

function saveChats() {
  sessionStorage.setItem(CHATS_ITEM, JSON.stringify(state.chats));
  if (state.current === null) sessionStorage.removeItem(CURRENT_ITEM);
  else sessionStorage.setItem(CURRENT_ITEM, state.current);
}

function newSlotId() {
  const bytes = crypto.getRandomValues(new Uint8Array(4));
  return "chat-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

// ------------------------------------------------------------------ transcript

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  div.append(who, body);
  return div;
}

function renderTranscript() {
  const box = $("transcript");
  box.textContent = "";
  $("chat-slot").textContent = state.current === null ? "(new)" : state.current;
  $("actions").classList.toggle("disabled", state.current === null);
  for (const m of state.chats[state.current] || []) box.appendChild(bubble(m.role, m.content));
  if (state.raw !== null) {
    const ctxBox = bubble("context", state.raw);
    ctxBox.title = "this slot's cached text; it was not started in this tab";
    box.appendChild(ctxBox);
  }
  const p = state.turn && state.turn.pending;
  if (p) {
    box.appendChild(bubble("user", p.user));
    const reply = bubble("assistant", p.reply);
    reply.id = "streaming";
    box.appendChild(reply);
  }
  if (!box.children.length) box.innerHTML = '<p class="muted">Say something to the model.</p>';
  box.scrollTop = box.scrollHeight;
  for (const li of $("slots").children) li.classList.toggle("current", li.dataset.slot === state.current);
}

/** Open conversation `id` (a slot): its messages if this tab holds them, else the slot's text. */
async function open(id) {
  if (state.stream) return;
  state.current = id;
  state.turn = null;
  state.selected = null;
  state.raw = null;
  saveChats();
  if (id !== null && !state.chats[id]) {
    try {
      const t = await slotAction(id, "tokens");
      state.raw = t.n_tokens ? (await call("/api/v1/detokenize", { token_ids: t.tokens })).text : null;
    } catch (e) {
      status(`open ${id}: ${e.message || e}`, true);
    }
  }
  renderTranscript();
  schedulePaint();
}

// ------------------------------------------------------------------ attention view

function describe(layer, head) {
  if (layer === null) return "mean over all layers and heads";
  return head === null ? `layer ${layer}, mean over its heads` : `layer ${layer}, head ${head}`;
}

function schedulePaint() {
  if (state.painted) return;
  state.painted = true;
  requestAnimationFrame(() => { state.painted = false; paintAttention(); });
}

function paintAttention() {
  const el = $("context");
  const legend = { max: $("legend-max"), note: $("legend-note") };
  const turn = state.turn;
  if (!turn) {
    el.textContent = "";
    paint(el, null, legend);
    $("att-info").textContent = state.model && !state.model.attention_layers.length
      ? "This model has no attention layers."
      : "Send a message: each token of the reply is shown with its attention over the context.";
    return;
  }
  layoutTokens(el, turn.tokens, turn.nPrompt);
  const k = state.selected !== null ? state.selected : turn.rows.length - 1;
  if (k < 0) {
    paint(el, null, legend);
    el.dataset.token = "";
    $("att-info").textContent = turn.progress || "waiting for the first token";
    return;
  }
  const entry = turn.rows[k];
  const same = state.pick.layer === turn.held.layer;
  const head = same ? state.pick.head : null;
  const row = rowOf(entry, head);
  paint(el, row, legend);
  el.dataset.token = String(k);
  el.dataset.layer = turn.held.layer === null ? "" : String(turn.held.layer);
  el.dataset.head = head === null ? "" : String(head);
  const text = turn.tokens[turn.nPrompt + k].text;
  $("att-info").textContent = `reply token ${k} ${JSON.stringify(text)}: attention over ${row.length} positions, ` +
    describe(turn.held.layer, head) + (state.selected === null ? " (following the newest token; click a reply token to pick one)" : "") +
    (same ? "" : `. This reply was streamed as ${describe(turn.held.layer, null)}: the pick applies to the next reply`);
  if (state.selected === null && state.stream) {
    const sel = el.querySelector(".tok.selected");
    if (sel) sel.scrollIntoView({ block: "nearest" });
  }
}

function onContextClick(e) {
  const span = e.target.closest(".tok.gen");
  if (!span || !state.turn) return;
  const k = Number(span.dataset.k);
  if (k >= state.turn.rows.length) return;
  state.selected = state.selected === k ? null : k;
  schedulePaint();
}

// ------------------------------------------------------------------ a turn

function isSpecial(id, text) {
  const m = state.model;
  return m.eog_token_ids.includes(id) || id === m.bos_token_id || /^<\|.*\|>$/.test(text);
}

async function send(text) {
  const m = state.model;
  if (!m) { status("the model is not known yet (API key?)", true); return; }
  if (state.current === null) state.current = newSlotId();
  state.raw = null; // a slot this tab did not start: the conversation starts over in it (its cached prefix is reused)
  const id = state.current;
  const messages = [...(state.chats[id] || []), { role: "user", content: text }];
  const prompt = (await call("/apply-template", { messages })).prompt;
  const bos = String((m.special_tokens || {}).bos_token || "");
  const tok = await call("/api/v1/tokenize", {
    text: prompt, add_special_tokens: !(bos && prompt.startsWith(bos)), with_pieces: true,
  });
  const room = m.context_length - tok.token_count;
  if (room < 1) throw new Error(`the conversation has ${tok.token_count} tokens: the window (${m.context_length}) is full; start a new one`);
  const maxTokens = Math.min(room, Math.max(1, Number($("max-tokens").value) || 128));
  const attention = m.attention_layers.length > 0;
  const config = {
    input_ids: tok.token_ids, max_new_tokens: maxTokens, temperature: Number($("temperature").value),
    conversation_id: id, wait: true, return_progress: true, request_id: `webui-${Date.now()}`,
    output_attentions: attention, attention_dtype: "float32",
    attention_format: state.pick.layer === null ? "aggregated" : "per_layer",
  };
  if (state.pick.layer !== null) config.attention_layers = [state.pick.layer];
  const tokens = tok.tokens.map((t) => ({ token_id: t.token_id, text: t.text, special: isSpecial(t.token_id, t.text) }));
  state.turn = { tokens, nPrompt: tokens.length, rows: [], held: { layer: state.pick.layer },
                 pending: { user: text, reply: "" }, bytes: [], progress: "" };
  state.selected = null;
  state.chats[id] = state.chats[id] || [];
  saveChats();
  renderTranscript();
  schedulePaint();
  const turn = state.turn;
  const encoder = new TextEncoder();
  await new Promise((resolve) => {
    state.stream = generate(config, {
      onToken(ev, data) {
        turn.tokens.push({ token_id: ev.token_id, text: ev.text, special: isSpecial(ev.token_id, ev.text) });
        if (data) turn.rows.push({ data, shape: ev.shape });
        for (const b of ev.bytes || encoder.encode(ev.text)) turn.bytes.push(b);
        turn.pending.reply = new TextDecoder().decode(new Uint8Array(turn.bytes));
        const s = $("streaming");
        if (s) s.lastChild.textContent = turn.pending.reply;
        schedulePaint();
      },
      onEvent(ev) {
        if (ev.type === "queued") turn.progress = `waiting for an engine sequence (position ${ev.position})`;
        if (ev.type === "progress") {
          const p = ev.prompt_progress;
          turn.progress = `prefill: ${p.processed} of ${p.total} prompt tokens (${p.cache} cached)`;
        }
        status(turn.progress, false);
        schedulePaint();
      },
      onDone(ev) {
        state.chats[id] = [...messages, { role: "assistant", content: turn.pending.reply }];
        turn.pending = null;
        saveChats();
        status(`${ev.finish_reason}: ${ev.total_tokens} tokens in ${Math.round(ev.generation_time_ms)} ms; ` +
               `${ev.cached_tokens} of ${ev.prompt_tokens} prompt tokens from the slot's cache`, false);
        resolve();
      },
      onError(err) {
        turn.pending = null;
        state.turn = turn.rows.length ? turn : null;
        $("message").value = $("message").value || text;
        status(`generation failed: ${err.message || err}`, true);
        resolve();
      },
    });
  });
  state.stream = null;
  renderTranscript();
  schedulePaint();
}

// ------------------------------------------------------------------ start-up

function fillPickers() {
  const m = state.model;
  const layer = $("layer"), head = $("head");
  layer.length = 1;
  head.length = 1;
  for (const l of m.attention_layers) layer.add(new Option(`layer ${l}`, String(l)));
  for (let h = 0; h < m.num_attention_heads; h++) head.add(new Option(`head ${h}`, String(h)));
  layer.disabled = !m.attention_layers.length;
  head.disabled = true;
}

async function loadModel() {
  try {
    state.model = await call("/api/v1/model");
  } catch (e) {
    state.model = null;
    status(e.status === 401 ? "this server needs an API key: type it above" : `model: ${e.message || e}`, true);
    return false;
  }
  const m = state.model;
  $("model").textContent = `${m.model_name || m.result} \u00b7 ${m.num_layers} layers \u00b7 ${m.num_attention_heads} heads \u00b7 window ${m.context_length}`;
  fillPickers();
  status("ready", false);
  return true;
}

async function start() {
  if (await loadModel()) await refreshSlots();
  await open(state.current);
}

function wire() {
  $("legend-bar").style.background = GRADIENT;
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    setApiKey($("api-key").value.trim());
    start();
  });
  $("composer").addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = $("message").value.trim();
    if (!text || state.stream) return;
    $("message").value = "";
    $("send").disabled = true;
    $("stop").disabled = false;
    try {
      await send(text);
    } catch (err) {
      $("message").value = text;
      status(`${err.message || err}`, true);
    }
    $("send").disabled = false;
    $("stop").disabled = true;
    await refreshSlots();
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.stream && state.stream.cancel());
  $("new-chat").addEventListener("click", () => open(null));
  $("context").addEventListener("click", onContextClick);
  $("layer").addEventListener("change", () => {
    state.pick.layer = $("layer").value === "" ? null : Number($("layer").value);
    $("head").disabled = state.pick.layer === null;
    if (state.pick.layer === null) $("head").value = "";
    state.pick.head = $("head").value === "" ? null : Number($("head").value);
    schedulePaint();
  });
  $("head").addEventListener("change", () => {
    state.pick.head = $("head").value === "" ? null : Number($("head").value);
    schedulePaint();
  });
  initSlots({
    current: () => state.current,
    open,
    messagesOf: (id) => state.chats[id] || null,
    setMessages(id, msgs) {
      if (msgs) state.chats[id] = msgs.map((m) => ({ role: m.role, content: m.content }));
      else delete state.chats[id];
      saveChats();
    },
    forget(id) {
      delete state.chats[id];
      if (state.current === id) open(null);
      saveChats();
    },
    status,
  });
}

wire();
start();
