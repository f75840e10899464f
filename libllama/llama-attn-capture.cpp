// slotserve: the attention capture's host side and C API (llama-attn.h).  One reason to patch: handing
// the rows the graph computed (llama-attn-graph.cpp) to the caller.
//
// Copied into llama.cpp's src/ by slotserve's set-up; libllama/hooks.patch makes llama.cpp call
// llama_attn_cap_extract once per ubatch from llama_context::decode and llama_attn_cap_free from its
// destructor.  The rows are copied with ggml_backend_tensor_get_async into a buffer of the device's host
// buffer type (pinned memory on CUDA, as llama.cpp's own logits buffer: llama_context::output_reserve),
// so the copy is a true asynchronous DMA queued behind the ubatch's compute; llama_attn_get_row reads them
// after llama_synchronize, the synchronisation that reading logits also waits for.  Decode steps (one token per
// stream, per-layer format) are not copied when their outputs are in host memory (a CPU backend) and their
// ubatch is the decode's last: llama_attn_get_row points into the graph's own output tensors.

#include "llama-attn-impl.h"
#include "llama-attn-hooks.h"

#include "llama-context.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace {

llama_attn_cap * attn_cap_of(const llama_context * ctx) {
    return ctx ? ctx->get_cparams().attn_cap : nullptr;
}

// llama_attn_set_stable, llama_attn_set_in_place, llama_attn_set_cpu_ops: set one of the capture's graph-shaping
// flags; a change bumps the serial, so graphs built before (of the other shape, reading the rows the other way) are
// not reused
int32_t attn_set_flag(llama_context * ctx, bool llama_attn_cap::*flag, bool value) {
    llama_attn_cap * cap = attn_cap_of(ctx);
    if (!cap) {
        return -1;
    }
    if (cap->*flag != value) {
        cap->*flag = value;
        cap->serial++;
    }
    return 0;
}

// the host buffer type of the backend that computed t: its device's (pinned) host buffer type, else CPU memory
ggml_backend_buffer_type_t attn_host_buft(ggml_backend_t backend) {
    ggml_backend_dev_t dev = backend ? ggml_backend_get_device(backend) : nullptr;
    ggml_backend_buffer_type_t buft = dev ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    return buft ? buft : ggml_backend_cpu_buffer_type();
}

// room for `size` bytes of buft in buf (kept when it is large enough and of that type)
bool attn_reserve(ggml_backend_buffer_ptr & buf, ggml_backend_buffer_type_t buft, size_t size) {
    if (buf && ggml_backend_buffer_get_type(buf.get()) == buft && ggml_backend_buffer_get_size(buf.get()) >= size) {
        return true;
    }
    buf.reset(ggml_backend_buft_alloc_buffer(buft, size));
    if (!buf && buft != ggml_backend_cpu_buffer_type()) { // pinned memory can run out: fall back to CPU memory
        buf.reset(ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size));
    }
    return buf != nullptr;
}

// u.ptr[c] ([n_slots * n_layer], slot-major) of rows whose layer k starts at layer[k] and whose slots are slot_stride
// bytes apart in every layer: the one layout both the gathered and the in-place rows are read through
void attn_fill_ptr(attn_ubatch_rows & u, int c, const std::vector<const uint8_t *> & layer, size_t slot_stride) {
    const size_t n_layer = layer.size();
    u.ptr[c].resize((size_t) u.n_slots * n_layer);
    for (size_t slot = 0; slot < (size_t) u.n_slots; ++slot) {
        for (size_t k = 0; k < n_layer; ++k) {
            u.ptr[c][slot * n_layer + k] = layer[k] + slot * slot_stride;
        }
    }
}

