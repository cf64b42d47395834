/* A simulated CUDA driver for tests on machines without a GPU (tests/cuda_fake_driver.rs).
 * "Device memory" is host memory (malloc), copies are memcpy, streams and events complete at
 * once. Modules load any image; launching runs a host twin of the kernels/elementwise.cu entry
 * points (so argument marshalling is checked), other names fail. Graph capture records kernel
 * launches and cuGraphLaunch replays them.
 * Fault injection through the environment:
 *   SIM_CUDA_DEVICES=N  N devices (default 1), all alike;
 *   SIM_FAIL_FREE=1     cuMemFree_v2 fails (tests that Drop records the error);
 *   SIM_STREAM_STUCK=1  cuStreamQuery reports CUDA_ERROR_NOT_READY forever (a hung collective). */
#include <stdlib.h>
#include <string.h>
typedef unsigned long long CUdeviceptr;
static int initialised = 0, init_calls = 0, live_allocs = 0;
static int ctx_token = 0;

#include <stdio.h>
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
                 case 600: return "CUDA_ERROR_NOT_READY"; case 801: return "CUDA_ERROR_NOT_SUPPORTED"; default: return 0; }
}
int cuGetErrorName(int e, const char** s) { *s = name_of(e); return *s ? 0 : 1; }
int cuGetErrorString(int e, const char** s) { *s = name_of(e) ? "simulated driver error" : 0; if (e == 0) *s = "no error"; return *s ? 0 : 1; }
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
int cuCtxSynchronize(void) { return 0; }
int cuStreamCreate(void** s, unsigned f) { *s = malloc(8); return 0; }
int cuStreamDestroy_v2(void* s) { free(s); return 0; }
int cuStreamSynchronize(void* s) { return 0; }
int cuStreamQuery(void* s) { return getenv("SIM_STREAM_STUCK") ? 600 : 0; }
static int stream_waits = 0;
int sim_stream_waits(void) { return stream_waits; }
int cuStreamWaitEvent(void* s, void* e, unsigned f) { stream_waits++; return 0; }
int cuEventCreate(void** e, unsigned f) { *e = malloc(8); return 0; }
int cuEventDestroy_v2(void* e) { free(e); return 0; }
int cuEventRecord(void* e, void* s) { return 0; }
int cuEventSynchronize(void* e) { return 0; }
int cuEventQuery(void* e) { return getenv("SIM_STREAM_STUCK") ? 600 : 0; }
int cuEventElapsedTime(float* ms, void* a, void* b) { *ms = 0.25f; return 0; }
int cuMemAlloc_v2(CUdeviceptr* p, size_t n) { void* m = malloc(n); if (!m) return 2; *p = (CUdeviceptr)m; live_allocs++; return 0; }
int cuMemFree_v2(CUdeviceptr p) { if (getenv("SIM_FAIL_FREE")) return 1; free((void*)p); live_allocs--; return 0; }
int cuMemHostAlloc(void** p, size_t n, unsigned f) { *p = malloc(n); return *p ? 0 : 2; }
int cuMemFreeHost(void* p) { free(p); return 0; }
int cuMemGetInfo_v2(size_t* f, size_t* t) { *f = (size_t)1 << 29; *t = (size_t)1 << 30; return 0; }
int cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, void* s) { memset((void*)p, v, n); return 0; }
int cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* st) { memmove((void*)d, s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void* st) { memmove(d, (void*)s, n); return 0; }
int cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) { memmove((void*)d, (void*)s, n); return 0; }
static int module_token = 0, module_loads = 0;
int cuModuleLoadData(void** m, const void* img) { if (!img) return 200; module_loads++; *m = &module_token; return 0; }
int cuModuleUnload(void* m) { module_loads--; return 0; }
int sim_loaded_modules(void) { return module_loads; }
static const char* const kernels[] = {"fill_f32", "scale_f32", "axpy_f32"};
int cuModuleGetFunction(void** f, void* m, const char* name) {
    for (int i = 0; i < 3; i++) if (strcmp(name, kernels[i]) == 0) { *f = (void*)kernels[i]; return 0; }
    return 500;
}
/* Graph capture: launches on a capturing stream are recorded (function + 4 parameter words) and
 * replayed by cuGraphLaunch. Only kernel launches are captured. */
typedef struct { void* f; unsigned gx, bx; unsigned long long words[4]; } rec_t;
typedef struct { int n; rec_t recs[64]; } graph_t;
static void* capturing_stream = 0;
static graph_t* capture = 0;
static int run_kernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, void** p);
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned sh, void* s, void** p, void** x) {
    if (capture && s == capturing_stream) {
        if (capture->n == 64) return 2;
        rec_t* r = &capture->recs[capture->n++];
        r->f = f; r->gx = gx; r->bx = bx;
        int np = strcmp((const char*)f, "axpy_f32") == 0 ? 4 : 3;
        for (int i = 0; i < np; i++) memcpy(&r->words[i], p[i], 8);
        return 0;
    }
    return run_kernel(f, gx, gy, gz, bx, by, bz, p);
}
static int run_kernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, void** p) {

    if (gx == 0 || bx == 0 || bx * by * bz > 1024) return 1;
    const char* name = (const char*)f;
    if (strcmp(name, "fill_f32") == 0) {
        float* out = *(float**)p[0]; float v = *(float*)p[1]; long long n = *(long long*)p[2];
        for (long long i = 0; i < n; i++) out[i] = v;
    } else if (strcmp(name, "scale_f32") == 0) {
        float* xs = *(float**)p[0]; float a = *(float*)p[1]; long long n = *(long long*)p[2];
        for (long long i = 0; i < n; i++) xs[i] *= a;
    } else if (strcmp(name, "axpy_f32") == 0) {
        float* y = *(float**)p[0]; const float* xs = *(const float**)p[1]; float a = *(float*)p[2]; long long n = *(long long*)p[3];
        for (long long i = 0; i < n; i++) y[i] += a * xs[i];
    } else {
        return 500;
    }
    return 0;
}
int cuStreamBeginCapture_v2(void* s, int mode) {
    if (capture) return 900; /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED */
    capture = calloc(1, sizeof *capture); capturing_stream = s; return 0;
}
int cuStreamEndCapture(void* s, void** g) {
    if (!capture || s != capturing_stream) return 901; /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED */
    *g = capture; capture = 0; capturing_stream = 0; return 0;
}
static int live_graphs = 0;
int sim_live_graphs(void) { return live_graphs; }
int cuGraphInstantiateWithFlags(void** e, void* g, unsigned long long f) { *e = g; live_graphs++; return 0; }
int cuGraphLaunch(void* e, void* s) {
    graph_t* g = e;
    for (int i = 0; i < g->n; i++) {
        rec_t* r = &g->recs[i];
        void* p[4] = {&r->words[0], &r->words[1], &r->words[2], &r->words[3]};
        int rc = run_kernel(r->f, r->gx, 1, 1, r->bx, 1, 1, p);
        if (rc) return rc;
    }
    return 0;
}
int cuGraphExecDestroy(void* e) { live_graphs--; return 0; }
int cuGraphDestroy(void* g) { free(g); return 0; }
