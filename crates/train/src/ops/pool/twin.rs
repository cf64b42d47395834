//! CPU twins of `kernels/pool.cu`: 2-D max pooling forward (with argmax indices) and backward.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`); the
//! kernels' scalar arguments arrive as one [`Pool2dShape`].

use super::Pool2dShape;

/// Max pooling with saved argmax offsets (`iy*in_w + ix` inside the plane); first maximum wins
/// ties, NaN propagates.
pub fn maxpool2d_forward_f32(
    out: &mut [f32],
    indices: &mut [i32],
    inp: &[f32],
    shape: Pool2dShape,
) {
    let (ih, iw, k, s) = (shape.in_h, shape.in_w, shape.kernel, shape.stride);
    let (oh, ow) = (shape.out_h(), shape.out_w());
    for plane in 0..shape.planes() {
        let src = &inp[plane * ih * iw..(plane + 1) * ih * iw];
        for oy in 0..oh {
            for ox in 0..ow {
                let (y0, x0) = (oy * s, ox * s);
                let (mut best, mut arg) = (f32::NEG_INFINITY, y0 * iw + x0);
                for ky in 0..k {
                    for kx in 0..k {
                        let idx = (y0 + ky) * iw + x0 + kx;
                        let v = src[idx];
                        if v > best || (v.is_nan() && !best.is_nan()) {
                            best = v;
                            arg = idx;
                        }
                    }
                }
                let o = (plane * oh + oy) * ow + ox;
                out[o] = best;
                indices[o] = arg as i32;
            }
        }
    }
}

/// `dinp` (overwritten) = Σ of `dout` over the windows whose saved argmax is that input pixel.
pub fn maxpool2d_backward_f32(dinp: &mut [f32], dout: &[f32], indices: &[i32], shape: Pool2dShape) {
    let (ihw, ohw) = (shape.in_h * shape.in_w, shape.out_h() * shape.out_w());
    for plane in 0..shape.planes() {
        let d = &mut dinp[plane * ihw..(plane + 1) * ihw];
        d.fill(0.0);
        for o in plane * ohw..(plane + 1) * ohw {
            d[indices[o] as usize] += dout[o];
        }
    }
}
