// What a GPU gives xtrain's CUDA kernels, emulated on the CPU: the kernel modules of
// crates/tensor/src/cuda/kernels compile as C++ after this header (the emulated NVRTC in
// libraries.cpp puts it first) and run here, so that every kernel can be run against its CPU
// twin on a machine without a GPU. It is a test of the kernels' logic — indexing, masks,
// fragments, barriers, the order of cp.async copies and of the fused backward's adds — not
// of their speed, nor of the hardware's memory model beyond what is stated below.
//
// Execution: a launch runs its blocks one after another in the order of their linear index
// (x fastest), the order in which a GPU starts them; a block's threads are fibers on one OS
// thread, switched at every barrier: __syncthreads (all threads of the block that have not
// returned), and the warp-wide operations — shuffles, __syncwarp, mma.sync, ldmatrix —
// which wait for every lane of the warp that has not returned. Threads that wait at
// different barriers (a warp operation against a block barrier) can never all arrive: the
// launch fails naming the block, as a hung kernel would be found on a GPU.
//
// Memory: device pointers are host pointers. `__shared__` variables are static (one block
// runs at a time); dynamic shared memory is one array per module, filled with 0xff bytes
// (NaN) before every block so that a read of what the block never wrote shows. cp.async
// copies are made when the group that holds them is waited for (cp.async.wait_group), not
// when issued: a read before the wait sees the 0xff bytes or the tile before.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <type_traits>
#include <utility>

#include "halves.h"

