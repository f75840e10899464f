// slotserve's addition to libllama: post-softmax attention rows as graph outputs.
//
// Copied into llama.cpp's include/ by slotserve's set-up (libllama/README.md); implemented in
// src/llama-attn-graph.cpp (the nodes), src/llama-attn-capture.cpp (the copy to host and this API's
// capture functions), src/llama-attn-kv.cpp (cells, position ranges and releasing an empty stream's memory) and src/llama-attn-state.cpp (restoring
// sequence states).  Nothing here changes what llama.cpp computes: a context that never calls llama_attn_init
// runs exactly as upstream.
//
// Per llama_decode the caller names the batch tokens whose attention it wants (llama_attn_set_rows);
// while the graph of each ubatch is built, every attention layer adds a few nodes that gather those
// tokens' post-softmax rows (or, with flash attention, recompute them for those tokens only:
// softmax(Q K^T * scale + mask) with the main path's soft-capping, ALiBi and sinks) and reduce them
// as llama_attn_set_format asks; the result is one output tensor per KV cache, copied to host memory
// once per ubatch (for a decode step in the per-layer format, each layer's post-softmax tensor itself,
// read in place on a CPU backend).  Rows are indexed by KV *cell* of the token's sequence's stream (its own KV stream
// when kv_unified is false); llama_attn_seq_cells maps positions to cells.
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// ABI of this header; slotserve refuses a libllama whose llama_attn_abi() differs.
#define LLAMA_ATTN_ABI 8

enum llama_attn_format {
    LLAMA_ATTN_PER_LAYER = 0, // [n_layer_sel, n_head, n_kv] per row and KV cache
    LLAMA_ATTN_MEAN      = 1, // [n_kv]: sum over the selected layers and heads / (n_layer_sel_total * n_head)
    LLAMA_ATTN_TOP_K     = 2, // [n_layer_sel, n_head, 2 * k] F32: per head its k largest weights, in no particular
                              // order, then the k cells they are at as F32 values, in the same order (exact below
                              // 2^24; past a row of fewer than k cells weight 0 and cell -1); row.n_kv is 2 * k
};

// A captured row: per layer k, n_head rows of n_kv elements at layers[k] (head h at layers[k] + h * nb_head).
// The memory is host memory owned by the context: a buffer the rows were copied into, or, for a decode step
// (one token per stream, LLAMA_ATTN_PER_LAYER) whose graph outputs are in host memory (CPU backend), those
// output tensors themselves, read in place.  Valid until the next llama_attn_set_rows, llama_decode,
// llama_encode or llama_attn_memory_update (anything that computes a graph on the context): copy or consume
// it before.
struct llama_attn_row {
    const void * data;       // layers[0]
    int64_t      n_kv;       // cells of the row (the KV view of its ubatch; cells past the sequence are 0); 2 * k for
                             // LLAMA_ATTN_TOP_K (its weights, then their cells)
    int32_t      n_layer;    // layers of this KV cache in the row (1 for LLAMA_ATTN_MEAN)
    int32_t      n_head;     // heads per layer (1 for LLAMA_ATTN_MEAN)
    int64_t      nb_layer;   // bytes from one layer to the next when every layer is at one stride (layers[k] ==
                             // data + k * nb_layer), 0 when not (layers in place are wherever the graph put them)
    int64_t      nb_head;    // bytes between two heads
    int32_t      type;       // GGML_TYPE_F32 or GGML_TYPE_F16; elements of a head's row are contiguous
    int32_t      stream;     // the KV stream the cells belong to
    const void * const * layers; // [n_layer]: where each layer's rows start (owned by the context, valid as data)
    int32_t      in_place;   // 1: the memory is the graph's own output tensors (a decode step on a host backend), 0: a copy
};

LLAMA_API int32_t llama_attn_abi(void);

// Arm capture on a context (before its first llama_decode).  Returns the number of KV caches whose
// cells attention rows index (1, or 2 for a sliding-window model: 0 = global layers, 1 = sliding
// layers), or -1 when the context's memory has no KV cache (a recurrent model).
LLAMA_API int32_t llama_attn_init(struct llama_context * ctx);

// Whether the context computes attention with flash attention (what llama.cpp chose for "auto").
LLAMA_API bool llama_attn_flash_attn(const struct llama_context * ctx);

// Apply the KV cache's pending updates now (llama_context::memory_update): the copy of a stream that
// llama_memory_seq_cp across streams enqueued, the K-shift llama_memory_seq_add left; upstream does this
// at the next llama_decode, so a state read before it would hold the stream's old bytes.
LLAMA_API void llama_attn_memory_update(struct llama_context * ctx);

// The KV cache of layer il's attention (see llama_attn_init), -1 for a layer without attention.
LLAMA_API int32_t llama_attn_layer_cache(const struct llama_context * ctx, int32_t il);

