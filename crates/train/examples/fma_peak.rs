//! Measured single-thread f32 FMA peak of this CPU, the denominator of the trainer's per-layer
//! GFLOP/s (`cargo bench --bench train_step`).
//!
//! Runs `CHAINS` independent FMA chains (enough to cover the FMA latency times the number of FMA
//! ports on any current x86 core: 4 cycles x 2 ports needs 8; 12 leaves slack) with the widest
//! vectors the CPU offers: AVX-512 (16 lanes), else AVX2+FMA (8), else scalar `mul_add`. One FMA
//! counts as 2 FLOPs. Reports the best of several timed rounds, since the probe only wants what
//! the core can do, not what a loaded machine gave it on average (the median is printed too).
//!
//! Run: `cargo run --release --example fma_peak [-- SECONDS_PER_ROUND]`.

use std::hint::black_box;
use std::time::Instant;

/// Independent accumulator chains per iteration.
const CHAINS: usize = 12;

/// FMAs per chain per call of a kernel.
const ITERS: u64 = 1 << 20;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn chains_avx512(seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(seed); CHAINS];
    for _ in 0..ITERS {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in acc {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn chains_avx2(seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    for _ in 0..ITERS {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let mut out = [0.0f32; 8];
    let mut s = _mm256_setzero_ps();
    for x in acc {
        s = _mm256_add_ps(s, x);
    }
    // SAFETY: `out` holds exactly the 8 floats an unaligned 256-bit store writes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

fn chains_scalar(seed: f32) -> f32 {
    let mut acc = [seed; CHAINS];
    for _ in 0..ITERS {
        for x in acc.iter_mut() {
            *x = x.mul_add(0.999_999, 1e-7);
        }
    }
    acc.iter().sum()
}

/// The widest kernel this CPU runs, its name and its lanes.
fn pick() -> (&'static str, usize, fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked just above), the only feature the kernel needs.
            return ("avx512 (16 lanes)", 16, |s| unsafe { chains_avx512(s) });
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return ("avx2+fma (8 lanes)", 8, |s| unsafe { chains_avx2(s) });
        }
    }
    ("scalar mul_add", 1, chains_scalar)
}

/// What [`measure`] found.
pub struct Peak {
    /// Kernel used (vector width).
    pub kind: &'static str,
    /// Best round, GFLOP/s.
    pub best: f64,
    /// Median round, GFLOP/s.
    pub median: f64,
}

/// Time 9 rounds of `secs` seconds each on the calling thread.
pub fn measure(secs: f64) -> Peak {
    let (kind, lanes, kernel) = pick();
    let flops_per_call = (CHAINS as u64 * ITERS * lanes as u64 * 2) as f64;
    // Warm up (clock ramp, AVX-512 licence switch) before timing.
    black_box(kernel(black_box(1.0)));
    let mut rates = Vec::new();
    for _ in 0..9 {
        let (t, mut calls) = (Instant::now(), 0u64);
        while t.elapsed().as_secs_f64() < secs {
            black_box(kernel(black_box(1.0)));
            calls += 1;
        }
        rates.push(calls as f64 * flops_per_call / t.elapsed().as_secs_f64() / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    Peak {
        kind,
        best: rates[rates.len() - 1],
        median: rates[rates.len() / 2],
    }
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(0.5);
    let p = measure(secs);
    println!(
        "fma_peak: {}, {CHAINS} chains, 1 thread: best {:.1} GFLOP/s, median {:.1} GFLOP/s (9 rounds of {secs} s)",
        p.kind, p.best, p.median
    );
}
