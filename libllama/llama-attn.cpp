// slotserve's addition to libllama: post-softmax attention rows as graph outputs (llama-attn.h).
//
// Copied into llama.cpp's src/ by slotserve's set-up; libllama/hooks.patch makes llama.cpp call it
// from llm_graph_context::build_attn_mha (once per attention layer) and llama_context::decode (once
// per ubatch).  Pattern: llama.cpp's own per-layer outputs (cparams.embeddings_layer_inp,
// llm_graph_result::set_outputs, llama_context::extract_layer_inputs).
//
// Per ubatch the captured tokens are laid out in "slots": the ubatch's tokens are n_stream streams
// of n_tps tokens (one KV stream per sequence with kv_unified=false, else one), n_q = the most
// captured tokens of any stream, slot = q + n_q*s (streams with fewer captured tokens repeat a row,
// whose slot nobody reads).  idx_h[q, h, s] = the token's row within its stream, for every head.
//   per layer:  rows = get_rows(kq, idx_h)                                  [n_kv, n_q, n_head, n_stream]
//               (flash attention: kq recomputed for those rows only:
//                softmax(get_rows(q) * K^T * scale + get_rows(mask)) with soft-capping and sinks)
//   PER_LAYER:  out[n_kv, n_head, n_layer_sel, n_slots] <- rows  (ggml_set_inplace, one per layer)
//   MEAN:       acc += rows;  out = sum over heads(acc) / (n_layer_sel_total * n_head)  [n_kv, n_slots]
// and out (cast to F16 if asked) is a graph output, copied to host after the ubatch.

#include "llama-attn.h"
#include "llama-attn-hooks.h"

#include "llama-context.h"
#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-model.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <memory>
#include <utility>
#include <vector>

namespace {

constexpr int ATTN_MAX_CACHES = 2;

struct attn_ubatch_rows {
    int32_t n_q      = 0;
    int32_t n_slots  = 0;
    int32_t format   = LLAMA_ATTN_PER_LAYER;
    ggml_type type   = GGML_TYPE_F32;
    int64_t n_kv[ATTN_MAX_CACHES]    = {0, 0};
    int32_t n_head[ATTN_MAX_CACHES]  = {0, 0};
    int32_t n_layer[ATTN_MAX_CACHES] = {0, 0};
    std::vector<uint8_t> buf[ATTN_MAX_CACHES];
};

} // namespace

struct llama_attn_cap {
    int32_t n_layer  = 0;
    int32_t n_caches = 0;
    std::vector<int32_t> cache_of; // [n_layer]: the KV cache of the layer's attention, -1: none

    // llama_attn_set_format
    uint32_t  serial = 1;          // bumped when the format changes: graphs built before are not reused
    int32_t   format = LLAMA_ATTN_PER_LAYER;
    ggml_type type   = GGML_TYPE_F32;
    std::vector<uint8_t> sel;      // [n_layer]
    std::vector<int32_t> index;    // [n_layer]: the layer's index among its cache's selected layers
    int32_t n_sel[ATTN_MAX_CACHES] = {0, 0};
    int32_t last[ATTN_MAX_CACHES]  = {-1, -1}; // the cache's last selected layer: its output is finished there
    int32_t n_sel_total = 0;

    // llama_attn_set_rows
    std::vector<int32_t> rows;     // batch indices in the caller's order
    std::vector<int32_t> row_of;   // batch index -> position in rows, -1

    // what the decode captured
    std::vector<attn_ubatch_rows> outs;
    size_t n_outs = 0;
    std::vector<std::pair<int32_t, int32_t>> loc; // per row: (index in outs, slot), (-1, -1)
    int32_t n_captured = 0;
};

