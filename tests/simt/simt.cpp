// simt.cpp: the SIMT shim's runtime: runs a kernel's grid on the CPU (see simt.h for the model).
//
// Why cooperative fibers and not one OS thread per CUDA thread: a block has up to 1024 threads
// and the training step launches thousands of blocks; std::thread per CUDA thread would cost a
// clone and a futex wake per barrier crossing, and the OS scheduler would make every run
// interleave differently. Fibers on one OS thread switch in a few nanoseconds (a hand-written
// switch that saves only the callee-saved registers: glibc's swapcontext makes a sigprocmask
// system call every time, about 50x slower, so it is only the fallback for other
// architectures), and the order in which they run is a pure function of the launch, so runs are
// bit-identical unless the environment asks for a shuffled order:
//
//   LOCKSTEP_SIMT_WORKERS=N   run blocks on N OS threads at once (default 1);
//   LOCKSTEP_SIMT_SHUFFLE=S   seed S (not 0): blocks run in a permuted order and, inside a block,
//                             the next fiber to run is picked at random among the runnable ones.
//                             Each launch permutes differently. Kernels whose results depend on
//                             that order (atomics on floats, missing barriers) then differ run
//                             to run, as they would on a GPU.
//
// A fiber runs until it blocks (block barrier, warp barrier) or returns; then the next runnable
// fiber of its block resumes directly (no trip through a scheduler). The last fiber to reach a
// barrier releases the others and carries on. When no fiber can run but some have not returned,
// the block is deadlocked (e.g. __syncthreads inside a branch some threads skip) and the launch
// fails with a description of where each thread waits.

#include "simt.h"
#include "simt_launch.h"

// The runtime names the fiber's fields directly; the kernels' macros would get in the way.
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if !defined(__x86_64__) || defined(SIMT_UCONTEXT)
#define SIMT_USE_UCONTEXT 1
#include <ucontext.h>
#endif

namespace simt {
namespace {

// ----------------------------------------------------------------------------------------------
// context switching

#if SIMT_USE_UCONTEXT
struct Ctx {
    ucontext_t uc;
};
#else
struct Ctx {
    void* sp;
};
#endif

struct Fiber;
void fiber_main(Fiber* f);

#if !SIMT_USE_UCONTEXT
// simt_ctx_switch(from, to): push the callee-saved registers on the current stack, store the
// stack pointer in *from, load `to` and pop the same. The floating-point control words (MXCSR,
// x87) are not switched: every fiber of a block runs on the same OS thread and kernels never
// change them (LDMXCSR would cost more than the rest of the switch). A new fiber's stack is
// prepared (ctx_init) so that the first switch "returns" into simt_ctx_start, which calls
// r13(r12) = fiber_main(fiber).
extern "C" void simt_ctx_switch(void** from, void* to);
extern "C" void simt_ctx_start();
asm(R"(
    .text
    .p2align 4
    .globl simt_ctx_switch
    .hidden simt_ctx_switch
    .type simt_ctx_switch, @function
simt_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_ctx_switch, .-simt_ctx_switch

    .p2align 4
    .globl simt_ctx_start
    .hidden simt_ctx_start
    .type simt_ctx_start, @function
simt_ctx_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size simt_ctx_start, .-simt_ctx_start
)");

void ctx_init(Ctx* c, char* stack, size_t size, Fiber* f) {
    // 16-byte aligned top; below it the frame simt_ctx_switch pops: r15, r14, r13 (entry), r12
    // (argument), rbx, rbp, return address. After the pops and `ret`, rsp is 16-aligned at
    // simt_ctx_start's call, as the ABI wants.
    uintptr_t top = ((uintptr_t)(stack + size)) & ~(uintptr_t)15;
    uint64_t* sp = (uint64_t*)(top - 72);
    sp[0] = 0;                                // r15
    sp[1] = 0;                                // r14
    sp[2] = (uint64_t)(uintptr_t)&fiber_main; // r13
    sp[3] = (uint64_t)(uintptr_t)f;           // r12
    sp[4] = 0;                                // rbx
    sp[5] = 0;                                // rbp
    sp[6] = (uint64_t)(uintptr_t)&simt_ctx_start;
    sp[7] = 0;
    sp[8] = 0;
    c->sp = sp;
}

inline void ctx_switch(Ctx* from, Ctx* to) { simt_ctx_switch(&from->sp, to->sp); }
#else
void ucontext_entry(unsigned int hi, unsigned int lo) {
    fiber_main((Fiber*)(((uintptr_t)hi << 32) | (uintptr_t)lo));
}

void ctx_init(Ctx* c, char* stack, size_t size, Fiber* f) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    uintptr_t p = (uintptr_t)f;
    makecontext(&c->uc, (void (*)())ucontext_entry, 2, (unsigned int)(p >> 32), (unsigned int)(p & 0xffffffffu));
}

inline void ctx_switch(Ctx* from, Ctx* to) { swapcontext(&from->uc, &to->uc); }
#endif

// ----------------------------------------------------------------------------------------------
// fiber stacks: FIBER_STACK bytes aligned to FIBER_STACK (simt::self() finds the fiber from the
// stack pointer), pooled for the life of the process. Layout: a header page (the fiber pointer
// and a magic word), a guard page (an overflowing fiber faults instead of overwriting the
// header), then the stack proper, growing down from the top.

constexpr uint64_t STACK_MAGIC = 0x73696d7466696272ull;  // "simtfibr"

struct StackHeader {
    ThreadState* fiber;
    uint64_t magic;
};

std::mutex stack_pool_mu;
std::vector<char*> stack_pool;

size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }

