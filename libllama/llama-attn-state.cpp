// slotserve: restoring one sequence's state from memory and from a file in one pass (llama-attn.h,
// llama_attn_state_seq_read).  One reason to patch: llama.cpp's own readers (llama_state_seq_set_data,
// llama_state_seq_load_file in src/llama-context.cpp) take one whole buffer or one whole file, write what
// they read without looking at it, and llama_state_seq_load_file aborts the process on a file cut short;
// slotserve hands a state over as pieces (its stream count rewritten: llama-attn.h), reads slot files
// through a mapping (llama-attn-file.cpp: one copy, and a file cut while it is read is refused), and refuses
// K/V values that are NaN or infinite before they reach the KV cache (one of them in a free cell is enough to
// poison every later decode of the stream: a masked cell's V is multiplied by its weight 0, and NaN * 0 is NaN).
//
// Copied into llama.cpp's src/ by slotserve's set-up.  Nothing here is called by llama.cpp itself.

#include "llama-attn-impl.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-memory.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef _WIN32
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace {

constexpr size_t ATTN_FILE_WINDOW = 256u << 10; // a file piece that cannot be mapped is read through this much memory
constexpr size_t ATTN_CHECK_BLOCK = 64u << 10; // tested, then written, while in cache

// the K/V values of one tensor tested for NaN/infinity: a value is non-finite exactly when all its
// exponent bits are set (F32 0x7f800000, F16 0x7c00, BF16 0x7f80: ggml/include/ggml.h's types)
struct attn_value_check {
    size_t   esize = 0; // 0: not tested (a quantized type, or not a K/V tensor)
    uint32_t mask  = 0;
    uint8_t  carry[4] = {0, 0, 0, 0}; // an element split between two spans
    size_t   n_carry = 0;

    // whether any of the n words at p is non-finite: (w & mask) + its lowest bit carries into the word's top bit
    // exactly when every bit of mask is set (mask is the exponent, just below the top bit); one AND, ADD and OR
    // per word in the word's own width, which the compiler vectorizes
    template <typename W> static bool any_nonfinite(const uint8_t * p, size_t n, W mask) {
        const W low = (W) (mask & (W) (~mask + 1));
        W acc = 0;
        for (size_t i = 0; i < n; ++i) {
            W w;
            memcpy(&w, p + i * sizeof(W), sizeof(W));
            acc |= (W) ((W) (w & mask) + low);
        }
        return (acc >> (8 * sizeof(W) - 1)) != 0;
    }

    bool words_bad(const uint8_t * p, size_t n_words) const {
        return esize == 4 ? any_nonfinite<uint32_t>(p, n_words, mask)
                          : any_nonfinite<uint16_t>(p, n_words, (uint16_t) mask);
    }

    // whether the next n bytes of the tensor's data hold a non-finite value
    bool bad(const uint8_t * p, size_t n) {
        if (!esize) {
            return false;
        }
        if (n_carry) {
            const size_t k = std::min(esize - n_carry, n);
            memcpy(carry + n_carry, p, k);
            n_carry += k;
            p += k;
            n -= k;
            if (n_carry < esize) {
                return false;
            }
            n_carry = 0;
            if (words_bad(carry, 1)) {
                return true;
            }
        }
        const size_t whole = n / esize;
        n_carry = n - whole * esize;
        memcpy(carry, p + whole * esize, n_carry);
        return words_bad(p, whole);
    }
};

// llama.cpp names a KV cache's tensors cache_<tag>k_l<il> and cache_<tag>v_l<il> (src/llama-kv-cache.cpp),
// a recurrent memory's cache_r_l<il> and cache_s_l<il>; the reader is given per-stream views of them
bool attn_kv_tensor(const ggml_tensor * t, char & what, int & il) {
    const ggml_tensor * s = t->view_src ? t->view_src : t;
    const char * name = s->name;
    const char * l = strrchr(name, 'l');
    if (strncmp(name, "cache_", 6) != 0 || !l || l - name < 8 || l[-1] != '_' || (l[-2] != 'k' && l[-2] != 'v')) {
        return false;
    }
    what = (char) (l[-2] == 'k' ? 'K' : 'V');
    il = atoi(l + 1);
    return true;
}

// llama_io_read_host (src/llama-context.cpp) over pieces of memory and of a file: what is read for a tensor is
// tested (when asked) and written into it block by block at once, as llama_io_read_file writes it; a file piece is
// read through a mapping of the file (straight into a tensor in host memory) where it can be mapped, else with
// pread through a buffer
class attn_io_read_source : public llama_io_read_i {
public:
    attn_io_read_source(const llama_attn_state_piece * src, int32_t n, int fd, bool check) : fd(fd), check(check) {
        for (int32_t i = 0; i < n; ++i) {
            if (src[i].size) {
                pieces.push_back(src[i]);
            }
        }
        if (fd >= 0) {
            guard = std::make_unique<attn_file_guard>();
        }
    }

    void read(void * dst, size_t size) override {
        size_t done = 0;
        while (done < size) {
            const piece_span sp = span(size - done);
            load((uint8_t *) dst + done, sp, 0, sp.n, nullptr);
            done += sp.n;
        }
    }

    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        attn_value_check chk;
        char what = 0;
        int il = -1;
        if (check && attn_kv_tensor(tensor, what, il)) {
            switch (tensor->type) {
                case GGML_TYPE_F32:  chk.esize = 4; chk.mask = 0x7f800000u; break;
                case GGML_TYPE_F16:  chk.esize = 2; chk.mask = 0x7c00u;     break;
                case GGML_TYPE_BF16: chk.esize = 2; chk.mask = 0x7f80u;     break;
                default: break;
            }
        }
        // a tensor in host memory is written in place (ggml_backend_tensor_set's memcpy, ggml-backend.cpp's CPU
        // buffer); a device's through ggml_backend_tensor_set, from the piece or from a block copied out of the
        // file's mapping (a fault is caught in our own copy only)
        if (offset + size > ggml_nbytes(tensor)) {
            throw std::runtime_error("a state record past its tensor's end"); // ggml_backend_tensor_set's assert
        }
        uint8_t * host = tensor->buffer && ggml_backend_buffer_is_host(tensor->buffer) && tensor->data
                             ? (uint8_t *) tensor->data + offset
                             : nullptr;
        size_t done = 0;
        while (done < size) {
            const piece_span sp = span(size - done);
            for (size_t b = 0; b < sp.n; b += ATTN_CHECK_BLOCK) {
                const size_t m = std::min(ATTN_CHECK_BLOCK, sp.n - b);
                bool ok = true;
                if (host) {
                    ok = load(host + done + b, sp, b, m, &chk);
                } else {
                    const uint8_t * p = sp.p + b;
                    if (sp.mapped) {
                        bounce.resize(ATTN_CHECK_BLOCK);
                        load(bounce.data(), sp, b, m, nullptr);
                        p = bounce.data();
                    }
                    ok = !chk.bad(p, m);
                    if (ok) {
                        ggml_backend_tensor_set(tensor, p, offset + done + b, m);
                    }
                }
                if (!ok) {
                    char msg[96];
                    snprintf(msg, sizeof(msg), "the state's %c cache of layer %d holds NaN or infinite values",
                             what, il);
                    error = msg;
                    throw std::runtime_error(error);
                }
            }
            done += sp.n;
        }
    }

    size_t n_bytes() override { return n_read; }

    // whether the file is shorter than a piece of it: a read that failed on what a mapping's last, partly filled
    // page reads past the file's end (zeros) failed because the file ended
    bool file_ended() const {
        return std::any_of(pieces.begin(), pieces.end(), [this](const auto & pc) { return file_shorter(pc); });
    }

    std::string error; // why the read failed, when it knows better than llama.cpp's message

private:
    struct piece_span {
        const uint8_t * p;
        size_t          n;
        bool            mapped; // p is in the file's mapping: touch it through attn_file_load only
    };

    // dst <- the m bytes at sp.p + b, tested first with chk when given; false for a non-finite value (nothing
    // copied); throws when the file ended under its mapping
    bool load(uint8_t * dst, const piece_span & sp, size_t b, size_t m, attn_value_check * chk) {
        const uint8_t * src = sp.p + b;
        if (sp.mapped) {
            auto bad = [](void * c, const uint8_t * p, size_t n) { return ((attn_value_check *) c)->bad(p, n); };
            const int r = attn_file_load(dst, src, m, chk ? +bad : nullptr, chk);
            if (r < 0) {
                ended(); // cut short, or cut while it was read
            }
            return r == 1;
        }
        if (chk && chk->bad(src, m)) {
            return false;
        }
        memcpy(dst, src, m);
        return true;
    }

    // the next bytes of the state, contiguous: at most `want`, at least 1
    piece_span span(size_t want) {
        if (cur == pieces.size()) {
            throw std::runtime_error("unexpectedly reached end of buffer");
        }
        const llama_attn_state_piece & pc = pieces[cur];
        piece_span sp{nullptr, 0, false};
        if (pc.data) {
            sp.p = (const uint8_t *) pc.data + pos;
            sp.n = std::min(want, (size_t) pc.size - pos);
        } else if (map_piece(pc)) {
            sp.p      = view.data + pos;
            sp.n      = std::min(want, (size_t) pc.size - pos);
            sp.mapped = true;
            if (pos + sp.n == pc.size && file_shorter(pc)) {
                ended(); // tested before its last bytes are used: a page past the end faults, a partly filled
                         // last page reads zeros past the end without a fault
            }
        } else {
            if (win_pos == win_len) {
                fill(pc);
            }
            sp.p = window.get() + win_pos;
            sp.n = std::min(want, win_len - win_pos);
            win_pos += sp.n;
        }
        pos += sp.n;
        n_read += sp.n;
        if (pos == pc.size) {
            cur++;
            pos = 0;
            win_pos = win_len = 0;
        }
        return sp;
    }

    // whether piece cur (pc) is read through a mapping of the file: mapped on its first bytes (the previous piece's
    // unmapped, its last bytes used by then); false, and pread from then on, where the file cannot be mapped
    bool map_piece(const llama_attn_state_piece & pc) {
        if (view.data && map_of == cur) {
            return true;
        }
        if (no_map || !view.map(fd, pc.offset, pc.size)) {
            no_map = true;
            return false;
        }
        map_of = cur;
        return true;
    }

    bool file_shorter(const llama_attn_state_piece & pc) const {
#ifndef _WIN32
        struct stat st;
        return !pc.data && fd >= 0 && fstat(fd, &st) == 0 && (uint64_t) st.st_size < (uint64_t) pc.offset + pc.size;
#else
        GGML_UNUSED(pc);
        return false;
#endif
    }

    [[noreturn]] void ended() {
        error = "the file ended inside the state";
        throw std::runtime_error(error);
    }

    // the window from byte `pos` of the file piece pc on
    void fill(const llama_attn_state_piece & pc) {
        const size_t len = std::min(ATTN_FILE_WINDOW, (size_t) pc.size - pos);
#ifdef _WIN32
        GGML_UNUSED(len);
        throw std::runtime_error("reading a state from a file descriptor is not supported on Windows");
#else
        if (!window) {
            window.reset(new uint8_t[ATTN_FILE_WINDOW]); // not zero-filled: every byte used is read first
        }
        size_t got = 0;
        while (got < len) {
            const ssize_t r = pread(fd, window.get() + got, len - got, (off_t) (pc.offset + pos + got));
            if (r < 0 && errno == EINTR) {
                continue;
            }
            if (r == 0) {
                ended();
            }
            if (r < 0) {
                error = std::string("reading the file: ") + strerror(errno);
                throw std::runtime_error(error);
            }
            got += (size_t) r;
        }
        win_pos = 0;
        win_len = len;
#endif
    }

    std::vector<llama_attn_state_piece> pieces;
    const int fd;
    const bool check;
    size_t cur = 0, pos = 0, n_read = 0;
    std::unique_ptr<uint8_t[]> window;
    size_t win_pos = 0, win_len = 0;
    std::vector<uint8_t> bounce; // a block copied out of the mapping for a tensor not in host memory
    std::unique_ptr<attn_file_guard> guard; // while a file is read (before view: it outlives the mapping)
    attn_file_view view; // the mapping of piece map_of
    size_t map_of = 0;
    bool no_map = false;
};