#define XT_EMU_PTX 1 // the kernels' own PTX helpers stand aside for those below
#define __global__ __attribute__((used))
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __maxnreg__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
#define __shared__ static

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct float2 {
    float x, y;
};
struct __attribute__((aligned(16))) float4 {
    float x, y, z, w;
};
struct __attribute__((aligned(16))) uint4 {
    unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace xt_emu {

constexpr int MAX_THREADS = 1024;
constexpr size_t STACK_BYTES = 256 << 10;
constexpr size_t SMEM_BYTES = 256 << 10;

enum State { RUNNABLE, AT_BLOCK_BARRIER, AT_WARP_BARRIER, RETURNED };

struct Copy {
    void* dst;
    const void* src;
    int bytes, src_bytes;
    int group; // the cp.async group (commit_group) it belongs to
};

struct Fiber {
    void* sp = nullptr;
    dim3 tid;
    int lane = 0, warp = 0;
    State state = RETURNED;
    // Pending cp.async copies; `committed` groups closed.
    Copy copies[64];
    int ncopies = 0, committed = 0;
    unsigned ops = 0; // warp-wide operations so far (the exchange set's turn)
};

struct Launch {
    void (*thunk)(void**) = nullptr;
    void** args = nullptr;
    dim3 grid, block;
    int nthreads = 0;
    unsigned smem = 0;
    char error[512] = {0};
};

inline Fiber fibers[MAX_THREADS];
inline unsigned char* stacks = nullptr;
inline void* scheduler_sp = nullptr;
inline Fiber* cur = nullptr;
inline Launch* launch = nullptr;
inline dim3 block_idx;
// A warp's exchange slots: each lane's operands of a warp-wide operation, in two sets used
// by turns (`Fiber::ops`), so that one barrier an operation suffices: a lane writes a set
// again only after the next operation's barrier, which every lane reaches after reading it.
inline u32 exchange[MAX_THREADS / 32][2][32][16];

extern "C" void xt_emu_switch(void** save_sp, void* to_sp);
#if defined(__x86_64__)
// Saves the callee-saved registers and the stack pointer of the caller in *save_sp and
// resumes the context whose stack pointer is to_sp (System V x86-64; the floating-point
// control words are the same in every fiber, no kernel changes them).
__asm__(".text\n"
        ".p2align 4\n"
        ".globl xt_emu_switch\n"
        ".hidden xt_emu_switch\n"
        ".type xt_emu_switch,@function\n"
        "xt_emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size xt_emu_switch, .-xt_emu_switch\n");
#else
#error "the CUDA emulation's fibers are written for x86-64"
#endif

inline void fail(const char* what) {
    if (launch->error[0] == 0)
        snprintf(launch->error, sizeof launch->error, "block (%u, %u, %u), thread %u: %s",
                 block_idx.x, block_idx.y, block_idx.z,
                 cur ? cur->tid.x + launch->block.x * (cur->tid.y + launch->block.y * cur->tid.z)
                     : 0,
                 what);
    if (cur) {
        cur->state = RETURNED;
        xt_emu_switch(&cur->sp, scheduler_sp);
    }
}

// Threads of the block (and of each warp) that have not returned, and how many of them wait
// at the block's (the warp's) barrier.
inline int block_live, block_waiting;
inline int warp_live[MAX_THREADS / 32], warp_waiting[MAX_THREADS / 32];

// Releases the threads at the barrier `s` of warp `w` (or of the block) once every live one
// is there; whether it did.
inline bool release_if_complete(State s, int w) {
    const int n = launch->nthreads;
    if (s == AT_WARP_BARRIER) {
        if (warp_waiting[w] == 0 || warp_waiting[w] < warp_live[w]) return false;
        for (int i = 32 * w; i < n && i < 32 * (w + 1); i++)
            if (fibers[i].state == AT_WARP_BARRIER) fibers[i].state = RUNNABLE;
        warp_waiting[w] = 0;
    } else {
        if (block_waiting == 0 || block_waiting < block_live) return false;
        for (int i = 0; i < n; i++)
            if (fibers[i].state == AT_BLOCK_BARRIER) fibers[i].state = RUNNABLE;
        block_waiting = 0;
    }
    return true;
}

// Leaves the current thread (waiting or returned) for the next runnable one after it in the
// block (the next lane, mostly), or the scheduler where none is.
inline void yield() {
    Fiber* me = cur;
    const int n = launch->nthreads, i = (int)(me - fibers);
    for (int k = 1; k < n; k++) {
        Fiber* next = &fibers[(i + k) % n];
        if (next->state == RUNNABLE) {
            cur = next;
            xt_emu_switch(&me->sp, next->sp);
            return;
        }
    }
    xt_emu_switch(&me->sp, scheduler_sp);
}

// The current thread arrives at barrier `s`: the last to arrive releases the others and goes
// on; the others wait, and whoever runs after a release runs them.
inline void wait_at(State s) {
    const int w = cur->warp;
    cur->state = s;
    if (s == AT_WARP_BARRIER) warp_waiting[w]++;
    else block_waiting++;
    if (release_if_complete(s, w)) return;
    yield();
}

[[noreturn]] inline void fiber_main() {
    launch->thunk(launch->args);
    cur->state = RETURNED;
    block_live--;
    warp_live[cur->warp]--;
    // Those waiting may have waited for this thread only.
    release_if_complete(AT_WARP_BARRIER, cur->warp);
    release_if_complete(AT_BLOCK_BARRIER, 0);
    yield();
    abort(); // never resumed
}

inline void start_fiber(Fiber& f, int i) {
    unsigned char* top = stacks + (size_t)(i + 1) * STACK_BYTES;
    uintptr_t sp = ((uintptr_t)top - 64) & ~(uintptr_t)15;
    void** s = (void**)sp;
    // Popped by xt_emu_switch: six registers, then the return address.
    *--s = nullptr; // alignment: the return address at a 16-byte boundary
    *--s = (void*)&fiber_main;
    for (int r = 0; r < 6; r++) *--s = nullptr;
    f.sp = s;
    f.state = RUNNABLE;
    f.ncopies = f.committed = 0;
    f.ops = 0;
}

// Runs one block to its end; false (and launch->error) where it cannot finish.
inline bool run_block(unsigned char* smem) {
    Launch& L = *launch;
    const int n = L.nthreads, warps = (n + 31) / 32;
    memset(smem, 0xff, L.smem);
    for (int i = 0; i < n; i++) {
        Fiber& f = fibers[i];
        f.tid.x = i % L.block.x;
        f.tid.y = i / L.block.x % L.block.y;
        f.tid.z = i / (L.block.x * L.block.y);
        f.lane = i % 32;
        f.warp = i / 32;
        start_fiber(f, i);
    }
    block_live = n;
    block_waiting = 0;
    for (int w = 0; w < warps; w++) {
        warp_live[w] = n - 32 * w < 32 ? n - 32 * w : 32;
        warp_waiting[w] = 0;
    }
    for (;;) {
        bool ran = false;
        for (int i = 0; i < n; i++) {
            if (fibers[i].state != RUNNABLE) continue;
            ran = true;
            cur = &fibers[i];
            xt_emu_switch(&scheduler_sp, cur->sp);
            cur = nullptr;
            if (L.error[0]) return false;
        }
        if (block_live == 0) return true;
        if (ran) continue;
        snprintf(L.error, sizeof L.error,
                 "block (%u, %u, %u): its threads wait at different barriers (a warp "
                 "operation and __syncthreads): the kernel would hang",
                 block_idx.x, block_idx.y, block_idx.z);
        return false;
    }
}

// Dynamic shared memory: the emulated NVRTC turns `extern __shared__ T name[];` into a
// pointer to this.
alignas(128) inline unsigned char smem_arena[SMEM_BYTES];
inline unsigned char* smem_base() { return smem_arena; }

} // namespace xt_emu

// The launch entry the emulated driver calls: every block of the grid, in linear order.
extern "C" __attribute__((visibility("default"))) int xt_emu_launch(
    void (*thunk)(void**), void** args, const unsigned* grid, const unsigned* block,
    unsigned smem, char* error, size_t error_len) {
    using namespace xt_emu;
    Launch L;
    L.thunk = thunk;
    L.args = args;
    L.grid = {grid[0], grid[1], grid[2]};
    L.block = {block[0], block[1], block[2]};
    L.nthreads = (int)(block[0] * block[1] * block[2]);
    L.smem = smem;
    if (L.nthreads <= 0 || L.nthreads > MAX_THREADS || smem > SMEM_BYTES) {
        snprintf(error, error_len, "launch of %d threads with %u bytes of shared memory",
                 L.nthreads, smem);
        return 1;
    }
    if (!stacks) {
        stacks = (unsigned char*)mmap(nullptr, STACK_BYTES * MAX_THREADS, PROT_READ | PROT_WRITE,
                                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (stacks == MAP_FAILED) {
            stacks = nullptr;
            snprintf(error, error_len, "no memory for the emulated threads' stacks");
            return 1;
        }
        // A guard page at the bottom of each stack: an overflow faults instead of writing
        // into the next thread's stack.
        for (int i = 0; i < MAX_THREADS; i++)
            mprotect(stacks + (size_t)i * STACK_BYTES, 4096, PROT_NONE);
    }
    launch = &L;
    bool ok = true;
    for (unsigned z = 0; z < L.grid.z && ok; z++)
        for (unsigned y = 0; y < L.grid.y && ok; y++)
            for (unsigned x = 0; x < L.grid.x && ok; x++) {
                block_idx = {x, y, z};
                ok = run_block(smem_base());
            }
    launch = nullptr;
    if (!ok) snprintf(error, error_len, "%s", L.error);
    return ok ? 0 : 1;
}

#define threadIdx (xt_emu::cur->tid)
#define blockIdx (xt_emu::block_idx)
#define blockDim (xt_emu::launch->block)
#define gridDim (xt_emu::launch->grid)

// Calls kernel `f` with the arguments cuLaunchKernel was given (pointers to each value).
namespace xt_emu {
template <typename... A, size_t... I>
inline void invoke_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*(std::remove_cv_t<std::remove_reference_t<A>>*)args[I]...);
}
template <typename... A>
inline void invoke(void (*f)(A...), void** args) {
    invoke_with(f, args, std::index_sequence_for<A...>{});
}
} // namespace xt_emu