// The base of a new aligned stack region.
char* take_stack() {
    {
        std::lock_guard<std::mutex> g(stack_pool_mu);
        if (!stack_pool.empty()) {
            char* s = stack_pool.back();
            stack_pool.pop_back();
            return s;
        }
    }
    // Map twice the size and unmap what lies outside one aligned region.
    char* m = (char*)mmap(nullptr, 2 * FIBER_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == (char*)MAP_FAILED) {
        std::fprintf(stderr, "simt: cannot map a %zu-byte fiber stack\n", (size_t)FIBER_STACK);
        std::abort();
    }
    char* base = (char*)(((uintptr_t)m + FIBER_STACK - 1) & ~(FIBER_STACK - 1));
    if (base > m) munmap(m, (size_t)(base - m));
    if (base + FIBER_STACK < m + 2 * FIBER_STACK) munmap(base + FIBER_STACK, (size_t)(m + 2 * FIBER_STACK - (base + FIBER_STACK)));
    mprotect(base + page_size(), page_size(), PROT_NONE);
    return base;
}

char* stack_bottom(char* base) { return base + 2 * page_size(); }
size_t stack_size() { return FIBER_STACK - 2 * page_size(); }

void give_stacks(std::vector<char*>& v) {
    std::lock_guard<std::mutex> g(stack_pool_mu);
    stack_pool.insert(stack_pool.end(), v.begin(), v.end());
    v.clear();
}

// ----------------------------------------------------------------------------------------------
// blocks, warps, fibers

enum State { RUNNABLE, AT_BARRIER, AT_WARP, DONE };

enum { OP_MMA_BF16 = 100, OP_MMA_TF32, OP_MMA_F16 };

struct Block;

struct Fiber : ThreadState {
    Ctx ctx;
    Block* blk;
    unsigned int linear, lane, warp;
    State state;
    // warp exchange: operand in, result out; mma fragments
    uint64_t in, out;
    int arg;
    uint32_t fa[4], fb[2];
    float fc[4];
};

// A warp operation some lanes of `mask` wait in. Lanes of one warp may run operations over
// disjoint masks at the same time (e.g. each half of a divergent warp shuffling among itself).
struct Group {
    unsigned int mask;
    unsigned int arrived;
    int kind;
    int width;
};

