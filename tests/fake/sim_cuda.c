/* A simulated CUDA driver for tests on machines without a GPU (tests/cuda_fake_driver.rs, the
 * gpu_* tests' fallback and tests/simt_train.rs; built by tests/common/simt.rs).
 * "Device memory" is host memory (malloc), copies are memcpy, streams and events complete at
 * once. Kernels are the real sources in kernels/ compiled as host C++ under the SIMT shim
 * (tests/simt): cuModuleGetFunction finds an entry point by name in the shim's registry and
 * cuLaunchKernel runs the whole grid before it returns. Which build of the kernels a module gets
 * (its "variant": tensor cores with TF32, without TF32, or none) follows the defines it was
 * compiled with: the simulated NVRTC (sim_nvrtc.c) writes them into the image; for an image from
 * a real NVRTC they are read from LOCKSTEP_NVRTC_OPTIONS, as the crate passes them. Compiled
 * alone (without the shim) this file still loads, and every kernel lookup fails.
 * Graph capture records kernel launches, memsets and copies on the capturing stream, and
 * cuGraphLaunch replays them in order.
 * Fault injection through the environment:
 *   SIM_CUDA_DEVICES=N  N devices (default 1), all alike;
 *   SIM_FAIL_FREE=1     cuMemFree_v2 fails (tests that Drop records the error);
 *   SIM_STREAM_STUCK=1  cuStreamQuery reports CUDA_ERROR_NOT_READY forever (a hung collective).
 * Call log: with SIM_CALL_LOG=FILE, every synchronisation, event record and stream wait appends a
 * line to FILE (`cuEventRecord EVENT STREAM`, `cuStreamWaitEvent STREAM EVENT`,
 * `cuStreamSynchronize STREAM`, `cuCtxSynchronize`, `cuEventSynchronize EVENT`; handles in hex),
 * as sim_nccl.c does for its collectives, so a test can check how calls were ordered. */
#include <stdlib.h>
#include <string.h>
#include "../simt/simt_launch.h"
typedef unsigned long long CUdeviceptr;
static int initialised = 0, init_calls = 0, live_allocs = 0;
static int ctx_token = 0;

#include <stdio.h>
#include <stdarg.h>
/* One line to SIM_CALL_LOG, if set (opened per line: several processes may append). */
static void sim_log(const char* fmt, ...) {
    const char* path = getenv("SIM_CALL_LOG");
    if (!path) return;
    FILE* f = fopen(path, "a");
    if (!f) return;
    va_list ap; va_start(ap, fmt); vfprintf(f, fmt, ap); va_end(ap);
    fputc('\n', f); fclose(f);
}
int cuInit(unsigned flags) {
    if (getenv("SIM_TRACE")) fprintf(stderr, "sim: cuInit(%u)\n", flags);
    if (flags != 0) return 1;
    initialised = 1; init_calls++; return 0;
}
/* NVRTC looks this up when libcuda.so.1 is loaded; the simulator has no export tables. */
int cuGetExportTable(const void** table, const void* id) {
    if (getenv("SIM_TRACE")) fprintf(stderr, "sim: cuGetExportTable\n");
    *table = 0; return 801;
}
static int ndev(void) { const char* v = getenv("SIM_CUDA_DEVICES"); return v ? atoi(v) : 1; }
int cuDeviceGetCount(int* n) { if (!initialised) return 3; *n = ndev(); return 0; }
int cuDriverGetVersion(int* v) { *v = 12040; return 0; }
static const char* name_of(int e) {
    switch (e) { case 0: return "CUDA_SUCCESS"; case 1: return "CUDA_ERROR_INVALID_VALUE"; case 2: return "CUDA_ERROR_OUT_OF_MEMORY";
                 case 3: return "CUDA_ERROR_NOT_INITIALIZED"; case 101: return "CUDA_ERROR_INVALID_DEVICE";
                 case 200: return "CUDA_ERROR_INVALID_IMAGE"; case 500: return "CUDA_ERROR_NOT_FOUND";
                 case 400: return "CUDA_ERROR_INVALID_HANDLE"; case 600: return "CUDA_ERROR_NOT_READY";
                 case 719: return "CUDA_ERROR_LAUNCH_FAILED"; case 801: return "CUDA_ERROR_NOT_SUPPORTED";
                 case 900: return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; case 901: return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; default: return 0; }
}
int cuGetErrorName(int e, const char** s) { *s = name_of(e); return *s ? 0 : 1; }
static char last_launch_error[1024];
/* A failed launch's message is the SIMT shim's reason (where the kernel trapped or deadlocked). */
int cuGetErrorString(int e, const char** s) {
    *s = name_of(e) ? "simulated driver error" : 0;
    if (e == 0) *s = "no error";
    if (e == 719 && last_launch_error[0]) *s = last_launch_error;
    return *s ? 0 : 1;
}
int sim_init_calls(void) { return init_calls; }
int sim_live_allocs(void) { return live_allocs; }