// What the next decodes compute: layers[il] != 0 selects layer il (layers == NULL: all), format is a
// llama_attn_format, type GGML_TYPE_F32 or GGML_TYPE_F16 (GGML_TYPE_F32 for LLAMA_ATTN_TOP_K), top_k the k of
// LLAMA_ATTN_TOP_K (1..llama_attn_max_top_k; ignored for the other formats).  Returns 0, or -1 for a bad argument.
LLAMA_API int32_t llama_attn_set_format(struct llama_context * ctx, const uint8_t * layers, int32_t n_layers,
                                        int32_t format, int32_t type, int32_t top_k);
// The largest k of LLAMA_ATTN_TOP_K on this context (64), 0 before llama_attn_init.
LLAMA_API int32_t llama_attn_max_top_k(const struct llama_context * ctx);
// How the graph selects LLAMA_ATTN_TOP_K's weights and sums LLAMA_ATTN_MEAN's heads.  true, the default when the model
// has no GPU device (llama_model's devices empty: the CPU backend computes the whole graph): with CPU operators of
// this patch (ggml_custom_4d, run on the graph's threads right after each layer's softmax, while its rows are in
// cache: per row the top k of the values at least the k-th largest of its groups' maxima, largest first; each
// layer's heads summed in place).  false, the only choice on a model with a device: with ggml's own operators,
// which every backend runs (ggml_top_k and a batched ggml_get_rows; the heads summed once, after the last layer);
// a CPU-only context may choose it too, as a reference.
// Returns 0, or -1 before llama_attn_init or for true on a model with a device.
LLAMA_API int32_t llama_attn_set_cpu_ops(struct llama_context * ctx, bool cpu_ops);

// The batch indices whose rows the next llama_decode captures (n == 0: none).  Clears the previous
// decode's rows.  Returns 0, or -1 for a bad argument.
LLAMA_API int32_t llama_attn_set_rows(struct llama_context * ctx, const int32_t * batch_idx, int32_t n);

// After llama_decode: row i (the i-th index given to llama_attn_set_rows) in KV cache `cache`.
// Returns 0, 1 when the row has no layer of that cache, -1 when it was not captured.
LLAMA_API int32_t llama_attn_get_row(struct llama_context * ctx, int32_t i, int32_t cache, struct llama_attn_row * row);

// Stable graph shape: when true, every ubatch gets the capture's nodes (one row per KV stream, read by
// nobody, where no row is asked), so decodes with and without capture build the same graph and llama.cpp
// reuses it (and a CUDA backend keeps its CUDA graph).  Costs those nodes' work on every ubatch.
// Returns 0, or -1 before llama_attn_init.
LLAMA_API int32_t llama_attn_set_stable(struct llama_context * ctx, bool stable);

// Decode steps read in place (default true): a ubatch with one token per KV stream, in LLAMA_ATTN_PER_LAYER, takes
// each selected layer's post-softmax tensor ([n_kv, 1, n_head, n_stream]; with flash attention the recomputed rows)
// as its output, with no gather and no copy into one tensor; false: those ubatches gather their rows as prefill
// chunks do (the same values, more copies: a reference for comparisons).  Returns 0, or -1 before llama_attn_init.
LLAMA_API int32_t llama_attn_set_in_place(struct llama_context * ctx, bool in_place);

// The name of the host buffer type the last captured rows were copied into ("CUDA_Host": pinned memory;
// "CPU": pageable), or NULL before the first copy.
LLAMA_API const char * llama_attn_host_buffer(const struct llama_context * ctx);

// Whether the model's CUDA devices run graphs as CUDA graphs: 1 when the CUDA backend was built with them
// (ggml_backend_get_features: USE_GRAPHS) and GGML_CUDA_DISABLE_GRAPHS is unset, 0 when not, -1 when the
// model uses no CUDA device.  (ggml-cuda may still run a graph without one while it warms up or on a GPU
// older than Volta.)
LLAMA_API int32_t llama_attn_cuda_graphs(const struct llama_context * ctx);

// Attention layers captured by the last llama_decode's graphs (a start-up check), or -1 after an error.
LLAMA_API int32_t llama_attn_n_captured(const struct llama_context * ctx);

// cells[p - p0] = the cell (within its stream) of position p of seq_id in KV cache `cache`, for
// p0 <= p < p0 + n; -1 where the cache holds no such position.  Returns how many were found, or -1.
LLAMA_API int32_t llama_attn_seq_cells(struct llama_context * ctx, int32_t cache, llama_seq_id seq_id, llama_pos p0,
                                       int32_t n, int32_t * cells);