struct Warp {
    unsigned int exists;  // lanes that exist (a partial last warp has fewer)
    unsigned int live;    // lanes that have not returned
    int ngroups;          // pending operations (disjoint masks)
    Group groups[32];
};

// A deterministic generator for the shuffled mode (splitmix64).
struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    unsigned int below(unsigned int n) { return (unsigned int)(next() % n); }
};

struct Block {
    const simt_kernel* kernel;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    unsigned int n = 0;        // threads
    unsigned int live = 0;     // threads that have not returned
    unsigned int at_barrier = 0;
    Ctx sched;
    bool shuffle = false;
    Rng rng{0};
    bool failed = false;
    std::string error;
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
};

const char* op_name(int kind) {
    switch (kind) {
        case OP_SYNC: return "__syncwarp";
        case OP_SHFL_IDX: return "__shfl_sync";
        case OP_SHFL_UP: return "__shfl_up_sync";
        case OP_SHFL_DOWN: return "__shfl_down_sync";
        case OP_SHFL_XOR: return "__shfl_xor_sync";
        case OP_BALLOT: return "__ballot_sync";
        case OP_MMA_BF16: return "mma.sync.m16n8k16.bf16";
        case OP_MMA_F16: return "mma.sync.m16n8k16.f16";
        case OP_MMA_TF32: return "mma.sync.m16n8k8.tf32";
        default: return "a warp operation";
    }
}

