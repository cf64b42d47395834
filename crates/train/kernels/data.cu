// data.cu: data movement - batch gathering from the device-resident dataset, gradient bucket
// flatten/unflatten for the all-reduce, and f32 <-> bf16 / fp16 casts.
//
// CPU twins: crates/train/src/ops/data.rs.
// Entry points (the twins take the same tensors in the same order):
//   gather_batch_f32    (images, labels, dataset_images, dataset_labels, indices, batch, image_size)
//   bucket_flatten_f32  (bucket, table, num_entries)
//   bucket_unflatten_f32(table, bucket, num_entries, scale)
//   cast_f32_bf16       (out, inp, n)
//   cast_bf16_f32       (out, inp, n)
//   cast_f32_f16        (out, inp, n)
//   cast_f16_f32        (out, inp, n)
// batch, image_size, num_entries, n are int (Rust i32); scale is f32.
//
// gather_batch_f32: dataset_images is the whole u8 image set (num_images, image_size), e.g.
//   (60000, 784) for FashionMNIST, uploaded once; dataset_labels its u8 labels; indices (batch)
//   int32 sample ids of this rank's batch (the sampler's output).
//     images[b, j] = dataset_images[indices[b], j] / 255      (f32, (batch, 1, 28, 28) as NCHW)
//     labels[b]    = dataset_labels[indices[b]]               (int32, for softmax_xent_*)
//   Launch: block 256, grid (ceil_div(image_size, 256), batch): blockIdx.y is the sample, so
//   each block copies a contiguous run of one image (coalesced) with no division per element.
//
// bucket_flatten_f32 / bucket_unflatten_f32: `table` is a device array of num_entries
//   BucketEntry, one per tensor in the bucket.
//     flatten:   bucket[off + i] = tensor[i]            for i < len
//     unflatten: tensor[i] = bucket[off + i] * scale    (scale = 1/world_size turns the summed
//                all-reduce result into the mean, in the same pass; 1.0 for a plain copy)
//   Launch: block 256, grid (blocks_x, num_entries): blockIdx.y picks the tensor, blockIdx.x
//   strides over it (grid-stride; blocks_x = ceil_div(largest len, 256), capped, is fine).
//
// cast_f32_bf16: out[i] = bf16(inp[i]) round-to-nearest-even (NaN stays NaN), as
//   __float2bfloat16 and Rust's half::bf16::from_f32. cast_bf16_f32: exact widening.
// cast_f32_f16: out[i] = fp16(inp[i]) round-to-nearest-even, beyond ±65504 (from 65520 on) to
//   ±infinity, tiny values to subnormals or zero, as __float2half_rn and half::f16::from_f32;
//   cast_f16_f32: exact widening.
//   Launch (all four): block 256, grid ceil_div(n, 256) (grid-stride).
#include "common.cuh"

// ----------------------------------------------------------------------------
// bucket table entry
//
// Rust twin: BucketEntry in crates/train/src/device/kernels/mod.rs, declared as
//   #[repr(C)] struct BucketEntry { ptr: u64, offset: i64, len: i64 }
// (24 bytes, 8-byte aligned; ptr is the tensor's CUdeviceptr, offset/len are in f32 elements).
// Not needed when gradients already live in one flat buffer (then a bucket is just a range of
// it and the all-reduce runs in place); it serves per-tensor gradient allocations.
struct BucketEntry {
    unsigned long long ptr;
    long long offset;
    long long len;
};

// ----------------------------------------------------------------------------
// batch gather

extern "C" __global__ void gather_batch_f32(float* images, int* labels, const unsigned char* dataset_images,
                                            const unsigned char* dataset_labels, const int* indices, int batch,
                                            int image_size) {
    const int b = blockIdx.y;
    if (b >= batch) return;
    const long long src = (long long)indices[b] * image_size;
    // Multiply by the f32 nearest 1/255 would differ from x/255 in the last bit for some x; keep
    // the division so the CPU twin's `x as f32 / 255.0` matches exactly.
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < image_size; j += gridDim.x * blockDim.x) {
        images[(long long)b * image_size + j] = (float)dataset_images[src + j] / 255.0f;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) labels[b] = (int)dataset_labels[indices[b]];
}

// ----------------------------------------------------------------------------
// gradient buckets

extern "C" __global__ void bucket_flatten_f32(float* bucket, const BucketEntry* table, int num_entries) {
    const int e = blockIdx.y;
    if (e >= num_entries) return;
    const BucketEntry t = table[e];
    const float* src = reinterpret_cast<const float*>(t.ptr);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < t.len;
         i += (long long)gridDim.x * blockDim.x) {
        bucket[t.offset + i] = src[i];
    }
}

extern "C" __global__ void bucket_unflatten_f32(const BucketEntry* table, const float* bucket, int num_entries,
                                                float scale) {
    const int e = blockIdx.y;
    if (e >= num_entries) return;
    const BucketEntry t = table[e];
    float* dst = reinterpret_cast<float*>(t.ptr);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < t.len;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = bucket[t.offset + i] * scale;
    }
}

// ----------------------------------------------------------------------------
// casts

extern "C" __global__ void cast_f32_bf16(bf16_t* out, const float* inp, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = f32_to_bf16(inp[i]);
}

extern "C" __global__ void cast_bf16_f32(float* out, const bf16_t* inp, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = bf16_to_f32(inp[i]);
}

extern "C" __global__ void cast_f32_f16(f16_t* out, const float* inp, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = f32_to_f16(inp[i]);
}

extern "C" __global__ void cast_f16_f32(float* out, const f16_t* inp, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = f16_to_f32(inp[i]);
}
