// slotserve: reading one sequence's KV cache (llama-attn.h).  One reason to patch: the KV cache's host-side
// cell metadata and the KV of a position range of one sequence (llama.cpp reads whole sequences only:
// llama_state_seq_get_data), and giving an empty sequence's KV stream back to the kernel (llama.cpp allocates
// and clears every stream when the context is made).  Restoring a state: llama-attn-state.cpp.
//
// Copied into llama.cpp's src/ by slotserve's set-up.  Nothing here is called by llama.cpp itself.

#include "llama-attn-impl.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-kv-cache-iswa.h"
#include "llama-kv-cache.h"
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-model.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

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

bool attn_is_iswa(const llama_context * ctx) {
    llama_memory_i * mem = ctx->get_memory();
    return dynamic_cast<llama_kv_cache_iswa *>(mem) || dynamic_cast<llama_memory_hybrid_iswa *>(mem);
}

void llama_attn_memory_update(llama_context * ctx) {
    if (ctx) {
        ctx->memory_update(false);
    }
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

namespace {

// layer il's V tensor (all streams) of `kv`, taken from a view (llama_kv_cache has get_k_storage only); nullptr for
// an MLA cache, which has no V tensors (llama_kv_cache's constructor: has_v)
ggml_tensor * attn_v_storage(const llama_kv_cache * kv, const llama_hparams & hp, ggml_context * gctx, uint32_t il) {
    if (hp.is_mla()) {
        return nullptr;
    }
    llama_kv_cache::slot_info sinfo;
    sinfo.s0 = sinfo.s1 = 0;
    sinfo.strm = {0};
    sinfo.idxs = {{0}};
    ggml_tensor * view = kv->get_v(gctx, (int32_t) il, 1, sinfo);
    return view->view_src ? view->view_src : view;
}

// what llama_attn_seq_range_get writes, measured before anything is copied
struct attn_range_plan {
    std::vector<uint32_t> cells;                       // the range's cells, in position order
    std::vector<std::pair<uint32_t, uint32_t>> runs;   // (index in cells, length) of runs of consecutive cells
    std::vector<uint32_t> layer_ids;
    std::vector<ggml_tensor *> k, v;                   // [layer]: the cache's K and V tensors (all streams)
    size_t size = 0;
};

// the cells of positions [p0, p1) of seq_id that llama_kv_cache::state_write would write: not empty and not
// masked by the cache's sliding window (src/llama-kv-cache.cpp), in position order (state_write: cell order)
bool attn_range_plan_make(llama_context * ctx, int32_t cache, const llama_kv_cache * kv, llama_seq_id seq_id,
                          llama_pos p0, llama_pos p1, ggml_context * gctx, attn_range_plan & plan) {
    const llama_hparams & hp = ctx->get_model().hparams;
    // the sliding window of this cache: an iswa's global cache has none (llama_kv_cache_iswa's constructor)
    const bool has_swa = !(attn_is_iswa(ctx) && cache == 0);
    const uint32_t n_swa = has_swa ? hp.n_swa : 0;
    const llama_swa_type swa_type = has_swa ? hp.swa_type : LLAMA_SWA_TYPE_NONE;

    const llama_kv_cells & cells = kv->get_cells(seq_id);
    const llama_pos pos_max = cells.seq_pos_max(seq_id);
    for (const auto & [pos, i] : cells.seq_pos_get(seq_id)) {
        if (pos < p0) {
            continue;
        }
        if (pos >= p1) {
            break;
        }
        if (!llama_hparams::is_masked_swa(n_swa, swa_type, pos, pos_max)) {
            plan.cells.push_back(i);
        }
    }
    const size_t n = plan.cells.size();
    plan.size = sizeof(uint32_t); // cell_count
    if (n == 0) {
        return true;
    }
    for (size_t r = 0; r < n; ++r) {
        if (r > 0 && plan.cells[r] == plan.cells[r - 1] + 1) {
            plan.runs.back().second++;
        } else {
            plan.runs.emplace_back((uint32_t) r, 1);
        }
    }
    const size_t meta = sizeof(llama_pos) + sizeof(uint32_t) + sizeof(llama_seq_id) +
                        (kv->has_cell_ext() ? sizeof(llama_kv_cell_ext) : 0);
    plan.size += n * meta + 2 * sizeof(uint32_t); // cells, v_trans, n_layer
    plan.layer_ids = kv->get_layer_ids();
    for (const uint32_t il : plan.layer_ids) {
        ggml_tensor * k = kv->get_k_storage((int32_t) il);
        plan.k.push_back(k);
        plan.size += sizeof(int32_t) + sizeof(uint64_t) + n * ggml_row_size(k->type, hp.n_embd_k_gqa(il));
        plan.v.push_back(attn_v_storage(kv, hp, gctx, il));
    }
    return true;
}

} // namespace

int64_t llama_attn_seq_range_get(llama_context * ctx, int32_t cache, llama_seq_id seq_id, llama_pos p0, llama_pos p1,
                                 uint8_t * dst, size_t size) {
    const llama_kv_cache * kv = ctx ? attn_kv_cache_of(ctx, cache) : nullptr;
    if (!kv || seq_id < 0 || (uint32_t) seq_id >= ctx->get_cparams().n_seq_max || p0 < 0 || p1 < p0) {
        return -1;
    }
    llama_synchronize(ctx);
    // room for one V view per layer (attn_range_plan_make takes each V tensor from its view)
    const ggml_init_params ip = {ggml_tensor_overhead() * (kv->get_layer_ids().size() + 1), nullptr, true};
    ggml_context_ptr gctx(ggml_init(ip));
    attn_range_plan plan;
    const llama_hparams & hp = ctx->get_model().hparams;
    try {
        attn_range_plan_make(ctx, cache, kv, seq_id, p0, p1, gctx.get(), plan);
        // V: the same bytes transposed or not (cells * row bytes), and a 12-byte header either way
        const uint32_t n = (uint32_t) plan.cells.size();
        for (size_t l = 0; l < plan.v.size(); ++l) {
            if (plan.v[l]) {
                plan.size += sizeof(int32_t) + sizeof(uint64_t) +
                             (size_t) n * ggml_row_size(plan.v[l]->type, hp.n_embd_v_gqa(plan.layer_ids[l]));
            }
        }
        if (!dst) {
            return (int64_t) plan.size;
        }
        if (size < plan.size) {
            return -1;
        }
        const llama_kv_cells & cells = kv->get_cells(seq_id);
        const uint32_t strm = kv->get_stream(seq_id);
        const uint32_t kv_size = kv->get_size();
        uint8_t * out = dst;
        auto put = [&](const void * src, size_t len) {
            memcpy(out, src, len);
            out += len;
        };
        put(&n, sizeof(n));
        if (n == 0) {
            return (int64_t) (out - dst);
        }
        const uint32_t n_seq_id = 1;
        for (const uint32_t i : plan.cells) { // state_write_meta
            const llama_pos pos = cells.pos_get(i);
            put(&pos, sizeof(pos));
            put(&n_seq_id, sizeof(n_seq_id));
            if (kv->has_cell_ext()) {
                const llama_kv_cell_ext ext = cells.ext_get(i);
                put(&ext, sizeof(ext));
            }
            put(&seq_id, sizeof(seq_id));
        }
        // state_write_data; a context's caches store V transposed exactly without flash attention
        // (llama_model::create_memory: attn_v_trans = !cparams.flash_attn), as [kv_size] per embedding row
        const uint32_t v_trans = ctx->get_cparams().flash_attn ? 0 : 1;
        const uint32_t n_layer = (uint32_t) plan.layer_ids.size();
        put(&v_trans, sizeof(v_trans));
        put(&n_layer, sizeof(n_layer));
        for (size_t l = 0; l < plan.k.size(); ++l) {
            ggml_tensor * k = plan.k[l];
            const int32_t k_type = (int32_t) k->type;
            const uint64_t k_row = ggml_row_size(k->type, hp.n_embd_k_gqa(plan.layer_ids[l]));
            put(&k_type, sizeof(k_type));
            put(&k_row, sizeof(k_row));
            for (const auto & [r, len] : plan.runs) {
                ggml_backend_tensor_get(k, out + (size_t) r * k_row, strm * k->nb[2] + plan.cells[r] * k_row, len * k_row);
            }
            out += (size_t) n * k_row;
        }
        for (size_t l = 0; l < plan.v.size(); ++l) {
            ggml_tensor * v = plan.v[l];
            if (!v) {
                continue;
            }
            const uint32_t n_embd_v = hp.n_embd_v_gqa(plan.layer_ids[l]);
            const int32_t v_type = (int32_t) v->type;
            put(&v_type, sizeof(v_type));
            if (!v_trans) {
                const uint64_t v_row = ggml_row_size(v->type, n_embd_v);
                put(&v_row, sizeof(v_row));
                for (const auto & [r, len] : plan.runs) {
                    ggml_backend_tensor_get(v, out + (size_t) r * v_row, strm * v->nb[2] + plan.cells[r] * v_row, len * v_row);
                }
                out += (size_t) n * v_row;
            } else {
                const uint32_t v_el = (uint32_t) ggml_type_size(v->type);
                put(&v_el, sizeof(v_el));
                put(&n_embd_v, sizeof(n_embd_v));
                // per embedding row j: the run's elements, row j of the stream at (j*kv_size + cell)*v_el
                for (const auto & [r, len] : plan.runs) {
                    ggml_backend_tensor_get_2d(v, out + (size_t) r * v_el, strm * v->nb[2] + (size_t) plan.cells[r] * v_el,
                                               (size_t) len * v_el, n_embd_v, (size_t) kv_size * v_el, (size_t) n * v_el);
                }
                out += (size_t) n * n_embd_v * v_el;
            }
        }
        return (int64_t) (out - dst);
    } catch (const std::exception & err) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, err.what());
        return -1;
    }
}

