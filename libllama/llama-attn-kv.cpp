// slotserve: reading and restoring one sequence's KV cache (llama-attn.h).  One reason to patch: the KV
// cache's host-side cell metadata and a sequence state given as pieces, which llama.cpp's whole-buffer
// state functions (llama_state_seq_set_data) do not take.
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

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

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

namespace {

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

} // namespace

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
