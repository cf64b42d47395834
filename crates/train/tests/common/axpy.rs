//! The `axpy_f32` check both CUDA layer tests start their kernel checks with (on the real driver
//! and on the simulated one): `y += 2x` over 1000 elements from fixed inputs, the kernel's result
//! then compared with its CPU twin's.
#![allow(dead_code)]

use lockstep::cuda::{CudaError, DeviceBuffer, Function, KernelGrid, Stream};
use lockstep_train::device::kernels::twins;

/// The buffers of the check once the kernel has run: `x` and `y` on the device, and `want`, what
/// the twin computed for `y` on the host.
pub struct Axpy {
    /// The input, on the device.
    pub x: DeviceBuffer<f32>,
    /// The output the kernel wrote.
    pub y: DeviceBuffer<f32>,
    /// The twin's output from the same inputs.
    pub want: Vec<f32>,
}

/// Elements the check covers.
pub const N: usize = 1000;

/// Run `axpy` (the `axpy_f32` entry point) on `s` with alpha 2, and its twin on the host.
pub fn axpy_2x(axpy: &Function, s: &Stream) -> Result<Axpy, CudaError> {
    let x: Vec<f32> = (0..N).map(|i| (i % 17) as f32).collect();
    let mut want: Vec<f32> = (0..N).map(|i| (i % 5) as f32).collect();
    let mut y = DeviceBuffer::from_host(s, &want)?;
    let dx = DeviceBuffer::from_host(s, &x)?;
    axpy.launch(KernelGrid::for_elements(N))
        .arg_mut(&mut y)
        .arg(&dx)
        .scalar(2.0f32)
        .scalar(N as i64)
        .elements(N)
        .run(s)?;
    twins::axpy_f32(&mut want, &x, 2.0, N as i64);
    Ok(Axpy { x: dx, y, want })
}