// ---- Built-in functions ---------------------------------------------------------------

inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
// Compiled with -ffp-contract=off: each operation is rounded on its own, as the _rn
// intrinsics ask.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

inline void __syncthreads() { xt_emu::wait_at(xt_emu::AT_BLOCK_BARRIER); }
inline void __syncwarp(unsigned = 0xffffffffu) { xt_emu::wait_at(xt_emu::AT_WARP_BARRIER); }
inline void __threadfence() {}
inline void __nanosleep(unsigned) {}
inline void __trap() { xt_emu::fail("__trap()"); }

namespace xt_emu {
// This lane's slot in the exchange set of the warp's next operation, and the set.
inline u32* post() { return exchange[cur->warp][cur->ops & 1][cur->lane]; }
inline u32 (*posted())[16] { return exchange[cur->warp][cur->ops++ & 1]; }

// Every lane posts `v`, the warp meets, each reads lane `src(lane)`'s.
template <typename T, typename Src>
inline T shuffle(T v, Src src) {
    static_assert(sizeof(T) <= 64, "shuffled values are at most 64 bytes");
    memcpy(post(), &v, sizeof(T));
    __syncwarp();
    T r;
    memcpy(&r, posted()[src(cur->lane) & 31], sizeof(T));
    return r;
}
} // namespace xt_emu

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
    return xt_emu::shuffle(v, [mask](int lane) { return lane ^ mask; });
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) {
    return xt_emu::shuffle(v, [src](int) { return src; });
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
    return xt_emu::shuffle(v, [d](int lane) { return lane + (int)d < 32 ? lane + (int)d : lane; });
}

