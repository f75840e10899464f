/* The C side of attention capture (see engine/evalfilter.py and engine/capture.py).
 *
 * ggml_backend_sched asks the eval callback about every graph node (~1,100 per decode of
 * SmolLM2), and capture needs the rows of 30 of them; doing that in Python costs
 * milliseconds per token.  This callback:
 *   - answers every node question in C;
 *   - forwards to Python only layer 0's SET_ROWS into "cache_k_l0" (once per ubatch: the
 *     cells the ubatch writes, and the place where Python sets up the rows to copy) and,
 *     when Python asks for it (mask reads), "kq_soft_max-0";
 *   - copies the requested rows of every "kq_soft_max-{il}" itself, into buffers that
 *     Python owns: dst[i][il][h][0..n_kv).  One ggml_backend_tensor_get_2d per row and
 *     layer reads the row of every head (host and device buffers alike): on CUDA that is
 *     one cudaMemcpy2DAsync + synchronize instead of one per head; on CPU ggml loops over
 *     the heads with plain copies, as before.
 * Struct offsets come from Python (the ggml.h mirror in engine/ggml_ffi.py), so no ggml
 * header is needed.  It is a Python extension module only so that setuptools builds it;
 * Python calls it through ctypes.
 */
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SLOTSERVE_MAX_ROWS 256

typedef bool (*eval_callback)(void *tensor, bool ask, void *user_data);
/* ggml_backend_tensor_get_2d (ggml/include/ggml-backend.h): n_copies runs of size bytes, the
 * i-th from offset + i*stride_tensor in the tensor to data + i*stride_data */
typedef void (*tensor_get_2d_fn)(const void *tensor, void *data, size_t offset, size_t size, size_t n_copies,
                                 size_t stride_tensor, size_t stride_data);

struct slotserve_filter {
    eval_callback forward;   /* the Python callback */
    void *forward_data;
    tensor_get_2d_fn tensor_get_2d;
    int64_t off_name;        /* offsetof(struct ggml_tensor, name) */
    int64_t off_op;          /* offsetof(struct ggml_tensor, op) */
    int64_t off_ne;          /* offsetof(struct ggml_tensor, ne) */
    int32_t op_set_rows;     /* GGML_OP_SET_ROWS */
    int32_t forward_l0;      /* forward kq_soft_max-0 to Python too */
    int32_t n_layer;
    int32_t n_head;
    int64_t cap_kv;          /* row capacity of every dst buffer, floats */
    int32_t n_rows;          /* rows of the current ubatch to copy */
    int32_t error;           /* 1: n_kv > cap_kv, 2: bad shape or name, 3: too many rows */
    int64_t n_copied;        /* softmax nodes copied */
    int32_t rows[SLOTSERVE_MAX_ROWS];      /* row (token) index within the ubatch */
    float *dst[SLOTSERVE_MAX_ROWS];        /* [n_layer][n_head][cap_kv] */
    int32_t row_n_kv[SLOTSERVE_MAX_ROWS];  /* written here: n_kv of the row's ubatch */
};

static void copy_rows(struct slotserve_filter *f, void *t, const char *name) {
    const int64_t *ne = (const int64_t *)((const char *)t + f->off_ne);
    const int64_t n_kv = ne[0], n_tok = ne[1], n_head = ne[2];
    char *end = NULL;
    long il = strtol(name + 12, &end, 10);
    if (end == name + 12 || il < 0 || il >= f->n_layer || n_head != f->n_head || ne[3] != 1) {
        f->error = 2;
        return;
    }
    if (n_kv > f->cap_kv) {
        f->error = 1;
        return;
    }
    const size_t row_bytes = (size_t)n_kv * sizeof(float);
    for (int32_t i = 0; i < f->n_rows; i++) {
        const int64_t r = f->rows[i];
        if (r < 0 || r >= n_tok) {
            f->error = 2;
            return;
        }
        float *base = f->dst[i] + (size_t)il * (size_t)n_head * (size_t)f->cap_kv;
        /* head h's row r is at (h * n_tok + r) * row_bytes; it goes to base + h * cap_kv */
        f->tensor_get_2d(t, base, (size_t)r * row_bytes, row_bytes, (size_t)n_head, (size_t)n_tok * row_bytes,
                         (size_t)f->cap_kv * sizeof(float));
        f->row_n_kv[i] = (int32_t)n_kv;
    }
    f->n_copied++;
}

bool slotserve_eval_filter(void *tensor, bool ask, void *user_data) {
    struct slotserve_filter *f = (struct slotserve_filter *)user_data;
    const char *name = (const char *)tensor + f->off_name;
    const bool softmax = strncmp(name, "kq_soft_max-", 12) == 0;
    const bool layer0 = softmax && name[12] == '0' && name[13] == '\0';
    if (ask) {
        if (softmax) {
            bool need = f->n_rows > 0;
            if (layer0 && f->forward_l0) {
                need = f->forward(tensor, true, f->forward_data) || need;
            }
            return need;
        }
        if (strncmp(name, "cache_k_l0 ", 11) == 0 &&
            *(const int *)((const char *)tensor + f->off_op) == f->op_set_rows) {
            f->forward(tensor, true, f->forward_data);
        }
        return false;
    }
    if (softmax) {
        if (f->n_rows > 0) {
            copy_rows(f, tensor, name);
        }
        if (layer0 && f->forward_l0) {
            return f->forward(tensor, false, f->forward_data);
        }
    }
    return true;
}

/* Layout version of struct slotserve_filter and its callbacks; engine/evalfilter.py refuses a build
 * without this symbol or with another number (a stale build from before a layout change). */
int slotserve_filter_abi(void) { return 2; }

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_evalfilter", "C side of attention capture", -1, NULL};

PyMODINIT_FUNC PyInit__evalfilter(void) { return PyModule_Create(&module); }