namespace {

struct attn_plan {
    int32_t n_stream = 1;
    int32_t n_tps    = 0;
    int32_t n_q      = 0;
    std::vector<int32_t> row;   // [n_stream*n_q]: row within the stream
    std::vector<int32_t> batch; // [n_stream*n_q]: batch index, -1 for a repeated row
};

void attn_make_plan(const llama_attn_cap & cap, bool kv_unified, const llama_ubatch & ub, attn_plan & p) {
    p.n_stream = kv_unified ? 1 : std::max<int32_t>(1, (int32_t) ub.n_seqs_unq);
    p.n_tps    = (int32_t) ub.n_tokens / p.n_stream;
    p.n_q      = 0;
    p.row.clear();
    p.batch.clear();
    if (cap.rows.empty() || !ub.data || ub.data->batch_idxs.size() != ub.n_tokens || p.n_tps == 0 ||
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
    if (p.n_q == 0) {
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

} // namespace

class llm_graph_input_attn_cap : public llm_graph_input_i {
public:
    llm_graph_input_attn_cap(llama_attn_cap * cap, bool kv_unified) : cap(cap), kv_unified(kv_unified), serial(cap->serial) {}

    void set_input(const llama_ubatch * ubatch) override {
        attn_plan now;
        attn_make_plan(*cap, kv_unified, *ubatch, now);
        if (now.n_q != plan.n_q || now.n_stream != plan.n_stream) {
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

    bool can_reuse(const llm_graph_params & params) override {
        if (params.cparams.attn_cap != cap || serial != cap->serial || failed) {
            return false;
        }
        attn_plan now;
        attn_make_plan(*cap, kv_unified, params.ubatch, now);
        return now.n_q == plan.n_q && now.n_stream == plan.n_stream;
    }

    ggml_tensor * get_idx_h(ggml_context * ctx, int64_t n_head) {
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

    ggml_tensor * get_idx_m(ggml_context * ctx) {
        if (!idx_m) {
            idx_m = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, plan.n_q, 1, plan.n_stream);
            ggml_set_input(idx_m);
            ggml_set_name(idx_m, "attn_cap_idx_mask");
        }
        return idx_m;
    }

    // the mask rows of the captured tokens, gathered once per mask (per KV cache), not per layer
    ggml_tensor * get_mask_rows(ggml_context * ctx, ggml_tensor * kq_mask) {
        for (auto & [m, t] : mask_rows) {
            if (m == kq_mask) {
                return t;
            }
        }
        ggml_tensor * t = ggml_get_rows(ctx, kq_mask, get_idx_m(ctx));
        mask_rows.emplace_back(kq_mask, t);
        return t;
    }

    llama_attn_cap * cap;
    const bool kv_unified;
    const uint32_t serial;
    attn_plan plan;
    bool failed = false;

    std::vector<std::pair<int64_t, ggml_tensor *>> idx_h;
    ggml_tensor * idx_m = nullptr;
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> mask_rows;

    // per KV cache: the running sum (MEAN) or set chain (PER_LAYER), then the finished output
    ggml_tensor * acc[ATTN_MAX_CACHES] = {nullptr, nullptr};
    ggml_tensor * out[ATTN_MAX_CACHES] = {nullptr, nullptr};
    int64_t n_kv[ATTN_MAX_CACHES]      = {0, 0};
    int64_t n_head[ATTN_MAX_CACHES]    = {0, 0};
    int32_t n_done[ATTN_MAX_CACHES]    = {0, 0};
    int32_t n_captured = 0;
};

namespace {

llama_attn_cap * attn_cap_of(const llama_context * ctx) {
    return ctx ? ctx->get_cparams().attn_cap : nullptr;
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
        t = ggml_cont(ctx0, ggml_permute(ctx0, t, 1, 2, 0, 3)); // [n_head, n_kv, n_q, n_stream]
        t = ggml_sum_rows(ctx0, t);                             // [1, n_kv, n_q, n_stream]
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

const llama_kv_cache * attn_kv_cache_of(const llama_context * ctx, int32_t cache) {
    llama_memory_i * mem = ctx->get_memory();
    const llama_kv_cache_iswa * iswa = nullptr;
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        return cache == 0 ? kv : nullptr;
    }
    if (auto * h = dynamic_cast<llama_memory_hybrid *>(mem)) {
        return cache == 0 ? h->get_mem_attn() : nullptr;
    }
    if (auto * h = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        iswa = h->get_mem_attn();
    } else {
        iswa = dynamic_cast<llama_kv_cache_iswa *>(mem);
    }
    if (iswa) {
        return cache == 0 ? iswa->get_base() : cache == 1 ? iswa->get_swa() : nullptr;
    }
    return nullptr;
}

// llama_io_read_host (src/llama-context.cpp) over a list of pieces: tensor data is applied when the reader
// is destroyed, and dropped by discard() when a restore fails
class attn_io_read_pieces : public llama_io_read_i {
public:
    attn_io_read_pieces(const uint8_t * const * ptrs, const size_t * sizes, int32_t n) {
        for (int32_t i = 0; i < n; ++i) {
            if (sizes[i]) {
                pieces.emplace_back(ptrs[i], sizes[i]);
            }
        }
    }

    ~attn_io_read_pieces() override {
        for (const auto & r : pending) {
            ggml_backend_tensor_set(r.tensor, r.ptr, r.offset, r.size);
        }
    }

    void read(void * dst, size_t size) override {
        take(size, [&](const uint8_t * src, size_t n, size_t done) { memcpy((uint8_t *) dst + done, src, n); });
    }

    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        take(size, [&](const uint8_t * src, size_t n, size_t done) { pending.push_back({tensor, src, n, offset + done}); });
    }

    void discard() override { pending.clear(); }

    size_t n_bytes() override { return n_read; }

private:
    template <typename F> void take(size_t size, F && use) {
        size_t done = 0;
        while (done < size) {
            if (cur == pieces.size()) {
                throw std::runtime_error("unexpectedly reached end of buffer");
            }
            const size_t n = std::min(size - done, pieces[cur].second - pos);
            use(pieces[cur].first + pos, n, done);
            done += n;
            pos += n;
            if (pos == pieces[cur].second) {
                cur++;
                pos = 0;
            }
        }
        n_read += size;
    }

    struct pending_set {
        ggml_tensor * tensor;
        const uint8_t * ptr;
        size_t size;
        size_t offset;
    };
    std::vector<std::pair<const uint8_t *, size_t>> pieces;
    std::vector<pending_set> pending;
    size_t cur = 0, pos = 0, n_read = 0;
};

bool attn_is_iswa(const llama_context * ctx) {
    llama_memory_i * mem = ctx->get_memory();
    return dynamic_cast<llama_kv_cache_iswa *>(mem) || dynamic_cast<llama_memory_hybrid_iswa *>(mem);
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
    ggml_tensor * rows = kq ? ggml_get_rows(ctx0, kq, inp->get_idx_h(ctx0, n_head))
                            : attn_recompute_rows(g, inp, q, k, kq_mask, sinks, kq_scale);
    const int64_t n_kv = rows->ne[0];
    if (inp->n_done[c] == 0) {
        inp->n_kv[c]   = n_kv;
        inp->n_head[c] = n_head;
    } else if (inp->n_kv[c] != n_kv || inp->n_head[c] != n_head) {
        inp->failed = true; // layers of one cache must agree (heads that vary by layer are not supported)
        return;
    }
    if (cap->format == LLAMA_ATTN_MEAN) {
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

void llama_attn_cap_extract(llama_attn_cap * cap, ggml_backend_sched_t sched, const llm_graph_result * res) {
    if (!cap || !res) {
        return;
    }
    const llm_graph_input_attn_cap * inp = nullptr;
    for (const auto & in : res->inputs) {
        if ((inp = dynamic_cast<const llm_graph_input_attn_cap *>(in.get()))) {
            break;
        }
    }
    if (!inp || inp->plan.n_q == 0) {
        return;
    }
    if (inp->failed) {
        cap->n_captured = -1;
        return;
    }
    cap->n_captured = inp->n_captured;
    if (cap->n_outs == cap->outs.size()) {
        cap->outs.emplace_back();
    }
    attn_ubatch_rows & u = cap->outs[cap->n_outs];
    u.n_q     = inp->plan.n_q;
    u.n_slots = inp->plan.n_q * inp->plan.n_stream;
    u.format  = cap->format;
    u.type    = cap->type;
    for (int c = 0; c < ATTN_MAX_CACHES; ++c) {
        ggml_tensor * t = inp->out[c];
        if (!t || inp->n_done[c] != cap->n_sel[c]) {
            u.buf[c].clear();
            continue;
        }
        u.n_kv[c]    = inp->n_kv[c];
        u.n_head[c]  = (int32_t) inp->n_head[c];
        u.n_layer[c] = cap->n_sel[c];
        u.buf[c].resize(ggml_nbytes(t));
        ggml_backend_t backend = ggml_backend_sched_get_tensor_backend(sched, t);
        GGML_ASSERT(backend != nullptr);
        ggml_backend_tensor_get_async(backend, t, u.buf[c].data(), 0, ggml_nbytes(t));
    }
    for (int32_t slot = 0; slot < u.n_slots; ++slot) {
        const int32_t b = inp->plan.batch[slot];
        if (b >= 0 && (size_t) b < cap->row_of.size() && cap->row_of[b] >= 0) {
            cap->loc[cap->row_of[b]] = {(int32_t) cap->n_outs, slot};
        }
    }
    cap->n_outs++;
}

void llama_attn_cap_free(llama_attn_cap * cap) {
    delete cap;
}

//
// C API
//

int32_t llama_attn_abi(void) {
    return LLAMA_ATTN_ABI;
}

int32_t llama_attn_init(llama_context * ctx) {
    auto & cparams = const_cast<llama_cparams &>(ctx->get_cparams()); // the context's own, set once
    if (!cparams.attn_cap) {
        cparams.attn_cap = new llama_attn_cap();
    }
    llama_attn_cap * cap = cparams.attn_cap;
    const auto & hp = ctx->get_model().hparams;
    const bool iswa = attn_is_iswa(ctx);
    const bool kv   = attn_kv_cache_of(ctx, 0) != nullptr;
    cap->n_layer = (int32_t) hp.n_layer();
    cap->cache_of.assign(cap->n_layer, -1);
    cap->n_caches = 0;
    for (int32_t il = 0; il < cap->n_layer && kv; ++il) {
        if (hp.is_recr(il) || hp.n_head(il) == 0) {
            continue;
        }
        cap->cache_of[il] = iswa && hp.is_swa(il) ? 1 : 0;
        cap->n_caches     = std::max(cap->n_caches, cap->cache_of[il] + 1);
    }
    llama_attn_set_format(ctx, nullptr, 0, LLAMA_ATTN_PER_LAYER, GGML_TYPE_F32);
    return kv ? cap->n_caches : -1;
}

bool llama_attn_flash_attn(const llama_context * ctx) {
    return ctx && ctx->get_cparams().flash_attn;
}

void llama_attn_memory_update(llama_context * ctx) {
    if (ctx) {
        ctx->memory_update(false);
    }
}

int32_t llama_attn_layer_cache(const llama_context * ctx, int32_t il) {
    const llama_attn_cap * cap = attn_cap_of(ctx);
    return cap && il >= 0 && il < cap->n_layer ? cap->cache_of[il] : -1;
}

int32_t llama_attn_set_format(llama_context * ctx, const uint8_t * layers, int32_t n_layers, int32_t format,
                              int32_t type) {
    llama_attn_cap * cap = attn_cap_of(ctx);
    if (!cap || (format != LLAMA_ATTN_PER_LAYER && format != LLAMA_ATTN_MEAN) ||
        (type != GGML_TYPE_F32 && type != GGML_TYPE_F16) || (layers && n_layers != cap->n_layer)) {
        return -1;
    }
    std::vector<uint8_t> sel(cap->n_layer);
    for (int32_t il = 0; il < cap->n_layer; ++il) {
        sel[il] = (!layers || layers[il]) && cap->cache_of[il] >= 0;
    }
    if (sel == cap->sel && format == cap->format && (ggml_type) type == cap->type) {
        return 0;
    }
    cap->sel    = std::move(sel);
    cap->format = format;
    cap->type   = (ggml_type) type;
    cap->serial++;
    cap->index.assign(cap->n_layer, -1);
    cap->n_sel_total = 0;
    for (int c = 0; c < ATTN_MAX_CACHES; ++c) {
        cap->n_sel[c] = 0;
        cap->last[c]  = -1;
    }
    for (int32_t il = 0; il < cap->n_layer; ++il) {
        if (cap->sel[il]) {
            const int32_t c = cap->cache_of[il];
            cap->index[il]  = cap->n_sel[c]++;
            cap->last[c]    = il;
            cap->n_sel_total++;
        }
    }
    return 0;
}

int32_t llama_attn_set_rows(llama_context * ctx, const int32_t * batch_idx, int32_t n) {
    llama_attn_cap * cap = attn_cap_of(ctx);
    if (!cap || n < 0 || (n > 0 && !batch_idx)) {
        return -1;
    }
    for (int32_t b : cap->rows) {
        cap->row_of[b] = -1;
    }
    cap->rows.clear();
    cap->n_outs = 0;
    cap->loc.assign(n, {-1, -1});
    for (int32_t i = 0; i < n; ++i) {
        const int32_t b = batch_idx[i];
        if (b < 0) {
            llama_attn_set_rows(ctx, nullptr, 0);
            return -1;
        }
        if ((size_t) b >= cap->row_of.size()) {
            cap->row_of.resize((size_t) b + 1, -1);
        }
        cap->row_of[b] = i;
        cap->rows.push_back(b);
    }
    return 0;
}

int32_t llama_attn_get_row(llama_context * ctx, int32_t i, int32_t cache, llama_attn_row * row) {
    llama_attn_cap * cap = attn_cap_of(ctx);
    if (!cap || !row || i < 0 || (size_t) i >= cap->loc.size() || cache < 0 || cache >= ATTN_MAX_CACHES) {
        return -1;
    }
    const auto [o, slot] = cap->loc[i];
    if (o < 0) {
        return -1;
    }
    llama_synchronize(ctx); // the copies of llama_attn_cap_extract are asynchronous
    const attn_ubatch_rows & u = cap->outs[o];
    if (u.buf[cache].empty()) {
        return 1;
    }
    const int64_t es     = u.type == GGML_TYPE_F16 ? 2 : 4;
    const bool    mean   = u.format == LLAMA_ATTN_MEAN;
    const int64_t n_kv   = u.n_kv[cache];
    row->n_kv     = n_kv;
    row->n_layer  = mean ? 1 : u.n_layer[cache];
    row->n_head   = mean ? 1 : u.n_head[cache];
    row->nb_head  = es * n_kv;
    row->nb_layer = es * n_kv * row->n_head;
    row->type     = u.type;
    row->stream   = slot / u.n_q;
    row->data     = u.buf[cache].data() + (size_t) slot * row->nb_layer * row->n_layer;
    return 0;
}

int32_t llama_attn_n_captured(const llama_context * ctx) {
    const llama_attn_cap * cap = attn_cap_of(ctx);
    return cap ? cap->n_captured : -1;
}

int32_t llama_attn_seq_cells(llama_context * ctx, int32_t cache, llama_seq_id seq_id, llama_pos p0, int32_t n,
                             int32_t * cells) {
    const llama_kv_cache * kv = ctx ? attn_kv_cache_of(ctx, cache) : nullptr;
    if (!kv || n < 0 || (n > 0 && !cells) || seq_id < 0 || (uint32_t) seq_id >= ctx->get_cparams().n_seq_max) {
        return -1;
    }
    std::fill(cells, cells + n, -1);
    const llama_kv_cells & kc = kv->get_cells(seq_id);
    int32_t found = 0;
    for (uint32_t i = 0; i < kc.size(); ++i) {
        if (!kc.seq_has(i, seq_id)) {
            continue;
        }
        const llama_pos p = kc.pos_get(i);
        if (p >= p0 && p - p0 < n) {
            found += cells[p - p0] < 0;
            cells[p - p0] = (int32_t) i;
        }
    }
    return found;
}

size_t llama_attn_state_seq_set_data(llama_context * ctx, const uint8_t * const * pieces, const size_t * sizes,
                                     int32_t n_pieces, llama_seq_id seq_id) {
    if (!ctx || n_pieces < 0 || (n_pieces > 0 && (!pieces || !sizes)) || seq_id < 0 ||
        (uint32_t) seq_id >= ctx->get_cparams().n_seq_max) {
        return 0;
    }
    llama_synchronize(ctx);
    attn_io_read_pieces io(pieces, sizes, n_pieces);
    try {
        uint32_t magic;
        io.read(&magic, sizeof(magic));
        if (magic != 0xaf143cd8) { // io_magic of llama_context::state_seq_get_data (src/llama-context.cpp)
            throw std::runtime_error("wrong sequence state magic");
        }
        llama_seq_id seq_id_read;
        io.read(&seq_id_read, sizeof(seq_id_read));
        if (llama_memory_i * mem = ctx->get_memory()) {
            mem->state_read(io, seq_id, 0);
        }
        return io.n_bytes();
    } catch (const std::exception & err) {
        LLAMA_LOG_ERROR("%s: error loading state: %s\n", __func__, err.what());
        io.discard();
        return 0;
    }
}