#define NEED_INIT if (!initialised) return 3
int cuDeviceGet(int* d, int ordinal) { NEED_INIT; if (ordinal < 0 || ordinal >= ndev()) return 101; *d = ordinal; return 0; }
int cuDeviceGetName(char* b, int len, int d) { strncpy(b, "Simulated GPU", len); b[len - 1] = 0; return 0; }
int cuDeviceGetAttribute(int* v, int attr, int d) { *v = attr == 75 ? 8 : attr == 76 ? 0 : attr == 16 ? 4 : 0; return 0; }
int cuDeviceTotalMem_v2(size_t* b, int d) { *b = (size_t)1 << 30; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) { NEED_INIT; *c = &ctx_token; return 0; }
int cuDevicePrimaryCtxRelease_v2(int d) { return 0; }
int cuCtxSetCurrent(void* c) { return 0; }
int cuCtxSynchronize(void) { sim_log("cuCtxSynchronize"); return 0; }
int cuStreamCreate(void** s, unsigned f) { *s = malloc(8); return 0; }
int cuStreamDestroy_v2(void* s) { free(s); return 0; }
int cuStreamSynchronize(void* s) { sim_log("cuStreamSynchronize %p", s); return 0; }
int cuStreamQuery(void* s) { return getenv("SIM_STREAM_STUCK") ? 600 : 0; }
static int stream_waits = 0;
int sim_stream_waits(void) { return stream_waits; }
int cuStreamWaitEvent(void* s, void* e, unsigned f) { stream_waits++; sim_log("cuStreamWaitEvent %p %p", s, e); return 0; }
int cuEventCreate(void** e, unsigned f) { *e = malloc(8); return 0; }
int cuEventDestroy_v2(void* e) { free(e); return 0; }
int cuEventRecord(void* e, void* s) { sim_log("cuEventRecord %p %p", e, s); return 0; }
int cuEventSynchronize(void* e) { sim_log("cuEventSynchronize %p", e); return 0; }
int cuEventQuery(void* e) { return getenv("SIM_STREAM_STUCK") ? 600 : 0; }
int cuEventElapsedTime(float* ms, void* a, void* b) { *ms = 0.25f; return 0; }
int cuMemAlloc_v2(CUdeviceptr* p, size_t n) { void* m = malloc(n); if (!m) return 2; *p = (CUdeviceptr)m; live_allocs++; return 0; }
int cuMemFree_v2(CUdeviceptr p) { if (getenv("SIM_FAIL_FREE")) return 1; free((void*)p); live_allocs--; return 0; }
int cuMemHostAlloc(void** p, size_t n, unsigned f) { *p = malloc(n); return *p ? 0 : 2; }
int cuMemFreeHost(void* p) { free(p); return 0; }
int cuMemGetInfo_v2(size_t* f, size_t* t) { *f = (size_t)1 << 29; *t = (size_t)1 << 30; return 0; }
/* Memsets and copies on a capturing stream become graph nodes (defined with the graphs below). */
static int capture_copy(void* s, int kind, void* dst, const void* src, size_t n, unsigned char v);
int cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void* s) {
    if (capture_copy(s, 1, (void*)p, 0, n, v)) return 0;
    memset((void*)p, v, n); return 0;
}
int cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* st) {
    if (capture_copy(st, 2, (void*)d, s, n, 0)) return 0;
    memmove((void*)d, s, n); return 0;
}
int cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void* st) {
    if (capture_copy(st, 2, d, (const void*)s, n, 0)) return 0;
    memmove(d, (void*)s, n); return 0;
}
int cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) {
    if (capture_copy(st, 2, (void*)d, (const void*)s, n, 0)) return 0;
    memmove((void*)d, (void*)s, n); return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Modules and kernels. The SIMT shim's functions are weak: without the shim linked in they are
 * null and every lookup answers CUDA_ERROR_NOT_FOUND. */
extern const simt_kernel* simt_lookup(const char* variant, const char* name) __attribute__((weak));
extern int simt_launch(const simt_kernel* k, const unsigned int grid[3], const unsigned int block[3], unsigned int shared_bytes,
                       void** params) __attribute__((weak));
extern const char* simt_last_error(void) __attribute__((weak));

#define SIM_IMAGE_MAGIC "LOCKSTEP-SIMT-IMAGE 1\n"
typedef struct { const simt_kernel* k; } func_t;
typedef struct {
    char variant[16];
    char* entries;    /* "\nname1\nname2\n" from a simulated image; NULL for a real NVRTC's image */
    func_t* funcs[256];
    int nfuncs;
} module_t;
static int module_loads = 0;
int sim_loaded_modules(void) { return module_loads; }

/* The variant a real NVRTC image was compiled as: the crate passes LOCKSTEP_NVRTC_OPTIONS to
 * NVRTC verbatim, and the simulated device is an sm_80. */
static const char* variant_from_env(void) {
    const char* o = getenv("LOCKSTEP_NVRTC_OPTIONS");
    if (o && strstr(o, "LOCKSTEP_NO_TENSOR_CORES")) return "fma";
    if (o && strstr(o, "LOCKSTEP_NO_TF32")) return "notf32";
    return "tc";
}

int cuModuleLoadData(void** m, const void* img) {
    if (!img) return 200;
    module_t* mod = calloc(1, sizeof *mod);
    if (!mod) return 2;
    const char* text = img;
    if (strncmp(text, SIM_IMAGE_MAGIC, strlen(SIM_IMAGE_MAGIC)) == 0) {
        /* LOCKSTEP-SIMT-IMAGE 1 / variant V / entry NAME ... (sim_nvrtc.c) */
        const char* v = strstr(text, "\nvariant ");
        if (!v || sscanf(v + 9, "%15s", mod->variant) != 1) { free(mod); return 200; }
        size_t cap = strlen(text) + 2, len = 1;
        mod->entries = malloc(cap);
        if (!mod->entries) { free(mod); return 2; }
        mod->entries[0] = '\n';
        for (const char* e = strstr(text, "\nentry "); e; e = strstr(e + 1, "\nentry ")) {
            const char* name = e + 7;
            size_t n = strcspn(name, "\n");
            memcpy(mod->entries + len, name, n);
            len += n;
            mod->entries[len++] = '\n';
        }
        mod->entries[len] = 0;
    } else {
        snprintf(mod->variant, sizeof mod->variant, "%s", variant_from_env());
    }
    module_loads++;
    *m = mod;
    return 0;
}
int cuModuleUnload(void* m) {
    module_t* mod = m;
    for (int i = 0; i < mod->nfuncs; i++) free(mod->funcs[i]);
    free(mod->entries);
    free(mod);
    module_loads--;
    return 0;
}
int cuModuleGetFunction(void** f, void* m, const char* name) {
    module_t* mod = m;
    if (!simt_lookup) {
        if (getenv("SIM_TRACE")) fprintf(stderr, "sim: cuModuleGetFunction(%s): the SIMT shim is not linked in\n", name);
        return 500;
    }
    if (mod->entries) {
        /* Only the image's own entry points, as a real module. */
        char key[300];
        snprintf(key, sizeof key, "\n%s\n", name);
        if (!strstr(mod->entries, key)) return 500;
    }
    const simt_kernel* k = simt_lookup(mod->variant, name);
    if (!k) return 500;
    if (mod->nfuncs == 256) return 2;
    func_t* fn = malloc(sizeof *fn);
    if (!fn) return 2;
    fn->k = k;
    mod->funcs[mod->nfuncs++] = fn;
    *f = fn;
    return 0;
}

/* The last launch failure's reason (tests assert on it). */
const char* sim_last_launch_error(void) { return last_launch_error; }
static int launch_count = 0;
int sim_launches(void) { return launch_count; }

static int run_kernel(func_t* fn, const unsigned grid[3], const unsigned block[3], unsigned shared, void** params) {
    launch_count++;
    int rc = simt_launch(fn->k, grid, block, shared, params);
    if (rc) {
        snprintf(last_launch_error, sizeof last_launch_error, "%s", simt_last_error());
        fprintf(stderr, "sim: kernel launch failed (%s): %s\n", name_of(rc) ? name_of(rc) : "?", last_launch_error);
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * Graphs: a captured stream's work as a list of nodes, replayed in order. A kernel node keeps a
 * copy of its parameter values (their sizes come from the kernel's signature), as a real graph
 * does: later changes to the caller's argument variables do not affect replays. */
typedef struct {
    int kind;                     /* 0 kernel, 1 memset, 2 copy */
    func_t* f;
    unsigned grid[3], block[3], shared;
    int nparams;
    void** params;                /* pointers into `blob` */
    unsigned char* blob;
    void* dst; const void* src; size_t bytes; unsigned char value;
} node_t;
typedef struct { int n, cap; node_t* nodes; } graph_t;
static void* capturing_stream = 0;
static graph_t* capture = 0;

static node_t* add_node(void) {
    if (capture->n == capture->cap) {
        int cap = capture->cap ? 2 * capture->cap : 64;
        node_t* nn = realloc(capture->nodes, (size_t)cap * sizeof *nn);
        if (!nn) return 0;
        capture->nodes = nn; capture->cap = cap;
    }
    node_t* r = &capture->nodes[capture->n++];
    memset(r, 0, sizeof *r);
    return r;
}

static int capture_copy(void* s, int kind, void* dst, const void* src, size_t n, unsigned char v) {
    if (!capture || s != capturing_stream) return 0;
    node_t* r = add_node();
    if (!r) return 0;
    r->kind = kind; r->dst = dst; r->src = src; r->bytes = n; r->value = v;
    return 1;
}

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void* s, void** p, void** x) {
    func_t* fn = f;
    if (!fn) return 400;
    if (x) return 1; /* the `extra` form of passing parameters is not simulated */
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    if (capture && s == capturing_stream) {
        node_t* r = add_node();
        if (!r) return 2;
        int np = fn->k->nparams;
        size_t total = 0;
        for (int i = 0; i < np; i++) total += (fn->k->param_sizes[i] + 7) & ~(size_t)7;
        r->kind = 0; r->f = fn; r->shared = sh; r->nparams = np;
        memcpy(r->grid, grid, sizeof grid); memcpy(r->block, block, sizeof block);
        r->blob = malloc(total ? total : 1);
        r->params = malloc((np ? np : 1) * sizeof(void*));
        if (!r->blob || !r->params) return 2;
        size_t off = 0;
        for (int i = 0; i < np; i++) {
            memcpy(r->blob + off, p[i], fn->k->param_sizes[i]);
            r->params[i] = r->blob + off;
            off += (fn->k->param_sizes[i] + 7) & ~(size_t)7;
        }
        return 0;
    }
    return run_kernel(fn, grid, block, sh, p);
}
int cuStreamBeginCapture_v2(void* s, int mode) {
    if (capture) return 900;
    capture = calloc(1, sizeof *capture); capturing_stream = s; return 0;
}
int cuStreamEndCapture(void* s, void** g) {
    if (!capture || s != capturing_stream) return 901;
    *g = capture; capture = 0; capturing_stream = 0; return 0;
}
static int live_graphs = 0;
int sim_live_graphs(void) { return live_graphs; }
int cuGraphInstantiateWithFlags(void** e, void* g, unsigned long long f) { *e = g; live_graphs++; return 0; }
int cuGraphLaunch(void* e, void* s) {
    graph_t* g = e;
    for (int i = 0; i < g->n; i++) {
        node_t* r = &g->nodes[i];
        if (r->kind == 1) { memset(r->dst, r->value, r->bytes); continue; }
        if (r->kind == 2) { memmove(r->dst, r->src, r->bytes); continue; }
        int rc = run_kernel(r->f, r->grid, r->block, r->shared, r->params);
        if (rc) return rc;
    }
    return 0;
}
int cuGraphExecDestroy(void* e) { live_graphs--; return 0; }
int cuGraphDestroy(void* g) {
    graph_t* gr = g;
    for (int i = 0; i < gr->n; i++) { free(gr->nodes[i].blob); free(gr->nodes[i].params); }
    free(gr->nodes);
    free(gr);
    return 0;
}
