// slotserve: the attention capture's nodes in llama.cpp's graph (llama-attn.h).  One reason to patch:
// building the rows of the asked tokens as graph outputs.
//
// Copied into llama.cpp's src/ by slotserve's set-up; libllama/hooks.patch makes llama.cpp call
// llama_attn_cap_layer from llm_graph_context::build_attn_mha (once per attention layer).  Pattern:
// llama.cpp's own per-layer outputs (cparams.embeddings_layer_inp, llm_graph_result::set_outputs).
//
// Per ubatch the captured tokens are laid out in "slots": the ubatch's tokens are n_stream streams
// of n_tps tokens (one KV stream per sequence with kv_unified=false, else one), n_q = the most
// captured tokens of any stream, slot = q + n_q*s (streams with fewer captured tokens repeat a row,
// whose slot nobody reads).  idx_h[q, h, s] = the token's row within its stream, for every head.
//   per layer:  rows = get_rows(kq, idx_h)                                  [n_kv, n_q, n_head, n_stream]
//               (flash attention: kq recomputed for those rows only:
//                softmax(get_rows(q) * K^T * scale + get_rows(mask)) with soft-capping and sinks)
//   PER_LAYER:  out[n_kv, n_head, n_layer_sel, n_slots] <- rows  (ggml_set_inplace, one per layer)
//   PER_LAYER, one token per stream (decode steps: n_tps == 1, so n_q == 1 and rows are every stream's):
//               no gather and no set: each selected layer's rows tensor (kq itself with flash attention off)
//               is a graph output [n_kv, 1, n_head, n_stream] (cast to F16 if asked: one op), read in
//               place after the ubatch when it is in host memory (llama-attn-capture.cpp)
//   MEAN:       acc += rows;  out = sum over heads(acc) / (n_layer_sel_total * n_head)  [n_kv, n_slots]
//               (cpu_ops: acc += attn_sum_heads(rows), a CPU operator reading the layer's rows while they
//               are in cache; out = acc / (n_layer_sel_total * n_head))
//   TOP_K:      rows_k [2k, n_q, n_head, n_stream]: per row its k largest weights, then their cells as F32 values
//               (cpu_ops: attn_top_k, a CPU operator; else ggml_top_k's cells, their weights gathered by a batched
//               get_rows: ggml's own operators, which a GPU backend runs), then as PER_LAYER with 2k in place of
//               n_kv (decode steps: each layer's rows_k is an output, read in place)
// and out (cast to F16 if asked) is a graph output, copied to host after the ubatch (llama-attn-capture.cpp).
// A decode step's rows are kq itself in every format (n_tps == 1: the gather would copy kq whole).
//
// Stable shape (llama_attn_set_stable): a ubatch in which nobody asks for a row still gets the nodes,
// with n_q = 1 (the stream's first row, read by nobody), so decodes that capture and decodes that do not
// build one graph: llama.cpp reuses it (llm_graph_result::can_reuse) and the CUDA backend keeps its CUDA
// graph instead of warming a new one each time a client switches attention on or off.

#include "llama-attn-impl.h"
#include "llama-attn-hooks.h"

#include "llama-graph.h"
#include "llama-model.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