// The running fiber, checked (the runtime's entry points are called from kernels only).
Fiber* checked_cur(const char* what) {
    const uintptr_t sp = (uintptr_t)__builtin_frame_address(0);
    const StackHeader* h = reinterpret_cast<const StackHeader*>(sp & ~(FIBER_STACK - 1));
    // Outside a fiber the read may fault instead: either way the misuse stops here.
    if (h->magic != STACK_MAGIC) {
        std::fprintf(stderr, "simt: %s called outside a kernel launch\n", what);
        std::abort();
    }
    return static_cast<Fiber*>(h->fiber);
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

// Abandon the block: record why (the first failure wins) and return to the scheduler. The
// fibers' stacks are simply reused by the next block; kernels hold no resources to release.
[[noreturn]] void fail_block(Block* b, Fiber* self, const std::string& why) {
    if (!b->failed) {
        b->failed = true;
        b->error = why;
    }
    Ctx dead;
    ctx_switch(self ? &self->ctx : &dead, &b->sched);
    std::abort();  // a failed block is never resumed
}

std::string where(const Fiber* f) {
    return format("block (%u,%u,%u) thread (%u,%u,%u)", f->blockIdx.x, f->blockIdx.y, f->blockIdx.z, f->threadIdx.x,
                  f->threadIdx.y, f->threadIdx.z);
}

// What every unfinished thread waits on, for the deadlock message.
std::string describe_waits(const Block* b) {
    unsigned int bar = 0, done = 0;
    std::string warps;
    for (const Fiber& f : b->fibers) {
        if (f.state == AT_BARRIER) bar++;
        if (f.state == DONE) done++;
    }
    for (size_t w = 0; w < b->warps.size(); ++w) {
        const Warp& wp = b->warps[w];
        for (int g = 0; g < wp.ngroups; ++g) {
            const Group& gr = wp.groups[g];
            warps += format("; warp %zu: lanes %08x wait in %s (mask %08x, live lanes %08x)", w, gr.arrived, op_name(gr.kind), gr.mask,
                            wp.live);
        }
    }
    return format("%u of %u threads wait at __syncthreads, %u have returned%s", bar, b->n, done, warps.c_str());
}

// Switch from `self` to the next runnable fiber of its block (round robin from self, or a
// random start in shuffled mode); back to the scheduler when every fiber has returned. Returns
// when `self` is resumed (immediately when it is the only runnable one).
void run_next(Fiber* self) {
    Block* b = self->blk;
    const unsigned int n = b->n;
    unsigned int start = b->shuffle ? b->rng.below(n) : self->linear + 1;
    for (unsigned int k = 0; k < n; ++k) {
        unsigned int i = (start + k) % n;
        Fiber* f = &b->fibers[i];
        if (f->state != RUNNABLE) continue;
        if (f == self) return;
        ctx_switch(&self->ctx, &f->ctx);
        return;
    }
    if (b->live == 0) {
        ctx_switch(&self->ctx, &b->sched);
        std::abort();  // a finished block is never resumed
    }
    fail_block(b, self, "deadlock: no thread can run: " + describe_waits(b));
}

void release_barrier(Block* b) {
    for (Fiber& f : b->fibers) {
        if (f.state == AT_BARRIER) f.state = RUNNABLE;
    }
    b->at_barrier = 0;
}

void fiber_main(Fiber* f) {
    Block* b = f->blk;
    b->body(b->arg);
    f->state = DONE;
    b->live--;
    Warp& w = b->warps[f->warp];
    w.live &= ~(1u << f->lane);
    for (int g = 0; g < w.ngroups; ++g) {
        const Group& gr = w.groups[g];
        if (gr.mask & (1u << f->lane)) {
            fail_block(b, f,
                       format("%s returned while lanes %08x of its warp wait for it in %s (mask %08x)", where(f).c_str(), gr.arrived,
                              op_name(gr.kind), gr.mask));
        }
    }
    // Returned threads do not take part in barriers: this may complete one.
    if (b->live > 0 && b->at_barrier == b->live) release_barrier(b);
    run_next(f);
    std::abort();  // a returned fiber is never resumed
}

// ----------------------------------------------------------------------------------------------
// warp operations

// Lane l's source lane for a shuffle, or -1 for "its own value" (out of its segment).
int shfl_source(int kind, unsigned int l, int arg, int width) {
    const unsigned int base = l & ~(unsigned int)(width - 1);
    switch (kind) {
        case OP_SHFL_IDX: return (int)(base + ((unsigned int)arg & (unsigned int)(width - 1)));
        case OP_SHFL_UP: return (int)(l - base) >= arg ? (int)l - arg : -1;
        case OP_SHFL_DOWN: return (int)(l - base) + arg < width ? (int)l + arg : -1;
        case OP_SHFL_XOR: {
            unsigned int s = l ^ (unsigned int)arg;
            return s < base + (unsigned int)width ? (int)s : -1;
        }
        default: return -1;
    }
}

float tf32_value(uint32_t bits) {
    // The tensor core reads the top 19 bits of a .tf32 operand (sign, exponent, 10 mantissa bits).
    return from_bits<float>(bits & ~0x1fffu);
}

float bf16_value(uint32_t reg, int half) { return from_bits<float>(half ? (reg & 0xffff0000u) : (reg << 16)); }

// IEEE binary16 in the low (half 0) or high (half 1) 16 bits of a register, widened exactly.
float f16_value(uint32_t reg, int half) {
    const uint32_t h = half ? (reg >> 16) : (reg & 0xffffu);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return from_bits<float>(sign | 0x7f800000u | (man ? (0x00400000u | (man << 13)) : 0u));
    if (exp == 0u) {
        const float mag = (float)man * 5.9604644775390625e-08f;
        return from_bits<float>(sign | (uint32_t)to_bits(mag));
    }
    return from_bits<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

// D = A·B + C for the warp, from the PTX ISA fragment layouts ("Matrix Fragments for
// mma.m16n8k16 with floating point type" and "for mma.m16n8k8", .bf16/.f16 and .tf32 rows), with
// groupID g = lane >> 2 and threadID_in_group t = lane % 4:
//   C/D (16x8 f32): c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
//   m16n8k16 .bf16 A (16x16): reg0 = a0,a1 (g, 2t..2t+1), reg1 = a2,a3 (g+8, 2t..), reg2 = a4,a5
//     (g, 2t+8..), reg3 = a6,a7 (g+8, 2t+8..); the lower-indexed element in the low 16 bits.
//     B (16x8, k x n): reg0 = b0,b1 (k = 2t, 2t+1; n = g), reg1 = b2,b3 (k = 2t+8, 2t+9).
//   m16n8k8 .tf32 A (16x8): a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
//     B (8x8): b0 (k = t, n = g), b1 (k = t+4).
// The products are exact in f32 (8- and 11-bit significands); they are added to C in k order.
// NVIDIA does not specify the tensor core's internal order or rounding, so a GPU may differ in
// the last bits: tests compare with tolerances.
void mma_complete(Block* b, unsigned int w, int kind) {
    float A[16][16], B[16][8], C[16][8];
    const int K = kind == OP_MMA_TF32 ? 8 : 16;
    float (*value16)(uint32_t, int) = kind == OP_MMA_F16 ? f16_value : bf16_value;
    for (unsigned int lane = 0; lane < 32; ++lane) {
        const Fiber& f = b->fibers[w * 32 + lane];
        const int g = (int)lane >> 2, t = (int)lane & 3;
        if (kind != OP_MMA_TF32) {
            for (int h = 0; h < 2; ++h) {
                A[g][2 * t + h] = value16(f.fa[0], h);
                A[g + 8][2 * t + h] = value16(f.fa[1], h);
                A[g][2 * t + 8 + h] = value16(f.fa[2], h);
                A[g + 8][2 * t + 8 + h] = value16(f.fa[3], h);
                B[2 * t + h][g] = value16(f.fb[0], h);
                B[2 * t + 8 + h][g] = value16(f.fb[1], h);
            }
        } else {
            A[g][t] = tf32_value(f.fa[0]);
            A[g + 8][t] = tf32_value(f.fa[1]);
            A[g][t + 4] = tf32_value(f.fa[2]);
            A[g + 8][t + 4] = tf32_value(f.fa[3]);
            B[t][g] = tf32_value(f.fb[0]);
            B[t + 4][g] = tf32_value(f.fb[1]);
        }
        C[g][2 * t] = f.fc[0];
        C[g][2 * t + 1] = f.fc[1];
        C[g + 8][2 * t] = f.fc[2];
        C[g + 8][2 * t + 1] = f.fc[3];
    }
    // A row of 8 accumulators as one vector (GCC keeps a plain array in memory here, and the
    // loop then waits on store forwarding), k outermost: each element still sums its products
    // in k order.
    typedef float v8f __attribute__((vector_size(32)));
    for (int m = 0; m < 16; ++m) {
        v8f acc;
        std::memcpy(&acc, C[m], sizeof acc);
        for (int k = 0; k < K; ++k) {
            v8f bk;
            std::memcpy(&bk, B[k], sizeof bk);
            acc += A[m][k] * bk;
        }
        std::memcpy(C[m], &acc, sizeof acc);
    }
    for (unsigned int lane = 0; lane < 32; ++lane) {
        Fiber& f = b->fibers[w * 32 + lane];
        const int g = (int)lane >> 2, t = (int)lane & 3;
        f.fc[0] = C[g][2 * t];
        f.fc[1] = C[g][2 * t + 1];
        f.fc[2] = C[g + 8][2 * t];
        f.fc[3] = C[g + 8][2 * t + 1];
    }
}

// Every lane of group `gi` has arrived: compute each one's result, let them all run, and retire
// the group.
void warp_complete(Block* b, unsigned int wi, int gi, Fiber* self) {
    Warp& w = b->warps[wi];
    const Group g = w.groups[gi];
    w.groups[gi] = w.groups[--w.ngroups];
    if (g.kind == OP_MMA_BF16 || g.kind == OP_MMA_TF32 || g.kind == OP_MMA_F16) {
        mma_complete(b, wi, g.kind);
    } else if (g.kind == OP_BALLOT) {
        uint64_t bits = 0;
        for (unsigned int l = 0; l < 32; ++l)
            if ((g.mask >> l) & 1u) bits |= (b->fibers[wi * 32 + l].in != 0 ? 1ull : 0ull) << l;
        for (unsigned int l = 0; l < 32; ++l)
            if ((g.mask >> l) & 1u) b->fibers[wi * 32 + l].out = bits;
    } else if (g.kind != OP_SYNC) {
        for (unsigned int l = 0; l < 32; ++l) {
            if (!((g.mask >> l) & 1u)) continue;
            Fiber& f = b->fibers[wi * 32 + l];
            int s = shfl_source(g.kind, l, f.arg, g.width);
            if (s < 0) {
                f.out = f.in;
            } else if (!((g.mask >> s) & 1u)) {
                fail_block(b, self,
                           format("%s: lane %u of warp %u reads lane %d, which is not in the mask %08x (undefined on a GPU)",
                                  op_name(g.kind), l, wi, s, g.mask));
            } else {
                f.out = b->fibers[wi * 32 + (unsigned int)s].in;
            }
        }
    }
    for (unsigned int l = 0; l < 32; ++l)
        if ((g.mask >> l) & 1u) b->fibers[wi * 32 + l].state = RUNNABLE;
}

// Arrive at the warp barrier of operation `kind` over `mask`; returns once every lane of the
// mask has.
void warp_arrive(Fiber* f, int kind, unsigned int mask, int width) {
    Block* b = f->blk;
    Warp& w = b->warps[f->warp];
    const unsigned int me = 1u << f->lane;
    if (!(mask & me)) {
        fail_block(b, f, format("%s: %s calls %s with mask %08x, which does not include its own lane %u", op_name(kind), where(f).c_str(),
                                op_name(kind), mask, f->lane));
    }
    if (mask & ~w.exists) {
        fail_block(b, f,
                   format("%s at %s: mask %08x names lanes that do not exist (warp %u has lanes %08x; blockDim %u threads)", op_name(kind),
                          where(f).c_str(), mask, f->warp, w.exists, b->n));
    }
    if (mask & ~w.live) {
        fail_block(b, f,
                   format("%s at %s: mask %08x names lanes that have returned (live lanes %08x)", op_name(kind), where(f).c_str(), mask,
                          w.live));
    }
    if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
        fail_block(b, f, format("%s at %s: width %d is not a power of two up to 32", op_name(kind), where(f).c_str(), width));
    }
    int gi = -1;
    for (int i = 0; i < w.ngroups; ++i) {
        const Group& g = w.groups[i];
        if (g.mask == mask && g.kind == kind && g.width == width) {
            gi = i;
        } else if (g.mask & mask) {
            fail_block(b, f,
                       format("warp %u diverges: lanes %08x wait in %s (mask %08x, width %d) while %s calls %s (mask %08x, width %d)",
                              f->warp, g.arrived, op_name(g.kind), g.mask, g.width, where(f).c_str(), op_name(kind), mask, width));
        }
    }
    if (gi < 0) {
        gi = w.ngroups++;
        w.groups[gi] = Group{mask, 0, kind, width};
    }
    w.groups[gi].arrived |= me;
    if (w.groups[gi].arrived == mask) {
        warp_complete(b, f->warp, gi, f);
        return;
    }
    f->state = AT_WARP;
    run_next(f);
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// the entry points kernels call (simt.h)

void sync_block() {
    Fiber* f = checked_cur("__syncthreads");
    Block* b = f->blk;
    f->state = AT_BARRIER;
    b->at_barrier++;
    if (b->at_barrier == b->live) {
        release_barrier(b);
        return;
    }
    run_next(f);
}

uint64_t warp_op(WarpOp kind, unsigned int mask, uint64_t value, int arg, int width) {
    Fiber* f = checked_cur("a warp intrinsic");
    f->in = value;
    f->arg = arg;
    warp_arrive(f, kind, mask, width);
    return f->out;
}

void mma_m16n8k16_bf16(float* c, const unsigned int* a, const unsigned int* b) {
    Fiber* f = checked_cur("mma.sync");
    std::memcpy(f->fa, a, 16);
    std::memcpy(f->fb, b, 8);
    std::memcpy(f->fc, c, 16);
    warp_arrive(f, OP_MMA_BF16, 0xffffffffu, 32);
    std::memcpy(c, f->fc, 16);
}

void mma_m16n8k16_f16(float* c, const unsigned int* a, const unsigned int* b) {
    Fiber* f = checked_cur("mma.sync");
    std::memcpy(f->fa, a, 16);
    std::memcpy(f->fb, b, 8);
    std::memcpy(f->fc, c, 16);
    warp_arrive(f, OP_MMA_F16, 0xffffffffu, 32);
    std::memcpy(c, f->fc, 16);
}

void mma_m16n8k8_tf32(float* c, const unsigned int* a, const unsigned int* b) {
    Fiber* f = checked_cur("mma.sync");
    std::memcpy(f->fa, a, 16);
    std::memcpy(f->fb, b, 8);
    std::memcpy(f->fc, c, 16);
    warp_arrive(f, OP_MMA_TF32, 0xffffffffu, 32);
    std::memcpy(c, f->fc, 16);
}

void fail(const char* why) {
    Fiber* f = checked_cur("__trap");
    fail_block(f->blk, f, format("%s at %s", why, where(f).c_str()));
}

// ----------------------------------------------------------------------------------------------
// grids

namespace {

struct Options {
    unsigned int workers = 1;
    uint64_t shuffle = 0;
};

const Options& options() {
    static const Options o = [] {
        Options r;
        if (const char* w = std::getenv("LOCKSTEP_SIMT_WORKERS")) {
            long v = std::strtol(w, nullptr, 10);
            if (v >= 1 && v <= 256) r.workers = (unsigned int)v;
        }
        if (const char* s = std::getenv("LOCKSTEP_SIMT_SHUFFLE")) r.shuffle = std::strtoull(s, nullptr, 10);
        return r;
    }();
    return o;
}

std::atomic<uint64_t> launches{0};

thread_local std::string last_error;

// Run one block on this OS thread. Returns false (with b->error) if it failed.
bool run_block(Block& b, const unsigned int grid[3], const unsigned int block[3], uint64_t linear_block, std::vector<char*>& stacks) {
    const unsigned int bx = block[0], by = block[1], bz = block[2];
    const unsigned int n = bx * by * bz;
    const uint64_t gx = grid[0], gy = grid[1];
    const uint3 bid = {(unsigned int)(linear_block % gx), (unsigned int)((linear_block / gx) % gy), (unsigned int)(linear_block / (gx * gy))};
    b.n = n;
    b.live = n;
    b.at_barrier = 0;
    b.failed = false;
    b.error.clear();
    b.fibers.resize(n);
    const unsigned int nwarps = (n + 31) / 32;
    b.warps.assign(nwarps, Warp{});
    for (unsigned int w = 0; w < nwarps; ++w) {
        const unsigned int lanes = std::min(32u, n - w * 32);
        b.warps[w].exists = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1);
        b.warps[w].live = b.warps[w].exists;
        b.warps[w].ngroups = 0;
    }
    while (stacks.size() < n) stacks.push_back(take_stack());
    for (unsigned int i = 0; i < n; ++i) {
        Fiber& f = b.fibers[i];
        f.threadIdx = {i % bx, (i / bx) % by, i / (bx * by)};
        f.blockIdx = bid;
        f.blockDim = {bx, by, bz};
        f.gridDim = {grid[0], grid[1], grid[2]};
        f.blk = &b;
        f.linear = i;
        f.lane = i % 32;
        f.warp = i / 32;
        f.state = RUNNABLE;
        f.in = f.out = 0;
        f.arg = 0;
        StackHeader* h = reinterpret_cast<StackHeader*>(stacks[i]);
        h->fiber = &f;
        h->magic = STACK_MAGIC;
        ctx_init(&f.ctx, stack_bottom(stacks[i]), stack_size(), &f);
    }
    Fiber* first = &b.fibers[b.shuffle ? b.rng.below(n) : 0];
    ctx_switch(&b.sched, &first->ctx);
    return !b.failed;
}

}  // namespace

int run_grid(const simt_kernel* k, const unsigned int grid[3], const unsigned int block[3], void (*body)(void*), void* arg) {
    const Options& o = options();
    const uint64_t nblocks = (uint64_t)grid[0] * grid[1] * grid[2];
    const uint64_t launch = launches.fetch_add(1);
    std::vector<uint64_t> order;
    if (o.shuffle) {
        order.resize(nblocks);
        for (uint64_t i = 0; i < nblocks; ++i) order[i] = i;
        Rng r{o.shuffle * 0x9e3779b97f4a7c15ull ^ launch};
        for (uint64_t i = nblocks; i > 1; --i) std::swap(order[i - 1], order[r.next() % i]);
    }
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex err_mu;
    std::string err;
    auto worker = [&](unsigned int id) {
        Block b;
        b.kernel = k;
        b.body = body;
        b.arg = arg;
        b.shuffle = o.shuffle != 0;
        b.rng = Rng{o.shuffle ^ (launch << 20) ^ id};
        std::vector<char*> stacks;
        for (;;) {
            if (failed.load()) break;
            uint64_t i = next.fetch_add(1);
            if (i >= nblocks) break;
            if (!run_block(b, grid, block, o.shuffle ? order[i] : i, stacks)) {
                std::lock_guard<std::mutex> g(err_mu);
                if (!failed.exchange(true)) err = b.error;
                break;
            }
        }
        give_stacks(stacks);
    };
    const unsigned int nworkers = (unsigned int)std::min<uint64_t>(o.workers, nblocks);
    if (nworkers <= 1) {
        worker(0);
    } else {
        std::vector<std::thread> ts;
        for (unsigned int i = 0; i < nworkers; ++i) ts.emplace_back(worker, i);
        for (std::thread& t : ts) t.join();
    }
    if (failed.load()) {
        last_error = format("%s: %s", k->name, err.c_str());
        return 719;  // CUDA_ERROR_LAUNCH_FAILED
    }
    return 0;
}

}  // namespace simt