// plan.inplace: each selected layer's output [n_kv, 1, n_head, n_stream] of cache c; slot s's rows of layer k
// start at layer k's data + s * n_head * n_kv elements.  In place where the outputs are in host memory and this is
// the decode's last ubatch (a graph output is never overwritten by later nodes of its graph: ggml-alloc.c
// ggml_gallocr_free_node; the next compute on the context's buffers is the next llama_decode), else one
// asynchronous copy per layer into u.buf[c] (layer k at k * its bytes).  Returns false when no host memory is left.
bool attn_extract_layers(attn_ubatch_rows & u, ggml_backend_sched_t sched, const llm_graph_input_attn_cap * inp,
                         int c, bool last, ggml_backend_buffer_type_t & host_buft) {
    const auto & outs = inp->layer_out[c];
    const size_t nb   = ggml_nbytes(outs[0]);
    const bool in_place = last && std::all_of(outs.begin(), outs.end(), [](const ggml_tensor * t) {
        return t->data && t->buffer && ggml_backend_buffer_is_host(t->buffer);
    });
    std::vector<const uint8_t *> base(outs.size());
    if (in_place) {
        for (size_t k = 0; k < outs.size(); ++k) {
            base[k] = (const uint8_t *) outs[k]->data;
        }
        host_buft = ggml_backend_buffer_get_type(outs[0]->buffer);
    } else {
        uint8_t * dst = nullptr;
        for (size_t k = 0; k < outs.size(); ++k) {
            ggml_backend_t backend = ggml_backend_sched_get_tensor_backend(sched, outs[k]);
            GGML_ASSERT(backend != nullptr);
            if (k == 0) { // the buffer is of the first layer's device's host buffer type
                if (!attn_reserve(u.buf[c], attn_host_buft(backend), nb * outs.size())) {
                    return false;
                }
                host_buft = ggml_backend_buffer_get_type(u.buf[c].get());
                dst       = (uint8_t *) ggml_backend_buffer_get_base(u.buf[c].get());
            }
            base[k] = dst + k * nb;
            ggml_backend_tensor_get_async(backend, outs[k], dst + k * nb, 0, nb);
        }
    }
    const size_t n_layer = outs.size();
    attn_fill_ptr(u, c, base, nb / (size_t) inp->plan.n_stream);
    u.nb_layer[c] = n_layer > 1 ? base[1] - base[0] : (int64_t) nb;
    for (size_t k = 1; k < n_layer; ++k) {
        if (base[k] - base[k - 1] != u.nb_layer[c]) {
            u.nb_layer[c] = 0;
        }
    }
    u.size[c]     = nb * n_layer;
    u.in_place[c] = in_place;
    return true;
}

} // namespace

void llama_attn_cap_extract(llama_attn_cap * cap, ggml_backend_sched_t sched, const llm_graph_result * res, bool last) {
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
    if (std::none_of(inp->plan.batch.begin(), inp->plan.batch.end(), [](int32_t b) { return b >= 0; })) {
        return; // a stable-shape ubatch nobody asked rows of: nothing leaves the device
    }
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
        u.size[c] = 0;
        u.n_kv[c]    = inp->n_kv[c];
        u.n_head[c]  = (int32_t) inp->n_head[c];
        u.n_layer[c] = cap->n_sel[c];
        u.in_place[c] = false;
        if (inp->plan.inplace) {
            if (inp->n_done[c] == cap->n_sel[c] && inp->n_done[c] > 0 &&
                !attn_extract_layers(u, sched, inp, c, last, cap->host_buft)) {
                cap->n_captured = -1;
                return;
            }
            continue;
        }
        if (!t || inp->n_done[c] != cap->n_sel[c]) {
            continue;
        }
        ggml_backend_t backend = ggml_backend_sched_get_tensor_backend(sched, t);
        GGML_ASSERT(backend != nullptr);
        ggml_backend_buffer_type_t buft = attn_host_buft(backend);
        if (!attn_reserve(u.buf[c], buft, ggml_nbytes(t))) {
            cap->n_captured = -1;
            return;
        }
        cap->host_buft = ggml_backend_buffer_get_type(u.buf[c].get());
        u.size[c]    = ggml_nbytes(t);
        ggml_backend_tensor_get_async(backend, t, ggml_backend_buffer_get_base(u.buf[c].get()), 0, u.size[c]);
        // [n_kv, n_head, n_layer, n_slots] (PER_LAYER) or [n_kv, n_slots] (MEAN: one "layer")
        const int32_t n_layer = u.format == LLAMA_ATTN_MEAN ? 1 : u.n_layer[c];
        u.nb_layer[c] = (int64_t) u.size[c] / u.n_slots / n_layer;
        const auto * base = (const uint8_t *) ggml_backend_buffer_get_base(u.buf[c].get());
        std::vector<const uint8_t *> layer((size_t) n_layer);
        for (int32_t k = 0; k < n_layer; ++k) {
            layer[k] = base + (size_t) k * (size_t) u.nb_layer[c];
        }
        attn_fill_ptr(u, c, layer, (size_t) n_layer * (size_t) u.nb_layer[c]);
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
    cap->host_only = ctx->get_model().devices.empty();
    cap->cpu_ops   = cap->host_only;
    llama_attn_set_format(ctx, nullptr, 0, LLAMA_ATTN_PER_LAYER, GGML_TYPE_F32, 0);
    return kv ? cap->n_caches : -1;
}

int32_t llama_attn_max_top_k(const llama_context * ctx) {
    return attn_cap_of(ctx) ? ATTN_MAX_TOP_K : 0;
}

