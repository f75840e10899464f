// slotserve chat page: the public API as a browser client calls it (docs/api.md).
// HTTP: Authorization: Bearer KEY; WebSocket: ?api_key=KEY (browsers cannot set its headers).
// The key lives in this tab's sessionStorage only.
"use strict";

const KEY_ITEM = "slotserve.webui.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

/** An API refusal: HTTP status, `error_code` and message, from either error shape of docs/api.md
 * (`{"error": "...", "error_code"}` or llama-server's `{"error": {"message", ...}, "error_code"}`). */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(`${status ? status + " " : ""}${code}: ${message}`);
    this.status = status;
    this.code = code;
  }
}

function errorOf(status, body, fallback) {
  const err = body && body.error;
  const message = typeof err === "string" ? err : (err && err.message) || fallback;
  return new ApiError(status, (body && body.error_code) || "ERROR", message);
}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

/** POST (or GET without `body`) `path`, JSON in and out; throws ApiError on a 4xx/5xx. */
export async function call(path, body, extraHeaders) {
  const opts = { headers: headers(extraHeaders) };
  if (body !== undefined) {
    opts.method = "POST";
    opts.headers["Content-Type"] = "application/json";
    opts.body = typeof body === "string" ? body : JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  const parsed = await r.json().catch(() => null);
  if (!r.ok) throw errorOf(r.status, parsed, r.statusText);
  return parsed;
}

/** `POST /slots/{id}?action=...` with a JSON body (or raw bytes when `bytes` is given). */
export async function slotAction(id, action, body, bytes) {
  const path = `/slots/${encodeURIComponent(id)}?action=${action}`;
  if (bytes === undefined) return call(path, body || {});
  const r = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/octet-stream" }),
    body: bytes,
  });
  const parsed = await r.json().catch(() => null);
  if (!r.ok) throw errorOf(r.status, parsed, r.statusText);
  return parsed;
}

/**
 * One generation on the binary WebSocket `/api/extra/generate/stream/ws` (docs/api.md): `config` is the
 * GenerateRequest; per token a JSON text frame and, with attention, a binary frame of little-endian
 * `float32` values of the text frame's `shape` (`[context_length]` aggregated, `[L, H, context_length]`
 * per layer). Handlers: onToken(frame, Float32Array|null), onEvent(frame) for queued/progress,
 * onDone(frame), onError(Error). Returns { cancel() }.
 */
export function generate(config, handlers) {
  const proto = location.protocol === "https:" ? "wss" : "ws";
  const q = apiKey() ? `?api_key=${encodeURIComponent(apiKey())}` : "";
  const ws = new WebSocket(`${proto}://${location.host}/api/extra/generate/stream/ws${q}`);
  ws.binaryType = "arraybuffer";
  let pending = null; // a token frame waiting for its binary attention frame
  let finished = false;
  const finish = (fn, arg) => {
    if (finished) return;
    finished = true;
    fn(arg);
  };
  ws.onopen = () => ws.send(JSON.stringify(config));
  ws.onmessage = (m) => {
    if (typeof m.data !== "string") {
      if (pending) handlers.onToken(pending, new Float32Array(m.data));
      pending = null;
      return;
    }
    const ev = JSON.parse(m.data);
    if (pending) { handlers.onToken(pending, null); pending = null; }
    if (ev.type === "token") {
      if (ev.shape) pending = ev;
      else handlers.onToken(ev, null);
    } else if (ev.type === "done") {
      finish(handlers.onDone, ev);
    } else if (ev.type === "error") {
      finish(handlers.onError, new ApiError(0, ev.error_code, ev.error));
    } else {
      handlers.onEvent(ev);
    }
  };
  ws.onerror = () => finish(handlers.onError, new Error("the WebSocket failed"));
  ws.onclose = (e) => finish(handlers.onError, new Error(`the WebSocket closed (${e.code}) before the end`));
  return {
    cancel() {
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "cancel" }));
    },
  };
}
