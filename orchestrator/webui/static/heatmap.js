// slotserve chat page: one generated token's attention over its context, as colours on the context's tokens.
// A row of generated token k covers positions 0 .. nPrompt+k-1 (docs/api.md, "Attention"): the prompt and the
// tokens generated before k. Each position's span carries its weight in `data-w` (the float32 value received).
"use strict";

// white -> yellow -> orange -> red -> dark red, at t = 0, .25, .5, .75, 1
const STOPS = [[255, 255, 255], [255, 237, 160], [254, 178, 76], [240, 59, 32], [150, 0, 40]];

/** The colour of `t` in [0, 1] as an `rgb()` string. */
export function colour(t) {
  const x = Math.max(0, Math.min(1, t)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(x));
  const f = x - i;
  const c = STOPS[i].map((v, j) => Math.round(v + f * (STOPS[i + 1][j] - v)));
  return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
}

export const GRADIENT = `linear-gradient(to right, ${STOPS.map((c) => `rgb(${c.join(",")})`).join(", ")})`;

/**
 * The row to show for one generated token: `entry.data` is what the stream sent (Float32Array),
 * `entry.shape` its shape: `[ctx]` (aggregated: mean over layers and heads) or `[1, H, ctx]`
 * (per_layer, one layer requested); `head` null means the mean over the layer's heads.
 */
export function rowOf(entry, head) {
  if (entry.shape.length === 1) return entry.data;
  const [, nHead, ctx] = entry.shape;
  if (head !== null && head !== undefined) return entry.data.subarray(head * ctx, (head + 1) * ctx);
  const out = new Float32Array(ctx);
  for (let h = 0; h < nHead; h++) {
    for (let i = 0; i < ctx; i++) out[i] += entry.data[h * ctx + i];
  }
  for (let i = 0; i < ctx; i++) out[i] /= nHead;
  return out;
}

function shown(text) {
  // newlines stay line breaks but get a visible mark; an empty piece (a control token) keeps a width
  return text === "" ? "\u2205" : text.replace(/\n/g, "\u21b5\n");
}

/** (Re)build the context's token spans in `el` for `tokens` ([{token_id, text, special}]); generated ones
 * (index >= nPrompt) get `data-k` and are clickable. Spans already there for the same tokens are kept. */
export function layoutTokens(el, tokens, nPrompt) {
  const spans = el.children;
  let keep = 0;
  while (keep < spans.length && keep < tokens.length && Number(spans[keep].dataset.id) === tokens[keep].token_id &&
         (keep >= nPrompt) === ("k" in spans[keep].dataset)) keep++;
  while (spans.length > keep) el.lastChild.remove();
  for (let i = keep; i < tokens.length; i++) {
    const t = tokens[i];
    const span = document.createElement("span");
    span.className = "tok" + (t.special ? " special" : "") + (i >= nPrompt ? " gen" : "");
    span.dataset.i = String(i);
    span.dataset.id = String(t.token_id);
    if (i >= nPrompt) span.dataset.k = String(i - nPrompt);
    span.textContent = shown(t.text);
    el.appendChild(span);
  }
}

/**
 * Colour the spans of `el` by `row` (the attention of the generated token at position `row.length`):
 * spans before it get `data-w` and a colour, that token is `.selected`, later ones `.future`.
 * The scale runs from 0 to the row's largest weight after position 0 (which often takes most of the
 * attention, an "attention sink"); `legend` gets the numbers. `row` null clears the colours.
 */
export function paint(el, row, legend) {
  const n = row ? row.length : -1;
  let max = 0;
  if (row) for (let i = row.length > 1 ? 1 : 0; i < row.length; i++) max = Math.max(max, row[i]);
  for (const span of el.children) {
    const i = Number(span.dataset.i);
    span.classList.toggle("selected", i === n);
    span.classList.toggle("future", row !== null && i > n);
    if (row && i < n) {
      const w = row[i];
      const t = max > 0 ? Math.sqrt(Math.min(1, w / max)) : 0;
      span.dataset.w = String(w);
      span.style.background = colour(t);
      span.style.color = t > 0.72 ? "#fff" : "";
      span.title = `position ${i}, token ${span.dataset.id}: ${w.toPrecision(4)}`;
    } else {
      delete span.dataset.w;
      span.style.background = "";
      span.style.color = "";
      span.title = row ? "" : `position ${i}, token ${span.dataset.id}`;
    }
  }
  legend.max.textContent = row ? max.toPrecision(3) : "";
  legend.note.textContent = !row ? "" : row.length > 1 && row[0] > max
    ? `sqrt scale; position 0 holds ${row[0].toPrecision(3)}, beyond the scale`
    : "sqrt scale";
}
