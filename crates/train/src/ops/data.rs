//! CPU twins of `kernels/data.cu`: batch gathering, gradient bucket flatten/unflatten, and the
//! f32 <-> bf16 / f16 casts.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`).

use half::{bf16, f16};

/// `images[b, j] = dataset_images[indices[b], j] / 255`, `labels[b] = dataset_labels[indices[b]]`.
#[allow(clippy::too_many_arguments)]
pub fn gather_batch_f32(
    images: &mut [f32],
    labels: &mut [i32],
    dataset_images: &[u8],
    dataset_labels: &[u8],
    indices: &[i32],
    batch: i32,
    image_size: i32,
) {
    let sz = image_size as usize;
    for b in 0..batch as usize {
        let src = indices[b] as usize * sz;
        for j in 0..sz {
            images[b * sz + j] = dataset_images[src + j] as f32 / 255.0;
        }
        labels[b] = dataset_labels[indices[b] as usize] as i32;
    }
}

/// Host stand-in for one `BucketEntry` of `bucket_flatten_f32`: the tensor itself instead of its
/// device address, and its offset in the bucket (both in f32 elements).
#[derive(Debug)]
pub struct BucketSrc<'a> {
    /// The tensor (the kernel's `ptr`).
    pub tensor: &'a [f32],
    /// Offset in the bucket.
    pub offset: i64,
    /// Elements.
    pub len: i64,
}

/// Host stand-in for one `BucketEntry` of `bucket_unflatten_f32` (the tensor is written).
#[derive(Debug)]
pub struct BucketDst<'a> {
    /// The tensor (the kernel's `ptr`).
    pub tensor: &'a mut [f32],
    /// Offset in the bucket.
    pub offset: i64,
    /// Elements.
    pub len: i64,
}

/// `bucket[offset + i] = tensor[i]` for every entry.
pub fn bucket_flatten_f32(bucket: &mut [f32], table: &[BucketSrc<'_>], num_entries: i32) {
    for e in &table[..num_entries as usize] {
        let (o, l) = (e.offset as usize, e.len as usize);
        bucket[o..o + l].copy_from_slice(&e.tensor[..l]);
    }
}

/// `tensor[i] = bucket[offset + i] * scale` for every entry.
pub fn bucket_unflatten_f32(
    table: &mut [BucketDst<'_>],
    bucket: &[f32],
    num_entries: i32,
    scale: f32,
) {
    for e in &mut table[..num_entries as usize] {
        let (o, l) = (e.offset as usize, e.len as usize);
        for (d, &s) in e.tensor[..l].iter_mut().zip(&bucket[o..o + l]) {
            *d = s * scale;
        }
    }
}

/// The element-wise casts, one kernel each: `name(out, inp, n)` sets `out[i] = convert(inp[i])`
/// for the first `n` elements.
macro_rules! casts {
    ($($(#[$doc:meta])* $name:ident: $from:ty => $to:ty = $convert:expr;)*) => {$(
        $(#[$doc])*
        pub fn $name(out: &mut [$to], inp: &[$from], n: i32) {
            for i in 0..n as usize {
                out[i] = $convert(inp[i]);
            }
        }
    )*};
}

casts! {
    /// `out[i] = bf16(inp[i])`, round to nearest even (NaN stays NaN).
    cast_f32_bf16: f32 => bf16 = bf16::from_f32;
    /// `out[i] = f32(inp[i])` (exact).
    cast_bf16_f32: bf16 => f32 = bf16::to_f32;
    /// `out[i] = f16(inp[i])`, round to nearest even (beyond ±65504 to ±infinity, NaN stays NaN).
    cast_f32_f16: f32 => f16 = f16::from_f32;
    /// `out[i] = f32(inp[i])` (exact).
    cast_f16_f32: f16 => f32 = f16::to_f32;
}
