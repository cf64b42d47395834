/* simt_launch.h: the launch interface of the SIMT shim (simt.cpp), shared by the simulated
 * driver (tests/fake/sim_cuda.c, C) and the launch trampolines tests/common/simt.rs generates
 * for every kernel entry point (C++).
 *
 * A trampoline turns cuLaunchKernel's `void** params` back into the kernel's typed arguments:
 * the parameter types come from the kernel's own C++ declaration (template deduction), so
 * nothing is copied by hand, and a static_assert checks them against the crate's signature
 * table (build.rs parses the same declarations for the Rust launch builder). */
#ifndef LOCKSTEP_SIMT_LAUNCH_H
#define LOCKSTEP_SIMT_LAUNCH_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One kernel entry point of one build variant. */
typedef struct simt_kernel {
    /* The extern "C" name in the kernel source. */
    const char* name;
    /* Number of parameters and the size in bytes of each (what params[i] points to). */
    int nparams;
    const unsigned int* param_sizes;
    /* Run the whole grid; 0, or a CUDA error code with simt_last_error() saying why. */
    int (*run)(const struct simt_kernel* self, const unsigned int grid[3], const unsigned int block[3], void** params);
} simt_kernel;

/* A build variant: the kernels compiled with one set of NVRTC-style defines. */
typedef struct simt_variant {
    /* "tc" (tensor cores, TF32 on), "notf32" (-DLOCKSTEP_NO_TF32), "fma" (-DLOCKSTEP_NO_TENSOR_CORES). */
    const char* name;
    const simt_kernel* const* kernels;
    int nkernels;
} simt_variant;

/* The kernel `name` of variant `variant`, or NULL. */
const simt_kernel* simt_lookup(const char* variant, const char* name);
/* Validate the geometry and run the grid to completion: 0 or a CUDA error code
 * (1 CUDA_ERROR_INVALID_VALUE for a bad geometry, 719 CUDA_ERROR_LAUNCH_FAILED for a kernel
 * that trapped, deadlocked or misused a warp intrinsic). */
int simt_launch(const simt_kernel* k, const unsigned int grid[3], const unsigned int block[3], unsigned int shared_bytes,
                void** params);
/* Why the last failed launch on this OS thread failed. */
const char* simt_last_error(void);

#ifdef __cplusplus
}

#include <tuple>
#include <type_traits>
#include <utility>

namespace simt {

/* Run `body(arg)` as every thread of the grid (simt.cpp). */
int run_grid(const simt_kernel* k, const unsigned int grid[3], const unsigned int block[3], void (*body)(void*), void* arg);

template <class F>
struct Fn;
template <class... A>
struct Fn<void (*)(A...)> {
    typedef std::tuple<typename std::remove_cv<A>::type...> Args;
    static constexpr int n = (int)sizeof...(A);
    static constexpr unsigned int sizes[sizeof...(A) + 1] = {(unsigned int)sizeof(A)..., 0u};
    template <size_t... I>
    static Args unpack(void** p, std::index_sequence<I...>) {
        return Args(*static_cast<typename std::remove_cv<A>::type*>(p[I])...);
    }
};
template <class... A>
constexpr unsigned int Fn<void (*)(A...)>::sizes[sizeof...(A) + 1];

/* The trampoline of kernel F: copy the arguments out of `params` once, then run the grid with
 * every thread calling F on that copy. */
template <auto F>
int run_kernel(const simt_kernel* self, const unsigned int grid[3], const unsigned int block[3], void** params) {
    typedef Fn<decltype(F)> FT;
    typename FT::Args args = FT::unpack(params, std::make_index_sequence<FT::n>{});
    return run_grid(
        self, grid, block, [](void* a) { std::apply(F, *static_cast<typename FT::Args*>(a)); }, &args);
}

/* Signature codes, as tests/common/simt.rs writes the crate's table: per parameter a kind
 * (r = const pointer, w = pointer, s = scalar) and an element type (f f32, d f64, i i32, l i64,
 * b u8, c i8, u u32, q u64, h bf16 = any 2-byte struct; a struct whose size is a multiple of
 * 8 is l, as build.rs passes BucketEntry tables as i64 words), separated by spaces. */
template <class T>
constexpr char dtype_code() {
    typedef typename std::remove_cv<T>::type U;
    return std::is_same<U, float>::value                ? 'f'
           : std::is_same<U, double>::value             ? 'd'
           : std::is_same<U, int>::value                ? 'i'
           : std::is_same<U, long long>::value          ? 'l'
           : std::is_same<U, unsigned char>::value      ? 'b'
           : std::is_same<U, signed char>::value        ? 'c'
           : std::is_same<U, unsigned int>::value       ? 'u'
           : std::is_same<U, unsigned long long>::value ? 'q'
           : std::is_class<U>::value && sizeof(U) == 2  ? 'h'
           : std::is_class<U>::value && sizeof(U) % 8 == 0 ? 'l'
                                                          : '?';
}
template <class A>
constexpr char kind_code() {
    return std::is_pointer<A>::value ? (std::is_const<typename std::remove_pointer<A>::type>::value ? 'r' : 'w') : 's';
}
template <class A>
constexpr char elem_code() {
    return dtype_code<typename std::conditional<std::is_pointer<A>::value, typename std::remove_pointer<A>::type, A>::type>();
}
template <class F>
struct Sig;
template <class... A>
struct Sig<void (*)(A...)> {
    static constexpr bool matches(const char* s) {
        const char k[] = {kind_code<A>()..., 0};
        const char d[] = {elem_code<A>()..., 0};
        const int n = (int)sizeof...(A);
        for (int i = 0; i < n; ++i) {
            if (s[3 * i] != k[i] || s[3 * i + 1] != d[i]) return false;
            if (s[3 * i + 2] != (i + 1 < n ? ' ' : '\0')) return false;
        }
        return n > 0 || s[0] == '\0';
    }
};

}  // namespace simt
#endif /* __cplusplus */

#endif /* LOCKSTEP_SIMT_LAUNCH_H */
