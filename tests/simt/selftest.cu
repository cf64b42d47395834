// selftest.cu: kernels that exercise the SIMT shim itself (tests/sim_gpu.rs, scenario
// shim_semantics). Compiled into the simulated driver next to kernels/*.cu; never by NVRTC.
// Each documents the CUDA behaviour the test checks it against.

// out[tid] = the value __shfl_*_sync returns to thread tid, where every lane offers
// 1000 * warp + lane. kind: 0 idx, 1 up, 2 down, 3 xor; `arg` is srcLane, delta or laneMask.
extern "C" __global__ void simt_shfl(int* out, int kind, int arg, int width) {
    const int tid = threadIdx.x;
    const int v = 1000 * (tid / 32) + tid % 32;
    int r = -1;
    if (kind == 0) r = __shfl_sync(0xffffffffu, v, arg, width);
    if (kind == 1) r = __shfl_up_sync(0xffffffffu, v, (unsigned int)arg, width);
    if (kind == 2) r = __shfl_down_sync(0xffffffffu, v, (unsigned int)arg, width);
    if (kind == 3) r = __shfl_xor_sync(0xffffffffu, v, arg, width);
    out[tid] = r;
}

// out[warp] = __ballot_sync over the lanes whose bit is set in `pattern`.
extern "C" __global__ void simt_ballot(int* out, int pattern) {
    const unsigned int b = __ballot_sync(0xffffffffu, (pattern >> (threadIdx.x % 32)) & 1);
    if (threadIdx.x % 32 == 0) out[threadIdx.x / 32] = (int)b;
}

// The halves of each warp run warp operations over disjoint masks at the same time: lanes
// 0-15 shuffle (xor 1) and vote among themselves, lanes 16-31 shuffle down by 2 within width 16
// and vote among themselves. out[tid] = the shuffle's result; ballots[2 * warp + half] = the
// vote of `lane % 3 == 0` (a ballot has only the bits of the lanes in its mask).
extern "C" __global__ void simt_shfl_halves(int* out, int* ballots) {
    const int tid = threadIdx.x, lane = tid % 32;
    const int v = 1000 * (tid / 32) + lane;
    if (lane < 16) {
        out[tid] = __shfl_xor_sync(0x0000ffffu, v, 1);
        const unsigned int b = __ballot_sync(0x0000ffffu, lane % 3 == 0);
        if (lane == 0) ballots[2 * (tid / 32)] = (int)b;
    } else {
        out[tid] = __shfl_down_sync(0xffff0000u, v, 2, 16);
        const unsigned int b = __ballot_sync(0xffff0000u, lane % 3 == 0);
        if (lane == 16) ballots[2 * (tid / 32) + 1] = (int)b;
    }
}

// Every thread of every block adds 1 to counter[0] (int) and 0.5 to sum[0] (float, exactly
// representable partial sums), and records the largest global thread id in maxid[0].
extern "C" __global__ void simt_atomics(int* counter, float* sum, int* maxid) {
    const int id = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(counter, 1);
    atomicAdd(sum, 0.5f);
    atomicMax(maxid, id);
}

// Threads >= `keep` return at once; the others pass two __syncthreads (returned threads do not
// count at a barrier) and write the block's shared sum of their ids: out[tid] for tid < keep.
extern "C" __global__ void simt_early_exit(int* out, int keep) {
    __shared__ int total;
    if ((int)threadIdx.x >= keep) return;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    atomicAdd(&total, (int)threadIdx.x);
    __syncthreads();
    out[threadIdx.x] = total;
}

// Shared memory is per block: each block fills its array with its own index after a barrier
// and checks it after another; out[block] = number of wrong elements seen (0 expected).
extern "C" __global__ void simt_shared_per_block(int* out) {
    __shared__ int tile[256];
    tile[threadIdx.x] = blockIdx.x;
    __syncthreads();
    int wrong = 0;
    for (int i = 0; i < (int)blockDim.x; ++i) wrong += tile[i] != (int)blockIdx.x;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = wrong;
}

// Misuse the shim must report as a failed launch: 0 a __syncthreads only half of a warp
// reaches while the other half waits in a shuffle (deadlock), 1 a shuffle over lanes that have
// returned, 2 __trap().
extern "C" __global__ void simt_misuse(int* out, int what) {
    if (what == 0) {
        if (threadIdx.x < 16) __syncthreads();
        else out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
    } else if (what == 1) {
        if (threadIdx.x >= 8) return;
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
    } else {
        __trap();
    }
}
