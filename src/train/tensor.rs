//! The engine's tensor: a shape plus contiguous row-major (NCHW) `f32` storage, with no graph.
//!
//! Storage is a plain `Vec<f32>` today. Shape and storage are kept apart so a bf16 or device
//! variant can reuse [`Shape`] and the layer shape math unchanged. [`Tensor::resize`] keeps the
//! allocation, which is how the training loop avoids allocating per step: every activation is
//! sized once for the largest batch and then only re-labelled (a smaller last batch shrinks the
//! view, not the capacity).

/// Dimensions of a tensor, outermost first (`[N, C, H, W]` for images).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
}

/// An owned, contiguous `f32` tensor.
#[derive(Clone, Debug, Default)]
pub struct Tensor {
    dims: Vec<usize>,
    data: Vec<f32>,
}

impl Tensor {
    /// A zero-filled tensor of the given dimensions.
    pub fn zeros(dims: &[usize]) -> Tensor {
        Tensor { dims: dims.to_vec(), data: vec![0.0; dims.iter().product()] }
    }

    /// A tensor from data; `None` if the length does not match the dimensions.
    pub fn from_vec(dims: &[usize], data: Vec<f32>) -> Option<Tensor> {
        (dims.iter().product::<usize>() == data.len()).then(|| Tensor { dims: dims.to_vec(), data })
    }

    /// Dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The elements.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The elements, writable.
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// Change the shape, keeping the allocation when it is large enough (new elements are zero,
    /// kept ones are left as they were: callers overwrite them).
    pub fn resize(&mut self, dims: &[usize]) {
        if self.dims != dims {
            self.dims.clear();
            self.dims.extend_from_slice(dims);
        }
        let n = dims.iter().product();
        self.data.resize(n, 0.0);
    }

    /// Bytes of storage reserved (for memory accounting).
    pub fn capacity_bytes(&self) -> usize {
        self.data.capacity() * 4
    }
}