int64_t llama_attn_kv_seqs_release(llama_context * ctx, const llama_seq_id * seq_ids, int32_t n_seq_ids) {
    if (!ctx || n_seq_ids < 0 || (n_seq_ids > 0 && !seq_ids)) {
        return -1;
    }
    const uint32_t n_seq_max = ctx->get_cparams().n_seq_max;
    if (std::any_of(seq_ids, seq_ids + n_seq_ids, [n_seq_max](llama_seq_id s) { return s < 0 || (uint32_t) s >= n_seq_max; })) {
        return -1;
    }
#if defined(__linux__)
    if (n_seq_ids == 0) {
        return 0;
    }
    llama_synchronize(ctx); // once for every sequence
    ctx->memory_update(false); // a pending stream copy out of one of these streams reads it first
    const llama_hparams & hp = ctx->get_model().hparams;
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    const ggml_backend_buffer_type_t cpu = ggml_backend_cpu_buffer_type();
    std::set<std::pair<uintptr_t, uintptr_t>> ranges; // page-aligned [begin, end), once each (shared layers)
    std::vector<const llama_kv_cache *> caches;
    for (int32_t c = 0; c < ATTN_MAX_CACHES; ++c) {
        const llama_kv_cache * kv = attn_kv_cache_of(ctx, c);
        if (kv && kv->get_n_stream() < 2) {
            return 0; // one stream shared by every sequence (kv_unified)
        }
        if (kv) {
            caches.push_back(kv);
        }
    }
    // the sequences holding no cells in any KV cache (the others keep their streams)
    std::vector<llama_seq_id> empty;
    for (int32_t i = 0; i < n_seq_ids; ++i) {
        const llama_seq_id s = seq_ids[i];
        if (std::none_of(caches.begin(), caches.end(), [s](const llama_kv_cache * kv) { return kv->get_cells(s).get_used() > 0; })) {
            empty.push_back(s);
        }
    }
    if (empty.empty()) {
        return 0;
    }
    try {
        for (const llama_kv_cache * kv : caches) {
            const ggml_init_params ip = {ggml_tensor_overhead() * (kv->get_layer_ids().size() + 1), nullptr, true};
            ggml_context_ptr gctx(ggml_init(ip));
            std::vector<const ggml_tensor *> tensors;
            for (const uint32_t il : kv->get_layer_ids()) {
                tensors.push_back(kv->get_k_storage((int32_t) il));
                tensors.push_back(attn_v_storage(kv, hp, gctx.get(), il));
            }
            for (const ggml_tensor * t : tensors) {
                if (!t || !t->buffer || !t->data || ggml_backend_buffer_get_type(t->buffer) != cpu) {
                    continue; // device memory (CUDA), pinned host memory, or no buffer
                }
                for (const llama_seq_id s : empty) {
                    const uintptr_t b = (uintptr_t) t->data + (uintptr_t) kv->get_stream(s) * t->nb[2];
                    const uintptr_t begin = (b + page - 1) / page * page;
                    const uintptr_t end = (b + t->nb[2]) / page * page;
                    if (end > begin) {
                        ranges.emplace(begin, end);
                    }
                }
            }
        }
    } catch (const std::exception & err) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, err.what());
        return -1;
    }
    int64_t released = 0;
    for (const auto & [begin, end] : ranges) {
        if (madvise((void *) begin, end - begin, MADV_DONTNEED) == 0) {
            released += (int64_t) (end - begin);
        } else {
            LLAMA_LOG_WARN("%s: madvise(MADV_DONTNEED) of %zu bytes failed: %s\n", __func__, (size_t) (end - begin),
                           strerror(errno));
        }
    }
    return released;
#else
    return 0;
#endif
}