// One block runs at a time, on one OS thread: atomics are plain read-modify-writes.
inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline float atomicAdd(float* p, float v) { float o = *p; *p = o + v; return o; }
inline double atomicAdd(double* p, double v) { double o = *p; *p = o + v; return o; }

template <typename T>
inline T __ldcg(const T* p) { return *p; }
template <typename T>
inline void __stcg(T* p, T v) { *p = v; }

inline size_t __cvta_generic_to_global(const void* p) { return (size_t)p; }
// A shared-memory address is the offset from the module's dynamic shared memory (32 bits,
// as PTX's shared window); xt_emu::shared() turns it back.
inline size_t __cvta_generic_to_shared(const void* p) {
    return (size_t)(u32)((const unsigned char*)p - xt_emu::smem_base());
}
namespace xt_emu {
inline unsigned char* shared(u32 addr) { return smem_base() + (int32_t)addr; }
} // namespace xt_emu

// ---- The PTX the kernels use (their XT_EMU_PTX sections) ----------------------------------

namespace xt_emu {
// cvt.rn.bf16x2.f32 and cvt.rn.f16.f32: a NaN becomes the canonical one.
inline u16 to_bf16(float f) { return xt_halves::is_nan(f) ? 0x7fff : xt_halves::to_bf16(f); }
inline u16 to_f16(float f) {
    return xt_halves::is_nan(f) ? (u16)(((__float_as_uint(f) >> 16) & 0x8000u) | 0x7fffu)
                                : xt_halves::to_f16(f);
}
inline float from_bits(u16 h, bool f16) {
    return f16 ? xt_halves::f16_to_float(h) : xt_halves::bf16_to_float(h);
}
} // namespace xt_emu

inline float f16_to_f32(u16 h) { return xt_halves::f16_to_float(h); }
inline u16 f32_to_f16(float f) { return xt_emu::to_f16(f); }

template <bool F16>
inline u32 tc_pack(float lo, float hi) {
    u16 l = F16 ? xt_emu::to_f16(lo) : xt_emu::to_bf16(lo);
    u16 h = F16 ? xt_emu::to_f16(hi) : xt_emu::to_bf16(hi);
    return (u32)l | ((u32)h << 16);
}

inline float tc_exp2(float x) {
    float y = exp2f(x);
    return y < FLT_MIN ? 0.0f : y; // .ftz
}

// mma.sync.m16n8k16.row.col, fp32 accumulate: each lane posts its A and B registers as
// floats, then computes its own four results (fragment layouts: attention_tc_bwd.cu's
// header) from every lane's, the 16 products of each (exact) added in k order onto the
// accumulator.
template <bool F16>
inline void tc_mma(float* d, const u32* a, u32 b0, u32 b1) {
    using namespace xt_emu;
    float* mine = (float*)post();
    const u32 regs[6] = {a[0], a[1], a[2], a[3], b0, b1};
    for (int i = 0; i < 6; i++) {
        mine[2 * i] = from_bits((u16)(regs[i] & 0xffffu), F16);
        mine[2 * i + 1] = from_bits((u16)(regs[i] >> 16), F16);
    }
    __syncwarp();
    const float(*x)[16] = (const float(*)[16])posted();
    const int g = cur->lane >> 2, t = cur->lane & 3;
    // Rows g and g + 8 of A; columns 2t and 2t + 1 of B.
    float ar[2][16], bc[2][16];
    for (int k = 0; k < 16; k++) {
        const float* src = x[4 * g + (k % 8) / 2];
        ar[0][k] = src[2 * (2 * (k >= 8)) + k % 2];
        ar[1][k] = src[2 * (2 * (k >= 8) + 1) + k % 2];
        bc[0][k] = x[4 * (2 * t) + (k % 8) / 2][8 + 2 * (k >= 8) + k % 2];
        bc[1][k] = x[4 * (2 * t + 1) + (k % 8) / 2][8 + 2 * (k >= 8) + k % 2];
    }
    for (int i = 0; i < 4; i++) {
        const float* r = ar[i >> 1];
        const float* c = bc[i & 1];
        float acc = d[i];
        for (int k = 0; k < 16; k++) acc += r[k] * c[k];
        d[i] = acc;
    }
}

