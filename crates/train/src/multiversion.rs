//! Functions compiled more than once: for AVX-512, for AVX2+FMA and portable, picked at run time.
//!
//! The release build targets generic x86-64 (so the binaries run on any x86-64 machine), which
//! leaves the auto-vectoriser SSE2 only. The element-wise loops of the engine that the profile
//! shows (Winograd transforms, the fused BatchNorm + ReLU + pool backward) are written as plain Rust over
//! slices and compiled a second and third time with wider vectors enabled. Rust does not contract
//! `a * b + c` into an FMA, nor reorder float sums, without an explicit call, so every version
//! computes the same bits: the choice changes only the speed.

/// Run the body compiled for AVX-512 or AVX2+FMA when the CPU has them, else portable.
macro_rules! dispatch {
    ($name:ident, $imp:ident, ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v4($($arg: $ty),*) {
                    $imp($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v3($($arg: $ty),*) {
                    $imp($($arg),*)
                }
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports every feature `v4` is compiled for (checked above).
                    return unsafe { v4($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports every feature `v3` is compiled for (checked above).
                    return unsafe { v3($($arg),*) };
                }
            }
            $imp($($arg),*)
        }
    };
}

pub(crate) use dispatch;
