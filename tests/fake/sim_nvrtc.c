/* A simulated NVRTC for tests without a GPU, paired with sim_cuda.c and the SIMT shim
 * (tests/simt; built by tests/common/simt.rs as libnvrtc.so.12). The kernels themselves were
 * compiled ahead of time as host C++; "compiling" here only records what a real compile would
 * decide and the driver needs: which build variant the options select, and the program's
 * `extern "C" __global__` entry points. The image is text:
 *
 *   LOCKSTEP-SIMT-IMAGE 1
 *   program conv2d.cu
 *   variant tc | notf32 | fma
 *   entry conv2d_forward_f32
 *   ...
 *
 * Variant: "fma" when -DLOCKSTEP_NO_TENSOR_CORES is given or the target arch is below sm_80 (no
 * mma.sync), else "notf32" with -DLOCKSTEP_NO_TF32, else "tc". A source without any entry point
 * fails to compile (NVRTC_ERROR_COMPILATION) with a log saying so, like an empty module would be
 * useless. SIM_NVRTC_FAIL=1 makes every compile fail that way. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char* src;
    char* name;
    char* image;
    char* log;
} prog_t;

/* 12.4: tests/common/simt.rs builds an empty libnvrtc-builtins.so.12.4 beside this library. */
int nvrtcVersion(int* major, int* minor) { *major = 12; *minor = 4; return 0; }

const char* nvrtcGetErrorString(int r) {
    switch (r) {
        case 0: return "NVRTC_SUCCESS";
        case 1: return "NVRTC_ERROR_OUT_OF_MEMORY";
        case 3: return "NVRTC_ERROR_INVALID_INPUT";
        case 4: return "NVRTC_ERROR_INVALID_PROGRAM";
        case 6: return "NVRTC_ERROR_COMPILATION";
        default: return "NVRTC_ERROR (simulated)";
    }
}

static char* dup(const char* s) {
    size_t n = strlen(s) + 1;
    char* d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

int nvrtcCreateProgram(void** p, const char* src, const char* name, int nh, const char* const* headers, const char* const* names) {
    (void)nh; (void)headers; (void)names;
    if (!p || !src) return 3;
    prog_t* pr = calloc(1, sizeof *pr);
    if (!pr) return 1;
    pr->src = dup(src);
    pr->name = dup(name ? name : "default_program");
    if (!pr->src || !pr->name) return 1;
    *p = pr;
    return 0;
}

int nvrtcDestroyProgram(void** p) {
    if (!p || !*p) return 4;
    prog_t* pr = *p;
    free(pr->src); free(pr->name); free(pr->image); free(pr->log); free(pr);
    *p = 0;
    return 0;
}

/* The source with comments blanked (entry points in comments do not count). */
static char* strip_comments(const char* s) {
    char* o = dup(s);
    if (!o) return 0;
    for (char* c = o; *c;) {
        if (c[0] == '/' && c[1] == '/') { while (*c && *c != '\n') *c++ = ' '; }
        else if (c[0] == '/' && c[1] == '*') {
            char* e = strstr(c + 2, "*/");
            char* end = e ? e + 2 : c + strlen(c);
            for (; c < end; c++) if (*c != '\n') *c = ' ';
        } else c++;
    }
    return o;
}

static int is_ident(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

/* Append every `extern "C" __global__ void [__launch_bounds__(...)] NAME(` as "entry NAME\n". */
static int append_entries(const char* code, char* out, size_t cap, size_t* len) {
    int found = 0;
    for (const char* at = strstr(code, "extern \"C\""); at; at = strstr(at + 1, "extern \"C\"")) {
        const char* r = at + 10;
        while (*r == ' ' || *r == '\n' || *r == '\t') r++;
        if (strncmp(r, "__global__", 10) != 0) continue;
        r += 10;
        while (*r == ' ' || *r == '\n' || *r == '\t') r++;
        if (strncmp(r, "void", 4) != 0) continue;
        r += 4;
        while (*r == ' ' || *r == '\n' || *r == '\t') r++;
        if (strncmp(r, "__launch_bounds__", 17) == 0) {
            r = strchr(r, ')');
            if (!r) break;
            r++;
            while (*r == ' ' || *r == '\n' || *r == '\t') r++;
        }
        size_t n = 0;
        while (is_ident(r[n])) n++;
        if (n == 0 || *len + n + 8 >= cap) continue;
        *len += (size_t)snprintf(out + *len, cap - *len, "entry %.*s\n", (int)n, r);
        found++;
    }
    return found;
}

int nvrtcCompileProgram(void* p, int nopt, const char* const* opts) {
    prog_t* pr = p;
    if (!pr) return 4;
    int no_tc = 0, no_tf32 = 0, arch = 80;
    for (int i = 0; i < nopt; i++) {
        const char* o = opts[i];
        if (strstr(o, "LOCKSTEP_NO_TENSOR_CORES")) no_tc = 1;
        if (strstr(o, "LOCKSTEP_NO_TF32")) no_tf32 = 1;
        const char* a = strstr(o, "_");
        if ((strncmp(o, "--gpu-architecture=", 19) == 0 || strncmp(o, "-arch=", 6) == 0) && a) arch = atoi(a + 1);
    }
    const char* variant = (no_tc || arch < 80) ? "fma" : no_tf32 ? "notf32" : "tc";
    char* code = strip_comments(pr->src);
    size_t cap = strlen(pr->src) + 256, len = 0;
    free(pr->image);
    pr->image = malloc(cap);
    if (!code || !pr->image) { free(code); return 1; }
    len = (size_t)snprintf(pr->image, cap, "LOCKSTEP-SIMT-IMAGE 1\nprogram %s\nvariant %s\n", pr->name, variant);
    int n = append_entries(code, pr->image, cap, &len);
    free(code);
    free(pr->log);
    char buf[512];
    if (getenv("SIM_NVRTC_FAIL") || n == 0) {
        snprintf(buf, sizeof buf, "%s: simulated NVRTC: %s", pr->name,
                 n == 0 ? "no extern \"C\" __global__ entry point in the source" : "compile failure injected by SIM_NVRTC_FAIL");
        pr->log = dup(buf);
        return 6;
    }
    snprintf(buf, sizeof buf, "%s: simulated NVRTC: %d entry points, SIMT variant %s (arch sm_%d)", pr->name, n, variant, arch);
    pr->log = dup(buf);
    return 0;
}

int nvrtcGetProgramLogSize(void* p, size_t* n) { prog_t* pr = p; *n = pr && pr->log ? strlen(pr->log) + 1 : 1; return 0; }
int nvrtcGetProgramLog(void* p, char* out) { prog_t* pr = p; strcpy(out, pr && pr->log ? pr->log : ""); return 0; }

static int image_size(void* p, size_t* n) {
    prog_t* pr = p;
    if (!pr || !pr->image) return 4;
    *n = strlen(pr->image) + 1;
    return 0;
}
static int image_copy(void* p, char* out) {
    prog_t* pr = p;
    if (!pr || !pr->image) return 4;
    memcpy(out, pr->image, strlen(pr->image) + 1);
    return 0;
}
int nvrtcGetPTXSize(void* p, size_t* n) { return image_size(p, n); }
int nvrtcGetPTX(void* p, char* out) { return image_copy(p, out); }
int nvrtcGetCUBINSize(void* p, size_t* n) { return image_size(p, n); }
int nvrtcGetCUBIN(void* p, char* out) { return image_copy(p, out); }