bool llama_attn_flash_attn(const llama_context * ctx) {
    return ctx && ctx->get_cparams().flash_attn;
}

int32_t llama_attn_layer_cache(const llama_context * ctx, int32_t il) {
    const llama_attn_cap * cap = attn_cap_of(ctx);
    return cap && il >= 0 && il < cap->n_layer ? cap->cache_of[il] : -1;
}

int32_t llama_attn_set_format(llama_context * ctx, const uint8_t * layers, int32_t n_layers, int32_t format,
                              int32_t type, int32_t top_k) {
    llama_attn_cap * cap = attn_cap_of(ctx);
    if (!cap || (format != LLAMA_ATTN_PER_LAYER && format != LLAMA_ATTN_MEAN && format != LLAMA_ATTN_TOP_K) ||
        (type != GGML_TYPE_F32 && type != GGML_TYPE_F16) || (layers && n_layers != cap->n_layer)) {
        return -1;
    }
    if (format == LLAMA_ATTN_TOP_K && (type != GGML_TYPE_F32 || top_k < 1 || top_k > llama_attn_max_top_k(ctx))) {
        return -1;
    }
    top_k = format == LLAMA_ATTN_TOP_K ? top_k : 0;
    std::vector<uint8_t> sel(cap->n_layer);
    for (int32_t il = 0; il < cap->n_layer; ++il) {
        sel[il] = (!layers || layers[il]) && cap->cache_of[il] >= 0;
    }
    if (sel == cap->sel && format == cap->format && (ggml_type) type == cap->type && top_k == cap->top_k) {
        return 0;
    }
    cap->sel    = std::move(sel);
    cap->format = format;
    cap->type   = (ggml_type) type;
    cap->top_k  = top_k;
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
    if (u.size[cache] == 0) {
        return 1;
    }
    const int64_t es     = u.type == GGML_TYPE_F16 ? 2 : 4;
    const bool    mean   = u.format == LLAMA_ATTN_MEAN;
    const int64_t n_kv   = u.n_kv[cache];
    row->n_kv     = n_kv;
    row->n_layer  = mean ? 1 : u.n_layer[cache];
    row->n_head   = mean ? 1 : u.n_head[cache];
    row->nb_head  = es * n_kv;
    row->nb_layer = u.nb_layer[cache];
    row->type     = u.type;
    row->stream   = slot / u.n_q;
    row->layers   = u.ptr[cache].data() + (size_t) slot * row->n_layer;
    row->data     = row->layers[0];
    row->in_place = u.in_place[cache];
    return 0;
}

int32_t llama_attn_n_captured(const llama_context * ctx) {
    const llama_attn_cap * cap = attn_cap_of(ctx);
    return cap ? cap->n_captured : -1;
}

int32_t llama_attn_set_stable(llama_context * ctx, bool stable) {
    return attn_set_flag(ctx, &llama_attn_cap::stable, stable);
}

int32_t llama_attn_set_in_place(llama_context * ctx, bool in_place) {
    return attn_set_flag(ctx, &llama_attn_cap::in_place, in_place);
}

int32_t llama_attn_set_cpu_ops(llama_context * ctx, bool cpu_ops) {
    const llama_attn_cap * cap = attn_cap_of(ctx);
    if (!cap || (cpu_ops && !cap->host_only)) {
        return -1;
    }
    return attn_set_flag(ctx, &llama_attn_cap::cpu_ops, cpu_ops);
}

const char * llama_attn_host_buffer(const llama_context * ctx) {
    const llama_attn_cap * cap = attn_cap_of(ctx);
    return cap && cap->host_buft ? ggml_backend_buft_name(cap->host_buft) : nullptr;
}

int32_t llama_attn_cuda_graphs(const llama_context * ctx) {
    if (!ctx) {
        return -1;
    }
    int32_t found = -1;
    for (const auto & d : ctx->get_model().devices) {
        ggml_backend_reg_t reg = d.dev ? ggml_backend_dev_backend_reg(d.dev) : nullptr;
        if (!reg || strcmp(ggml_backend_reg_name(reg), "CUDA") != 0) {
            continue;
        }
        found = 0;
        auto get_features = (ggml_backend_get_features_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features");
        for (ggml_backend_feature * f = get_features ? get_features(reg) : nullptr; f && f->name; ++f) {
            if (strcmp(f->name, "USE_GRAPHS") == 0 && getenv("GGML_CUDA_DISABLE_GRAPHS") == nullptr) {
                found = 1; // ggml-cuda.cu: ggml_cuda_graph::is_enabled (compiled in, not disabled by the environment)
            }
        }
    }
    return found;
}
