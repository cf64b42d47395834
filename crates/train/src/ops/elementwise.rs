//! CPU twins of `kernels/elementwise.cu`: fill, scale, axpy and the split-K reduction.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`).

/// `out[i] = value` for `i < n`.
pub fn fill_f32(out: &mut [f32], value: f32, n: i64) {
    out[..n as usize].iter_mut().for_each(|v| *v = value);
}
/// `x[i] *= alpha` for `i < n`.
pub fn scale_f32(x: &mut [f32], alpha: f32, n: i64) {
    x[..n as usize].iter_mut().for_each(|v| *v *= alpha);
}
/// `y[i] += alpha * x[i]` for `i < n`.
pub fn axpy_f32(y: &mut [f32], x: &[f32], alpha: f32, n: i64) {
    y[..n as usize]
        .iter_mut()
        .zip(x)
        .for_each(|(y, x)| *y += alpha * x);
}

/// `out[i] += partials[i] + partials[n + i] + ... + partials[(splits - 1) * n + i]`, the planes
/// summed in slice order from plane 0 and added to `out` once (the second half of a split-K
/// weight gradient; see [`conv2d_backward_weight_f32`](crate::ops::twins::conv2d_backward_weight_f32)).
pub fn splitk_reduce_f32(out: &mut [f32], partials: &[f32], splits: i32, n: i64) {
    let n = n as usize;
    for (i, o) in out[..n].iter_mut().enumerate() {
        let mut s = partials[i];
        for z in 1..splits.max(1) as usize {
            s += partials[z * n + i];
        }
        *o += s;
    }
}
