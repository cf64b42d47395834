//! CPU twins of `kernels/activation.cu`: ReLU forward and backward.
//!
//! The conventions every twin follows are in the module documentation (`twins/mod.rs`).

/// `out[i] = max(inp[i], 0)`.
pub fn relu_forward_f32(out: &mut [f32], inp: &[f32], n: i32) {
    for i in 0..n as usize {
        out[i] = inp[i].max(0.0);
    }
}

/// `dinp[i] = out[i] > 0 ? dout[i] : 0` (overwritten).
pub fn relu_backward_f32(dinp: &mut [f32], out: &[f32], dout: &[f32], n: i32) {
    for i in 0..n as usize {
        dinp[i] = if out[i] > 0.0 { dout[i] } else { 0.0 };
    }
}
