//! The engine's tensor: a shape plus contiguous row-major (NCHW) `f32` storage, with no graph.
//!
//! Storage is a plain `Vec<f32>` today. Shape and storage are kept apart so a bf16 or device
//! variant can reuse [`Shape`] and the layer shape math unchanged. [`Tensor::resize`] keeps the
//! allocation, which is how the training loop avoids allocating per step: every activation is
//! sized once for the largest batch and then only re-labelled (a smaller last batch shrinks the
//! view, not the capacity). Nor does it clear anything it does not allocate: the model's two
//! gradient buffers change shape at every layer of backward, and zeroing the grown part each time
//! cost a 6.4 MB `memset` per step before the first layer alone (every caller overwrites).

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
    /// Storage at its largest length so far; the tensor is its first `len` elements.
    data: Vec<f32>,
    len: usize,
}

impl Tensor {
    /// A zero-filled tensor of the given dimensions.
    pub fn zeros(dims: &[usize]) -> Tensor {
        let n = dims.iter().product();
        Tensor {
            dims: dims.to_vec(),
            data: vec![0.0; n],
            len: n,
        }
    }

    /// A tensor from data; `None` if the length does not match the dimensions.
    pub fn from_vec(dims: &[usize], data: Vec<f32>) -> Option<Tensor> {
        (dims.iter().product::<usize>() == data.len()).then(|| Tensor {
            dims: dims.to_vec(),
            len: data.len(),
            data,
        })
    }

    /// Dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.len
    }

    /// The elements.
    pub fn data(&self) -> &[f32] {
        &self.data[..self.len]
    }

    /// The elements, writable.
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data[..self.len]
    }

    /// Change the shape, keeping the storage when it is large enough. The elements are whatever
    /// the storage held (values of an earlier shape, or zeros where it had to grow): callers
    /// overwrite every one.
    pub fn resize(&mut self, dims: &[usize]) {
        if self.dims != dims {
            self.dims.clear();
            self.dims.extend_from_slice(dims);
        }
        let n = dims.iter().product();
        if n > self.data.len() {
            self.data.resize(n, 0.0);
        }
        self.len = n;
    }

    /// Bytes of storage reserved (for memory accounting).
    pub fn capacity_bytes(&self) -> usize {
        self.data.capacity() * 4
    }
}