void attn_make_plan(const llama_attn_cap & cap, bool kv_unified, const llama_ubatch & ub, attn_plan & p) {
    p.n_stream = kv_unified ? 1 : std::max<int32_t>(1, (int32_t) ub.n_seqs_unq);
    p.n_tps    = (int32_t) ub.n_tokens / p.n_stream;
    p.n_q      = 0;
    p.inplace  = false;
    p.row.clear();
    p.batch.clear();
    if ((cap.rows.empty() && !cap.stable) || !ub.data || ub.data->batch_idxs.size() != ub.n_tokens || p.n_tps == 0 ||
        (int32_t) ub.n_tokens != p.n_tps * p.n_stream) {
        return;
    }
    const auto & bidx = ub.data->batch_idxs;
    auto wanted = [&](uint32_t j) {
        const int32_t b = bidx[j];
        return b >= 0 && (size_t) b < cap.row_of.size() && cap.row_of[b] >= 0;
    };
    std::vector<int32_t> count(p.n_stream, 0);
    for (uint32_t j = 0; j < ub.n_tokens; ++j) {
        if (wanted(j)) {
            p.n_q = std::max(p.n_q, ++count[j / p.n_tps]);
        }
    }
    // a decode step (one token per stream): each layer's post-softmax tensor holds exactly the slots' rows
    p.inplace = cap.in_place && cap.format != LLAMA_ATTN_MEAN && p.n_tps == 1;
    if (p.n_q == 0) {
        if (cap.stable) { // the same nodes as a capturing ubatch: one row per stream, read by nobody
            p.n_q = 1;
            p.row.assign((size_t) p.n_stream, 0);
            p.batch.assign((size_t) p.n_stream, -1);
        } else {
            p.inplace = false;
        }
        return;
    }
    p.row.assign((size_t) p.n_stream * p.n_q, 0);
    p.batch.assign((size_t) p.n_stream * p.n_q, -1);
    std::fill(count.begin(), count.end(), 0);
    for (uint32_t j = 0; j < ub.n_tokens; ++j) {
        if (wanted(j)) {
            const int32_t s    = (int32_t) j / p.n_tps;
            const size_t  slot = (size_t) s * p.n_q + count[s]++;
            p.row[slot]   = (int32_t) j % p.n_tps;
            p.batch[slot] = bidx[j];
        }
    }
}

void llm_graph_input_attn_cap::set_input(const llama_ubatch * ubatch) {
    attn_plan now;
    attn_make_plan(*cap, kv_unified, *ubatch, now);
    if (now.n_q != plan.n_q || now.n_stream != plan.n_stream || now.inplace != plan.inplace) {
        failed = true; // cannot happen: can_reuse compared the same plan
        return;
    }
    plan = std::move(now);
    std::vector<int32_t> data;
    for (auto & [n_head, t] : idx_h) {
        data.resize((size_t) plan.n_q * n_head * plan.n_stream);
        for (int32_t s = 0; s < plan.n_stream; ++s) {
            for (int64_t h = 0; h < n_head; ++h) {
                for (int32_t q = 0; q < plan.n_q; ++q) {
                    data[q + plan.n_q * (h + n_head * s)] = plan.row[(size_t) s * plan.n_q + q];
                }
            }
        }
        if (t->buffer) {
            ggml_backend_tensor_set(t, data.data(), 0, ggml_nbytes(t));
        }
    }
    if (idx_m && idx_m->buffer) {
        ggml_backend_tensor_set(idx_m, plan.row.data(), 0, ggml_nbytes(idx_m));
    }
}

bool llm_graph_input_attn_cap::can_reuse(const llm_graph_params & params) {
    if (params.cparams.attn_cap != cap || serial != cap->serial || failed) {
        return false;
    }
    attn_plan now;
    attn_make_plan(*cap, kv_unified, params.ubatch, now);
    return now.n_q == plan.n_q && now.n_stream == plan.n_stream && now.inplace == plan.inplace;
}

ggml_tensor * llm_graph_input_attn_cap::get_idx_h(ggml_context * ctx, int64_t n_head) {
    for (auto & [n, t] : idx_h) {
        if (n == n_head) {
            return t;
        }
    }
    ggml_tensor * t = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, plan.n_q, n_head, plan.n_stream);
    ggml_set_input(t);
    ggml_set_name(t, "attn_cap_idx");
    idx_h.emplace_back(n_head, t);
    return t;
}

ggml_tensor * llm_graph_input_attn_cap::get_idx_m(ggml_context * ctx) {
    if (!idx_m) {
        idx_m = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, plan.n_q, 1, plan.n_stream);
        ggml_set_input(idx_m);
        ggml_set_name(idx_m, "attn_cap_idx_mask");
    }
    return idx_m;
}

