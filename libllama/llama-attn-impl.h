// slotserve: the state the attention capture shares between its files (llama-attn-graph.cpp builds the
// nodes, llama-attn-capture.cpp copies them out and serves the C API, llama-attn-kv.cpp reads the KV cache).
// Copied into llama.cpp's src/ by slotserve's set-up (libllama/README.md); not a public header.
#pragma once

#include "llama-attn.h"

#include "ggml-cpp.h"
#include "llama-graph.h"

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

struct llama_kv_cache;

constexpr int ATTN_MAX_CACHES = 2;
constexpr int32_t ATTN_MAX_TOP_K = 64; // LLAMA_ATTN_TOP_K's largest k

// one ubatch's captured rows in host memory: per KV cache one buffer of the device's host buffer type
// (pinned memory for CUDA: ggml_backend_dev_host_buffer_type, as llama.cpp's own output buffer), kept
// and reused across decodes, grown when a ubatch needs more
struct attn_ubatch_rows {
    int32_t n_q      = 0;
    int32_t n_slots  = 0;
    int32_t format   = LLAMA_ATTN_PER_LAYER;
    ggml_type type   = GGML_TYPE_F32;
    int64_t n_kv[ATTN_MAX_CACHES]    = {0, 0};
    int32_t n_head[ATTN_MAX_CACHES]  = {0, 0};
    int32_t n_layer[ATTN_MAX_CACHES] = {0, 0};
    size_t  size[ATTN_MAX_CACHES]    = {0, 0}; // bytes of this ubatch's rows (0: none)
    ggml_backend_buffer_ptr buf[ATTN_MAX_CACHES];
    // [n_slots * n_layer]: where each slot's layer starts (in buf, or in place in a graph output's host memory)
    std::vector<const void *> ptr[ATTN_MAX_CACHES];
    int64_t nb_layer[ATTN_MAX_CACHES] = {0, 0}; // bytes between two layers of a slot, 0 when not one stride
    bool in_place[ATTN_MAX_CACHES] = {false, false}; // ptr points into the graph's output tensors
};

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
    int32_t top_k = 0;             // LLAMA_ATTN_TOP_K's k

    // the model has no GPU device: the CPU backend computes the whole graph, so the capture may add CPU
    // operators (the top-k selection, MEAN's sum over heads: llama-attn-graph.cpp)
    bool host_only = false;
    // llama_attn_set_cpu_ops: the capture uses those CPU operators (host_only by default), else ggml's own
    bool cpu_ops = false;

    // llama_attn_set_stable: every ubatch gets the capture's nodes (one row per stream when none is asked)
    bool stable = false;
    // llama_attn_set_in_place: decode steps' rows are each layer's post-softmax tensor (else gathered as for prefill)
    bool in_place = true;

    // llama_attn_set_rows
    std::vector<int32_t> rows;     // batch indices in the caller's order
    std::vector<int32_t> row_of;   // batch index -> position in rows, -1

    // what the decode captured
    std::vector<attn_ubatch_rows> outs;
    size_t n_outs = 0;
    std::vector<std::pair<int32_t, int32_t>> loc; // per row: (index in outs, slot), (-1, -1)
    int32_t n_captured = 0;
    ggml_backend_buffer_type_t host_buft = nullptr; // of the last copy (llama_attn_host_buffer)
};

// Per ubatch the captured tokens are laid out in "slots" (llama-attn-graph.cpp)
struct attn_plan {
    int32_t n_stream = 1;
    int32_t n_tps    = 0;
    int32_t n_q      = 0;
    bool    inplace  = false;   // PER_LAYER or TOP_K with one token per stream: each layer's own tensor is the output
    std::vector<int32_t> row;   // [n_stream*n_q]: row within the stream
    std::vector<int32_t> batch; // [n_stream*n_q]: batch index, -1 for a repeated row or a row nobody asked
};

void attn_make_plan(const llama_attn_cap & cap, bool kv_unified, const llama_ubatch & ub, attn_plan & p);

// the graph input of the capture: the row indices of the captured tokens, reused with the graph
class llm_graph_input_attn_cap : public llm_graph_input_i {
public:
    llm_graph_input_attn_cap(llama_attn_cap * cap, bool kv_unified) : cap(cap), kv_unified(kv_unified), serial(cap->serial) {}

    void set_input(const llama_ubatch * ubatch) override;
    bool can_reuse(const llm_graph_params & params) override;

    ggml_tensor * get_idx_h(ggml_context * ctx, int64_t n_head);
    ggml_tensor * get_idx_m(ggml_context * ctx);
    // the mask rows of the captured tokens, gathered once per mask (per KV cache), not per layer
    ggml_tensor * get_mask_rows(ggml_context * ctx, ggml_tensor * kq_mask);

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
    std::vector<ggml_tensor *> layer_out[ATTN_MAX_CACHES]; // plan.inplace: per selected layer [n_kv, 1, n_head, n_stream]
    int64_t n_kv[ATTN_MAX_CACHES]      = {0, 0};
    int64_t n_head[ATTN_MAX_CACHES]    = {0, 0};
    int32_t n_done[ATTN_MAX_CACHES]    = {0, 0};
    int32_t n_captured = 0;
};

// llama-attn-kv.cpp: the KV cache whose cells rows of cache `cache` index (0: global/only, 1: sliding), or nullptr
const llama_kv_cache * attn_kv_cache_of(const llama_context * ctx, int32_t cache);
bool attn_is_iswa(const llama_context * ctx);

// llama-attn-file.cpp: a byte range of a file read through a read-only mapping (llama-attn-state.cpp's slot files).
// attn_file_guard: held while a state is read from a file (one at a time): a SIGBUS handler installed, which turns
// a fault on a page of the mapping past the file's end (a file cut short, or cut while it is read) into
// attn_file_load's -1.
struct attn_file_guard {
    attn_file_guard();
    ~attn_file_guard();
    attn_file_guard(const attn_file_guard &) = delete;
    attn_file_guard & operator=(const attn_file_guard &) = delete;

private:
    std::unique_lock<std::mutex> lock;
    bool installed = false;
};

// `size` bytes of file `fd` from byte `offset` at `data`, mapped read-only (from a page boundary), or none
struct attn_file_view {
    const uint8_t * data = nullptr;

    // map them (the previous range unmapped first); false where the file cannot be mapped
    bool map(int fd, int64_t offset, uint64_t size);
    void unmap();
    ~attn_file_view() { unmap(); }

private:
    uint8_t * base = nullptr;
    size_t    len_ = 0;
};

// dst <- the n bytes at src (in a mapping, under an attn_file_guard), tested first with bad(arg, src, n) when bad is
// given: 1 copied, 0 refused by bad (nothing copied), -1 a fault: the file ended under the mapping
int attn_file_load(uint8_t * dst, const uint8_t * src, size_t n, bool (*bad)(void *, const uint8_t *, size_t),
                   void * arg);
