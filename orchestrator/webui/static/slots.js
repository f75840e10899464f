// slotserve chat page: the caller's conversations (slots) from GET /slots, and the slot actions
// save (save-state, downloaded), restore (restore-state, uploaded), fork and erase (POST /slots/{id}?action=...).
// The server answers with the caller's own slots only; this page never lists anything else.
"use strict";

import { call, slotAction } from "./api.js";

const $ = (id) => document.getElementById(id);
const FILE_FORMAT = "slotserve-webui-conversation";

let ctx = null; // { current(), open(id), messagesOf(id), setMessages(id, msgs), forget(id), status(text, isError) }

/** Wire the panel: `hooks` connects it to the chat (see `ctx` above). */
export function initSlots(hooks) {
  ctx = hooks;
  $("refresh-slots").addEventListener("click", () => refreshSlots());
  $("save").addEventListener("click", () => run("save", save));
  $("fork").addEventListener("click", () => run("fork", fork));
  $("erase").addEventListener("click", () => run("erase", erase));
  $("restore").addEventListener("click", () => run("restore", restore));
  $("restore-file").addEventListener("change", () => {
    const f = $("restore-file").files[0];
    if (f && !$("restore-target").value) $("restore-target").value = f.name.replace(/(\.slot)?\.(json|ses1|bin)$/, "");
  });
}

async function run(name, fn) {
  try {
    const text = await fn();
    if (text) ctx.status(text, false);
  } catch (e) {
    ctx.status(`${name} failed: ${e.message || e}`, true);
  }
  await refreshSlots();
}

/** Fetch `GET /slots` and redraw the list (llama-server's unused numbered slots are left out). */
export async function refreshSlots() {
  let slots;
  try {
    slots = await call("/slots");
  } catch (e) {
    ctx.status(`slot list: ${e.message || e}`, true);
    return;
  }
  const list = $("slots");
  list.textContent = "";
  const shown = slots.filter((s) => s.place !== "empty" || String(s.id) === ctx.current());
  for (const s of shown) {
    const id = String(s.id);
    const li = document.createElement("li");
    li.dataset.slot = id;
    li.dataset.tokens = String(s.n_tokens);
    if (id === ctx.current()) li.classList.add("current");
    const name = document.createElement("span");
    name.className = "slot-id";
    name.textContent = id;
    const meta = document.createElement("span");
    meta.className = "slot-meta";
    meta.textContent = `${s.n_tokens} tokens \u00b7 ${s.is_processing ? "generating" : s.place}` +
      (ctx.messagesOf(id) ? "" : " \u00b7 not from this tab");
    li.append(name, meta);
    li.addEventListener("click", () => ctx.open(id));
    list.appendChild(li);
  }
  $("no-slots").style.display = shown.length ? "none" : "";
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: "application/json" }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// The file is the `restore-state` JSON body (`state`, `digest`) with the page's messages beside it,
// so `curl -d @file "…/slots/ID?action=restore-state"` restores it too.
async function save() {
  const id = ctx.current();
  const res = await slotAction(id, "save-state");
  const file = { format: FILE_FORMAT, slot_id: id, n_tokens: res.n_tokens, messages: ctx.messagesOf(id) || [],
                 digest: res.digest, state: res.state };
  download(`${id}.slot.json`, JSON.stringify(file));
  return `saved ${JSON.stringify(id)}: ${res.n_tokens} tokens, ${res.n_bytes} bytes of state (${id}.slot.json)`;
}

async function restore() {
  const f = $("restore-file").files[0];
  const target = $("restore-target").value.trim();
  if (!f) throw new Error("choose a file saved by this page (.slot.json) or a SES1 state");
  if (!target) throw new Error("name the slot to restore into");
  const bytes = new Uint8Array(await f.arrayBuffer());
  let parsed = null;
  if (bytes[0] === 0x7b) { // "{": this page's file
    parsed = JSON.parse(new TextDecoder().decode(bytes));
    if (typeof parsed.state !== "string") throw new Error("this JSON file holds no slot state");
  }
  const res = parsed
    ? await slotAction(target, "restore-state", { state: parsed.state, digest: parsed.digest })
    : await slotAction(target, "restore-state", undefined, bytes);
  ctx.setMessages(target, parsed && Array.isArray(parsed.messages) && parsed.messages.length ? parsed.messages : null);
  await ctx.open(target);
  return `restored ${JSON.stringify(target)} from ${f.name}: ${res.n_bytes_read} bytes`;
}

async function fork() {
  const id = ctx.current();
  const target = $("fork-target").value.trim();
  if (!target) throw new Error("name the new slot (fork as)");
  const res = await slotAction(id, "fork", { target });
  ctx.setMessages(target, ctx.messagesOf(id));
  $("fork-target").value = "";
  await ctx.open(target);
  return `forked ${JSON.stringify(id)} as ${JSON.stringify(target)} (${res.n_tokens} tokens, copy-on-write)`;
}

async function erase() {
  const id = ctx.current();
  if (!confirm(`Erase ${id}? Its KV cache and stored state are deleted.`)) return "";
  const res = await slotAction(id, "erase");
  ctx.forget(id);
  return `erased ${JSON.stringify(id)} (${res.n_erased} tokens)`;
}