ggml_tensor * llm_graph_input_attn_cap::get_mask_rows(ggml_context * ctx, ggml_tensor * kq_mask) {
    for (auto & [m, t] : mask_rows) {
        if (m == kq_mask) {
            return t;
        }
    }
    ggml_tensor * t = ggml_get_rows(ctx, kq_mask, get_idx_m(ctx));
    mask_rows.emplace_back(kq_mask, t);
    return t;
}

namespace {

// the rows of a CPU operator's source: src [n_kv, n_q, n_head, n_stream] F32, each row contiguous
const float * attn_src_row(const ggml_tensor * a, int64_t i1, int64_t i2, int64_t i3) {
    return (const float *) ((const char *) a->data + i1 * a->nb[1] + i2 * a->nb[2] + i3 * a->nb[3]);
}

// dst [n_kv, n_q, 1, n_stream] F32 = the sum over heads of dst->src[0] [n_kv, n_q, n_head, n_stream] F32 (MEAN's
// per-layer step, cpu_ops): each thread sums its own range of cells of every row, reading the layer's rows once
void attn_sum_heads(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * a = dst->src[0];
    const int64_t n_kv = a->ne[0];
    const int64_t per  = ((n_kv + nth - 1) / nth + 15) / 16 * 16; // 64-byte ranges: no two threads share a line
    const int64_t j0   = std::min(n_kv, per * ith);
    const int64_t j1   = std::min(n_kv, j0 + per);
    for (int64_t i3 = 0; i3 < a->ne[3]; ++i3) {
        for (int64_t i1 = 0; i1 < a->ne[1]; ++i1) {
            float * out = (float *) ((char *) dst->data + i1 * dst->nb[1] + i3 * dst->nb[3]);
            const float * first = attn_src_row(a, i1, 0, i3);
            std::copy(first + j0, first + j1, out + j0);
            for (int64_t h = 1; h < a->ne[2]; ++h) {
                const float * x = attn_src_row(a, i1, h, i3);
                for (int64_t j = j0; j < j1; ++j) {
                    out[j] += x[j];
                }
            }
        }
    }
}

// dst [2k, n_q, n_head, n_stream] F32: per row of dst->src[0] [n_kv, n_q, n_head, n_stream] F32 its k largest
// values, largest first (ties: the lower cell first), then their indices as F32 values (LLAMA_ATTN_TOP_K); k =
// (intptr_t) userdata.  Per row, while the softmax's output is in cache: the largest value of each of G groups (cells
// j with j % G == g: an element-wise max of consecutive runs of G values, which the compiler vectorizes); the m-th
// largest of those G maxima, which is at most the row's m-th largest value (m groups each hold a value that large);
// the values at least that bound from the groups that reach it (a softmax row's few large weights sit in few
// groups), of which std::nth_element keeps the m largest.  G is 8k within [64, 512].  A NaN is never selected.
void attn_top_k(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * a  = dst->src[0];
    const int64_t       n  = a->ne[0];
    const int32_t       k  = (int32_t) (intptr_t) userdata;
    const int64_t       m  = std::min<int64_t>(k, n);
    const int64_t       nr = a->ne[1] * a->ne[2] * a->ne[3];
    const int64_t       G  = std::min<int64_t>(n, std::clamp<int64_t>(8 * (int64_t) k, 64, 512));
    using entry            = std::pair<float, int32_t>;
    auto better            = [](const entry & x, const entry & y) {
        return x.first > y.first || (x.first == y.first && x.second < y.second);
    };
    std::vector<float> gmax((size_t) G);
    std::vector<float> sel;
    std::vector<entry> cand;
    for (int64_t r = ith; r < nr; r += nth) {
        const int64_t i1 = r % a->ne[1];
        const int64_t i2 = (r / a->ne[1]) % a->ne[2];
        const int64_t i3 = r / (a->ne[1] * a->ne[2]);
        const float * x  = attn_src_row(a, i1, i2, i3);
        float *       gm = gmax.data();
        std::fill(gm, gm + G, -INFINITY);
        for (int64_t j0 = 0; j0 < n; j0 += G) {
            const int64_t w = std::min<int64_t>(G, n - j0);
            const float * p = x + j0;
            for (int64_t g = 0; g < w; ++g) {
                gm[g] = p[g] > gm[g] ? p[g] : gm[g];
            }
        }
        float bound = -INFINITY;
        if (G > m) {
            sel.assign(gm, gm + G);
            std::nth_element(sel.begin(), sel.begin() + (m - 1), sel.end(), std::greater<float>());
            bound = sel[m - 1];
        }
        cand.clear();
        for (int64_t g = 0; g < G; ++g) {
            if (gm[g] >= bound) {
                for (int64_t j = g; j < n; j += G) {
                    if (x[j] >= bound) {
                        cand.emplace_back(x[j], (int32_t) j);
                    }
                }
            }
        }
        const int64_t mm = std::min<int64_t>(m, (int64_t) cand.size());
        if (mm > 0 && mm < (int64_t) cand.size()) {
            std::nth_element(cand.begin(), cand.begin() + (mm - 1), cand.end(), better);
        }
        std::sort(cand.begin(), cand.begin() + mm, better);
        float * val = (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
        float * cell = val + k;
        for (int32_t q = 0; q < k; ++q) {
            val[q]  = q < mm ? cand[q].first : 0.0f;
            cell[q] = q < mm ? (float) cand[q].second : -1.0f;
        }
    }
}

// LLAMA_ATTN_TOP_K with ggml's own operators (any backend: what a model with a GPU device gets): rows [n_kv, n_q,
// n_head, n_stream] F32 -> [2k, ...] F32 as attn_top_k writes it, but the k in no particular order: ggml_top_k's
// cells (src/ggml.c: unordered), their weights gathered per row by a batched get_rows, the cells cast to F32
// (exact below 2^24); past a row of fewer than k cells weight 0 and cell -1
ggml_tensor * attn_top_k_ops(ggml_context * ctx0, ggml_tensor * rows, int32_t k) {
    if (!ggml_is_contiguous(rows)) {
        rows = ggml_cont(ctx0, rows);
    }
    const int64_t n_kv = rows->ne[0];
    const int64_t m    = std::min<int64_t>(k, n_kv);
    const int64_t nr   = ggml_nrows(rows);
    ggml_tensor * idx  = ggml_top_k(ctx0, rows, (int) m); // I32 [m, n_q, n_head, n_stream]
    ggml_tensor * w    = ggml_get_rows(ctx0, ggml_reshape_3d(ctx0, rows, 1, n_kv, nr),
                                       ggml_reshape_2d(ctx0, idx, m, nr)); // [1, m, nr]
    w                  = ggml_reshape_4d(ctx0, w, m, rows->ne[1], rows->ne[2], rows->ne[3]);
    ggml_tensor * cell = ggml_cast(ctx0, idx, GGML_TYPE_F32);
    if (m < k) { // padded with 0: weights 0, cells (cell + 1) - 1 = -1
        w    = ggml_pad(ctx0, w, (int) (k - m), 0, 0, 0);
        cell = ggml_pad(ctx0, ggml_scale_bias(ctx0, cell, 1.0f, 1.0f), (int) (k - m), 0, 0, 0);
        cell = ggml_scale_bias(ctx0, cell, 1.0f, -1.0f);
    }
    return ggml_concat(ctx0, w, cell, 0);
}

llm_graph_input_attn_cap * attn_input_of(const llm_graph_context & g, llama_attn_cap * cap) {
    for (auto & in : g.res->inputs) {
        if (auto * p = dynamic_cast<llm_graph_input_attn_cap *>(in.get())) {
            return p;
        }
    }
    auto inp = std::make_unique<llm_graph_input_attn_cap>(cap, g.cparams.kv_unified);
    attn_make_plan(*cap, g.cparams.kv_unified, g.ubatch, inp->plan);
    return (llm_graph_input_attn_cap *) g.res->add_input(std::move(inp));
}

// the rows of the captured tokens, [n_kv, n_q, n_head, n_stream], recomputed as build_attn_mha's
// non-flash path computes kq (src/llama-graph.cpp): mul_mat in F32 precision, Grok's and Gemma 2's
// soft-capping, soft_max_ext with the mask rows (gathered once per mask), scale and ALiBi bias, then the sinks
ggml_tensor * attn_recompute_rows(const llm_graph_context & g, llm_graph_input_attn_cap * inp, ggml_tensor * q,
                             ggml_tensor * k, ggml_tensor * kq_mask, ggml_tensor * sinks, float kq_scale) {
    ggml_context * ctx0 = g.ctx0;
    const auto & hp = g.hparams;
    ggml_tensor * qs = ggml_get_rows(ctx0, q, inp->get_idx_h(ctx0, q->ne[2])); // [d, n_q, n_head, n_stream]
    ggml_tensor * kq = ggml_mul_mat(ctx0, k, qs);
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    if (g.arch == LLM_ARCH_GROK) {
        kq = ggml_tanh(ctx0, ggml_scale(ctx0, kq, hp.f_attn_out_scale / hp.f_attn_logit_softcapping));
        kq = ggml_scale(ctx0, kq, hp.f_attn_logit_softcapping);
    }
    if (hp.attn_soft_cap) {
        kq = ggml_scale(ctx0, kq, 1.0f / hp.f_attn_logit_softcapping);
        kq = ggml_tanh(ctx0, kq);
        kq = ggml_scale(ctx0, kq, hp.f_attn_logit_softcapping);
    }
    kq = ggml_soft_max_ext(ctx0, kq, inp->get_mask_rows(ctx0, kq_mask), kq_scale, hp.f_max_alibi_bias);
    ggml_soft_max_add_sinks(kq, sinks);
    return kq;
}

void attn_finish(const llm_graph_context & g, llama_attn_cap * cap, llm_graph_input_attn_cap * inp, int c) {
    ggml_context * ctx0 = g.ctx0;
    ggml_tensor * t = inp->acc[c];
    if (cap->format == LLAMA_ATTN_MEAN) {
        if (t->ne[2] != 1) { // not summed over heads per layer (attn_sum_heads, or a single head)
            t = ggml_cont(ctx0, ggml_permute(ctx0, t, 1, 2, 0, 3)); // [n_head, n_kv, n_q, n_stream]
            t = ggml_sum_rows(ctx0, t);                             // [1, n_kv, n_q, n_stream]
        }
        t = ggml_scale(ctx0, t, 1.0f / ((float) cap->n_sel_total * (float) inp->n_head[c]));
    }
    if (cap->type == GGML_TYPE_F16) {
        t = ggml_cast(ctx0, t, GGML_TYPE_F16);
    }
    ggml_set_name(t, "attn_cap_out");
    ggml_set_output(t);
    ggml_build_forward_expand(g.gf, t);
    inp->out[c] = t;
}

} // namespace

void llama_attn_cap_layer(const llm_graph_context & g, ggml_tensor * q, ggml_tensor * k, ggml_tensor * kq_mask,
                          ggml_tensor * kq, ggml_tensor * sinks, float kq_scale, int il) {
    llama_attn_cap * cap = g.cparams.attn_cap;
    if (!cap || il < 0 || il >= cap->n_layer) {
        return;
    }
    llm_graph_input_attn_cap * inp = attn_input_of(g, cap);
    const int32_t c = cap->cache_of[il];
    if (c < 0) {
        inp->failed = true; // attention where llama_attn_init saw none
        return;
    }
    if (inp->failed || inp->plan.n_q == 0 || !cap->sel[il]) {
        return;
    }
    // the shapes the gathers assume (src/llama-graph.cpp build_attn_mha and build_attn_inp_kq_mask); a graph
    // that differs is not captured (ggml would abort on a mismatch)
    const int64_t n_head = q->ne[2];
    if (q->ne[1] != inp->plan.n_tps || q->ne[3] != inp->plan.n_stream || kq_mask->ne[2] != 1 ||
        kq_mask->ne[3] != inp->plan.n_stream || (kq && (kq->ne[1] != q->ne[1] || kq->ne[2] != n_head || kq->ne[3] != q->ne[3]))) {
        inp->failed = true;
        return;
    }
    ggml_context * ctx0 = g.ctx0;
    ggml_tensor * rows = kq && inp->plan.n_tps == 1 ? kq // a decode step: kq holds exactly the slots' rows
                         : kq ? ggml_get_rows(ctx0, kq, inp->get_idx_h(ctx0, n_head))
                              : attn_recompute_rows(g, inp, q, k, kq_mask, sinks, kq_scale);
    if (cap->format == LLAMA_ATTN_TOP_K) {
        ggml_tensor * src = rows;
        rows = cap->cpu_ops ? ggml_custom_4d(ctx0, GGML_TYPE_F32, 2 * (int64_t) cap->top_k, src->ne[1], src->ne[2],
                                             src->ne[3], &src, 1, attn_top_k, GGML_N_TASKS_MAX,
                                             (void *) (intptr_t) cap->top_k)
                            : attn_top_k_ops(ctx0, src, cap->top_k);
        ggml_set_name(rows, "attn_cap_top_k");
    }
    const int64_t n_kv = rows->ne[0];
    if (inp->n_done[c] == 0) {
        inp->n_kv[c]   = n_kv;
        inp->n_head[c] = n_head;
    } else if (inp->n_kv[c] != n_kv || inp->n_head[c] != n_head) {
        inp->failed = true; // layers of one cache must agree (heads that vary by layer are not supported)
        return;
    }
    if (inp->plan.inplace) { // rows is [n_kv, 1, n_head, n_stream], contiguous: it is the output, no gather, no set
        ggml_tensor * t = rows;
        if (cap->type == GGML_TYPE_F16) {
            t = ggml_cast(ctx0, rows, GGML_TYPE_F16);
            ggml_set_name(t, "attn_cap_out");
        }
        ggml_set_output(t);
        ggml_build_forward_expand(g.gf, t);
        inp->layer_out[c].push_back(t);
        inp->n_done[c]++;
        inp->n_captured++;
        return;
    }
    if (cap->format == LLAMA_ATTN_MEAN) {
        if (cap->cpu_ops && n_head > 1) {
            ggml_tensor * src = rows;
            rows = ggml_custom_4d(ctx0, GGML_TYPE_F32, n_kv, src->ne[1], 1, src->ne[3], &src, 1, attn_sum_heads,
                                  GGML_N_TASKS_MAX, nullptr);
            ggml_set_name(rows, "attn_cap_sum_heads");
        }
        inp->acc[c] = inp->acc[c] ? ggml_add(ctx0, inp->acc[c], rows) : rows;
    } else {
        const int64_t n_slots = (int64_t) inp->plan.n_q * inp->plan.n_stream;
        const size_t  nb_slot = sizeof(float) * n_kv * n_head * cap->n_sel[c];
        if (nb_slot * n_slots > INT32_MAX) { // ggml_set keeps strides and offset as int32
            inp->failed = true;
            return;
        }
        if (!inp->acc[c]) {
            inp->acc[c] = ggml_new_tensor_4d(ctx0, GGML_TYPE_F32, n_kv, n_head, cap->n_sel[c], n_slots);
        }
        inp->acc[c] = ggml_set_inplace(ctx0, inp->acc[c], rows, nb_slot, sizeof(float) * n_kv,
                                       nb_slot * inp->plan.n_q, sizeof(float) * n_kv * n_head * cap->index[il]);
    }
    ggml_build_forward_expand(g.gf, inp->acc[c]); // here, while this layer's K is still in cache
    inp->n_done[c]++;
    inp->n_captured++;
    if (il == cap->last[c]) {
        attn_finish(g, cap, inp, c);
    }
}