// ----------------------------------------------------------------------------------------------
// C interface (simt_launch.h)

// The registry tests/common/simt.rs generates: every variant and its kernels.
extern "C" const simt_variant simt_variants[];
extern "C" const int simt_nvariants;

extern "C" const simt_kernel* simt_lookup(const char* variant, const char* name) {
    for (int v = 0; v < simt_nvariants; ++v) {
        if (std::strcmp(simt_variants[v].name, variant) != 0) continue;
        for (int i = 0; i < simt_variants[v].nkernels; ++i)
            if (std::strcmp(simt_variants[v].kernels[i]->name, name) == 0) return simt_variants[v].kernels[i];
    }
    return nullptr;
}

extern "C" int simt_launch(const simt_kernel* k, const unsigned int grid[3], const unsigned int block[3], unsigned int shared_bytes,
                           void** params) {
    using simt::last_error;
    const uint64_t threads = (uint64_t)block[0] * block[1] * block[2];
    if (!k) {
        last_error = "no kernel";
        return 400;  // CUDA_ERROR_INVALID_HANDLE
    }
    // The limits of every GPU since compute capability 3.0.
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535 || threads == 0 ||
        threads > 1024 || block[0] > 1024 || block[1] > 1024 || block[2] > 64) {
        last_error = simt::format("%s: invalid launch geometry grid (%u,%u,%u) block (%u,%u,%u)", k->name, grid[0], grid[1], grid[2],
                                  block[0], block[1], block[2]);
        return 1;  // CUDA_ERROR_INVALID_VALUE
    }
    if (shared_bytes != 0) {
        last_error = simt::format("%s: %u bytes of dynamic shared memory requested; the SIMT shim supports static __shared__ only",
                                  k->name, shared_bytes);
        return 1;
    }
    if (k->nparams > 0 && !params) {
        last_error = simt::format("%s: no kernel parameters given (it takes %d)", k->name, k->nparams);
        return 1;
    }
    return k->run(k, grid, block, params);
}

extern "C" const char* simt_last_error(void) { return simt::last_error.c_str(); }
