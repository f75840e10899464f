// slotserve: the two places llama.cpp calls into the attention capture (llama-attn.cpp).
// Copied into llama.cpp's src/ by slotserve's set-up (libllama/README.md).
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

struct llama_attn_cap;
struct llm_graph_context;
class llm_graph_result;

// From llm_graph_context::build_attn_mha, once per attention layer, after q and k are permuted to
// [n_embd_head, n_tokens/n_stream, n_head, n_stream] / [n_embd_head, n_kv, n_head_kv, n_stream]:
// kq is the post-softmax attention [n_kv, n_tokens/n_stream, n_head, n_stream] (flash attention
// off) or nullptr (flash attention on: the rows are recomputed for the captured tokens).
void llama_attn_cap_layer(const llm_graph_context & gctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * kq_mask,
                          ggml_tensor * kq, ggml_tensor * sinks, float kq_scale, int il);

// From llama_context::decode, after each ubatch's graph was computed: copy its capture outputs to host.
// last: no other ubatch of this llama_decode follows, so nothing computes in the graph's buffers before the
// next llama_decode (outputs in host memory are then read in place instead of copied).
void llama_attn_cap_extract(llama_attn_cap * cap, ggml_backend_sched_t sched, const llm_graph_result * res, bool last);

// From llama_context::~llama_context.
void llama_attn_cap_free(llama_attn_cap * cap);