void attn_set_error(char * err, size_t err_size, const std::string & msg) {
    if (err && err_size) {
        snprintf(err, err_size, "%s", msg.c_str());
    }
}

} // namespace

size_t llama_attn_state_seq_read(llama_context * ctx, const llama_attn_state_piece * pieces, int32_t n_pieces,
                                 int32_t fd, llama_seq_id seq_id, bool check_values, char * err, size_t err_size) {
    attn_set_error(err, err_size, "");
    if (!ctx || n_pieces < 0 || (n_pieces > 0 && !pieces) || seq_id < 0 ||
        (uint32_t) seq_id >= ctx->get_cparams().n_seq_max) {
        attn_set_error(err, err_size, "bad argument");
        return 0;
    }
    for (int32_t i = 0; i < n_pieces; ++i) {
        if (!pieces[i].data && pieces[i].size && (fd < 0 || pieces[i].offset < 0)) {
            attn_set_error(err, err_size, "a file piece without a file");
            return 0;
        }
    }
    llama_synchronize(ctx);
    attn_io_read_source io(pieces, n_pieces, fd, check_values);
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
    } catch (const std::exception & e) {
        const std::string why = !io.error.empty() ? io.error : io.file_ended() ? "the file ended inside the state" : e.what();
        LLAMA_LOG_ERROR("%s: error loading state: %s\n", __func__, why.c_str());
        attn_set_error(err, err_size, why);
        return 0;
    }
}
