//! CPU twins of `kernels/pool.cu`: 2-D max pooling forward (with argmax indices) and backward.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`).

/// Max pooling with saved argmax offsets (`iy*in_w + ix` inside the plane); first maximum wins
/// ties, NaN propagates.
#[allow(clippy::too_many_arguments)]
pub fn maxpool2d_forward_f32(
    out: &mut [f32],
    indices: &mut [i32],
    inp: &[f32],
    batch: i32,
    channels: i32,
    in_h: i32,
    in_w: i32,
    kernel: i32,
    stride: i32,
) {
    let (ih, iw, k, s) = (
        in_h as usize,
        in_w as usize,
        kernel as usize,
        stride as usize,
    );
    let (oh, ow) = ((ih - k) / s + 1, (iw - k) / s + 1);
    for plane in 0..(batch * channels) as usize {
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
#[allow(clippy::too_many_arguments)]
pub fn maxpool2d_backward_f32(
    dinp: &mut [f32],
    dout: &[f32],
    indices: &[i32],
    batch: i32,
    channels: i32,
    in_h: i32,
    in_w: i32,
    kernel: i32,
    stride: i32,
) {
    let (ih, iw, k, s) = (
        in_h as usize,
        in_w as usize,
        kernel as usize,
        stride as usize,
    );
    let (oh, ow) = ((ih - k) / s + 1, (iw - k) / s + 1);
    for plane in 0..(batch * channels) as usize {
        let d = &mut dinp[plane * ih * iw..(plane + 1) * ih * iw];
        d.fill(0.0);
        for o in plane * oh * ow..(plane + 1) * oh * ow {
            d[indices[o] as usize] += dout[o];
        }
    }
}
