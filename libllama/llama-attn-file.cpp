// slotserve: a byte range of a file read through a read-only mapping, for llama-attn-state.cpp's slot-file reads
// (llama-attn-impl.h: attn_file_view, attn_file_guard, attn_file_load).  One reason to patch: llama.cpp reads a
// sequence state's file with fread into a buffer and copies that into the KV cache (llama_io_read_file,
// src/llama-context.cpp); through a mapping the K/V values are copied once, page cache to KV cache, in user space
// (the kernel's copy into a buffer was 2.5x slower than that for a 46 MB state on the project's test VM,
// docs/benchmarks.md).  A page of a mapping past the file's end raises SIGBUS when touched (mmap(2)): a file cut
// short, or cut while it is read (written over in place by another program); copies out of a mapping are made
// while a guard holds a SIGBUS handler of this file's, which turns such a fault into an error instead of the end
// of the process.
//
// Copied into llama.cpp's src/ by slotserve's set-up.  Nothing here is called by llama.cpp itself.

#include "llama-attn-impl.h"

#ifndef _WIN32

#include <csetjmp>
#include <csignal>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

namespace {

// One guard at a time (attn_file_guard's mutex), so this is global, not thread-local.
struct attn_bus_state {
    sigjmp_buf * volatile    env = nullptr; // set only during attn_file_load's copy
    const uint8_t * volatile lo  = nullptr; // the mapping being read
    const uint8_t * volatile hi  = nullptr;
    struct sigaction         prev {};
};
attn_bus_state attn_bus;
std::mutex     attn_bus_mutex;

// a SIGBUS at an address of the mapping being read jumps back into attn_file_load; any other gets the previous
// disposition back, and the faulting access repeats under it
void attn_bus_handler(int sig, siginfo_t * info, void * /*ucontext*/) {
    const uint8_t * a = (const uint8_t *) info->si_addr;
    if (attn_bus.env && a >= attn_bus.lo && a < attn_bus.hi) {
        siglongjmp(*attn_bus.env, 1);
    }
    sigaction(SIGBUS, &attn_bus.prev, nullptr);
    if (info->si_code <= 0) { // sent (kill, raise), not a fault: it would not repeat by itself
        raise(sig);
    }
}

} // namespace

attn_file_guard::attn_file_guard() : lock(attn_bus_mutex) {
    struct sigaction sa {};
    sa.sa_sigaction = attn_bus_handler;
    sa.sa_flags     = SA_SIGINFO | SA_NODEFER; // SA_NODEFER: siglongjmp leaves no blocked signal behind
    sigemptyset(&sa.sa_mask);
    installed = sigaction(SIGBUS, &sa, &attn_bus.prev) == 0;
}

attn_file_guard::~attn_file_guard() {
    attn_bus.lo = attn_bus.hi = nullptr;
    if (installed) {
        sigaction(SIGBUS, &attn_bus.prev, nullptr);
    }
}

bool attn_file_view::map(int fd, int64_t offset, uint64_t size) {
    unmap();
    const long    page  = sysconf(_SC_PAGESIZE);
    const int64_t start = page > 0 ? offset / page * page : offset;
    const size_t  len   = (size_t) (offset - start) + (size_t) size;
    int flags = MAP_SHARED;
#ifdef MAP_POPULATE
    flags |= MAP_POPULATE; // the page cache's pages mapped in one call instead of a fault per page
#endif
    void * m = offset < 0 || !size ? MAP_FAILED : mmap(nullptr, len, PROT_READ, flags, fd, (off_t) start);
    if (m == MAP_FAILED) {
        return false;
    }
    base = (uint8_t *) m;
    len_ = len;
    data = base + (offset - start);
    attn_bus.lo = base;
    attn_bus.hi = base + len;
    return true;
}

void attn_file_view::unmap() {
    if (base) {
        attn_bus.lo = attn_bus.hi = nullptr;
        munmap(base, len_);
        base = nullptr;
        data = nullptr;
    }
}

// No object with a destructor lives in this frame: siglongjmp leaves through it only.
int attn_file_load(uint8_t * dst, const uint8_t * src, size_t n, bool (*bad)(void *, const uint8_t *, size_t),
                   void * arg) {
    sigjmp_buf env;
    if (sigsetjmp(env, 0) != 0) {
        attn_bus.env = nullptr;
        return -1;
    }
    attn_bus.env = &env;
    const bool refused = bad && bad(arg, src, n);
    if (!refused) {
        memcpy(dst, src, n);
    }
    attn_bus.env = nullptr;
    return refused ? 0 : 1;
}

#else // no mappings: llama-attn-state.cpp reads no file on Windows

attn_file_guard::attn_file_guard() {}
attn_file_guard::~attn_file_guard() {}
bool attn_file_view::map(int, int64_t, uint64_t) { return false; }
void attn_file_view::unmap() {}
int attn_file_load(uint8_t *, const uint8_t *, size_t, bool (*)(void *, const uint8_t *, size_t), void *) { return -1; }

#endif