// The KV of positions [p0, p1) of seq_id in KV cache `cache` (see llama_attn_init), written to dst as the stream
// record llama_state_seq_get_data writes for those cells (src/llama-kv-cache.cpp state_write_meta/_data):
//   u32 cell_count | cell_count x (i32 pos | u32 1 | [llama_kv_cell_ext] | i32 seq_id) | u32 v_trans | u32 n_layer
//   | per layer: i32 k_type | u64 k_row_bytes | cell_count K rows
//   | per layer with V: i32 v_type | u64 v_row_bytes | cell_count V rows                 (v_trans 0)
//                    or i32 v_type | u32 v_elem_bytes | u32 n_embd_v_gqa | per embedding row cell_count elements (v_trans 1)
// (cell_count 0: the u32 alone).  The cells are those state_write would write (not masked by the cache's sliding
// window) in position order, where state_write writes cell order: for a sequence whose cells ascend with their
// positions, the range [0, INT32_MAX) is byte for byte the record of llama_state_seq_get_data.  The rows are read
// with ggml_backend_tensor_get(_2d) per run of consecutive cells (device memory is read in place, nothing else
// copied).  dst == NULL: returns the bytes needed; else the bytes written, or -1 for a bad argument or a dst of
// fewer than the bytes needed.  Call llama_attn_memory_update first when a seq_cp/seq_add may be pending.
LLAMA_API int64_t llama_attn_seq_range_get(struct llama_context * ctx, int32_t cache, llama_seq_id seq_id, llama_pos p0,
                                           llama_pos p1, uint8_t * dst, size_t size);

// Give the memory of the KV streams of the n_seq_ids sequences at seq_ids back to the kernel, each while its sequence
// holds no cells.  llama.cpp allocates every stream of every layer's K and V tensor ([n_embd_gqa, kv_size, n_stream]:
// a stream is the outermost dimension, one range of nb[2] bytes at stream * nb[2]) when the context is made and
// clears the whole buffer (src/llama-kv-cache.cpp, llama_kv_cache's constructor: ggml_backend_buffer_clear(buf, 0)),
// so every page of every stream is resident from the start.  This synchronizes once and applies the context's
// pending KV updates (a stream copy, a K-shift: llama_attn_memory_update), then, for every KV cache of the memory
// (two for a sliding-window model) and every listed sequence holding no cells in any of them, gives the page-aligned
// interior of its stream's range of each layer's K and V tensor back with madvise(MADV_DONTNEED) (Linux madvise(2):
// private anonymous memory reads back as zeros, what the clear wrote, and is allocated again page by page as cells
// are written).  Returns the bytes given back (resident or not; a sequence listed twice counts once), 0 where it
// does nothing: n_seq_ids is 0, every listed sequence holds cells in some KV cache (those are skipped), a cache is
// unified (kv_unified: one stream for every sequence), a tensor is not in the CPU buffer type's memory (a GPU,
// pinned host memory), a non-Linux build; -1, giving nothing back, for a bad argument (n_seq_ids < 0, seq_ids NULL
// with n_seq_ids > 0, a sequence id outside [0, n_seq_max)).  A context that shares another context's KV cells
// (cparams.ctx_other) must not call it.
LLAMA_API int64_t llama_attn_kv_seqs_release(struct llama_context * ctx, const llama_seq_id * seq_ids, int32_t n_seq_ids);

// One piece of a sequence state for llama_attn_state_seq_read: `size` bytes at `data`, or, when data is NULL,
// `size` bytes of the file llama_attn_state_seq_read is given, from its byte `offset`.
struct llama_attn_state_piece {
    const void * data;
    int64_t      offset;
    uint64_t     size;
};

// llama_state_seq_set_data of the n_pieces pieces read in order as one state, without joining them: a state whose
// stream counts differ from this context's (slotserve keeps a sequence's state as one stream, a context with one KV
// stream per sequence reads one record per stream) is given as pieces with its counts rewritten and empty records
// added, and a slot file's records as pieces of the file open as `fd` (read through a read-only mapping of the file,
// straight into a KV tensor in host memory: one copy where llama_state_seq_load_file reads into a buffer of one
// tensor's bytes and copies that; pread through a 256 KiB buffer where the file cannot be mapped; a page past the
// file's end, which raises SIGBUS, is caught while the state is read and refused as a file cut short; fd < 0:
// memory pieces only).  Each K/V block is written into the KV cache as soon as it is read
// (src/llama-kv-cache.cpp state_read_data's layout).  With
// check_values, each block of F32/F16/BF16 K and V values (a KV cache's cache_*k_l<il>/cache_*v_l<il> tensors) is
// tested for NaN and infinity (all exponent bits set) before it is written, while it is in cache; quantized types
// and a recurrent memory's tensors are not tested.  Returns the bytes read, or 0 on failure with why in err (at
// most err_size bytes, NUL-terminated; "the state's K cache of layer 3 holds NaN or infinite values" for a value
// refused).  On a failure inside a KV cache's record llama.cpp removes the sequence from that cache and zeroes
// the K/V it wrote (llama_kv_cache::state_clear), so no refused value stays in any cell; what an earlier KV cache
// of the same state took (a sliding-window model has two) stays until the caller removes the sequence.
LLAMA_API size_t llama_attn_state_seq_read(struct llama_context * ctx, const struct llama_attn_state_piece * pieces,
                                           int32_t n_pieces, int32_t fd, llama_seq_id seq_id, bool check_values,
                                           char * err, size_t err_size);

#ifdef __cplusplus
}
#endif