// ldmatrix.m8n8.x4: lanes 8i .. 8i + 7 give the rows of matrix i; lane l receives, of each
// matrix, row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 (.trans: column l / 4, rows 2 (l % 4)
// and 2 (l % 4) + 1).
inline void xt_emu_ldsm(u32* r, u32 addr, bool trans) {
    using namespace xt_emu;
    post()[0] = addr;
    __syncwarp();
    const u32(*x)[16] = posted();
    const int l = cur->lane;
    for (int i = 0; i < 4; i++) {
        u16 lo, hi;
        if (!trans) {
            const unsigned char* row = shared(x[8 * i + l / 4][0]);
            memcpy(&lo, row + 4 * (l % 4), 2);
            memcpy(&hi, row + 4 * (l % 4) + 2, 2);
        } else {
            const unsigned char* r0 = shared(x[8 * i + 2 * (l % 4)][0]);
            const unsigned char* r1 = shared(x[8 * i + 2 * (l % 4) + 1][0]);
            memcpy(&lo, r0 + 2 * (l / 4), 2);
            memcpy(&hi, r1 + 2 * (l / 4), 2);
        }
        r[i] = (u32)lo | ((u32)hi << 16);
    }
}
inline void tc_ldsm_x4(u32* r, u32 addr) { xt_emu_ldsm(r, addr, false); }
inline void tc_ldsm_x4_trans(u32* r, u32 addr) { xt_emu_ldsm(r, addr, true); }

namespace xt_emu {
inline void cp_async(u32 dst, const void* src, int bytes, int src_bytes) {
    Fiber& f = *cur;
    if (f.ncopies == (int)(sizeof f.copies / sizeof f.copies[0])) {
        fail("more than 64 cp.async copies pending in one thread");
        return;
    }
    f.copies[f.ncopies++] = {shared(dst), src, bytes, src_bytes, f.committed};
}
} // namespace xt_emu
inline void tc_cp_async16(u32 dst, const u16* src, int src_bytes) {
    xt_emu::cp_async(dst, src, 16, src_bytes);
}
inline void tc_cp_async4(u32 dst, const float* src, int src_bytes) {
    xt_emu::cp_async(dst, src, 4, src_bytes);
}
inline void tc_cp_async_commit() { xt_emu::cur->committed++; }
// Makes the copies of every committed group but the newest N (cp.async.wait_group N).
template <int N>
inline void tc_cp_async_wait() {
    using namespace xt_emu;
    Fiber& f = *cur;
    const int done_below = f.committed - N;
    int kept = 0;
    for (int i = 0; i < f.ncopies; i++) {
        Copy c = f.copies[i];
        if (c.group < done_below) {
            memcpy(c.dst, c.src, (size_t)c.src_bytes);
            memset((unsigned char*)c.dst + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
        } else {
            f.copies[kept++] = c;
        }
    }
    f.ncopies = kept;
}

// The fused backward's ordered adds: blocks run one at a time in index order, so the turn
// of a block has come when it first looks, or never will (the GPU kernel traps then too).
inline void tb_wait_turn(const unsigned* flag, unsigned turn) {
    if (*flag != turn) {
        char what[128];
        snprintf(what, sizeof what, "the fused backward waits for turn %u with the count at %u",
                 turn, *flag);
        xt_emu::fail(what);
    }
}
inline void tb_signal(unsigned* flag) { ++*flag; }
