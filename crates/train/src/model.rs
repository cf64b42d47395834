//! A model as a sequence of named layers over one flat parameter vector, with the FashionMNIST
//! the FashionMNIST CNN (`Model::fashion_cnn`).
//!
//! Parameters live in one `Vec<f32>` in PyTorch `state_dict` order and gradients in one flat
//! buffer the caller owns (the trainer puts it in shared memory so the all-reduce is zero-copy);
//! each layer sees its own slice. Activations are kept per layer (`acts[i]` is layer `i`'s input,
//! `acts[i + 1]` its output) and reused across steps; backward ping-pongs two gradient tensors,
//! running the layers in exactly the reverse order of forward.
//!
//! A BatchNorm followed by a ReLU and a 2x2 max-pool runs as one fused pass each way
//! (`BatchNorm2d::forward_relu_pool`): those three layers are bound by memory, not arithmetic,
//! and fusing them skips writing and re-reading two activation-sized tensors (the BatchNorm and
//! ReLU outputs, whose `acts` entries are then left unwritten). Measured in
//! `benches/train_step.rs`; [`Model::set_fusion`] turns it off. When the layer before such a
//! group is a convolution that runs sample by sample (conv1), the two are streamed together
//! both ways: forward hands each sample's output to the BatchNorm while it is in cache
//! (statistics, and pooling before normalising, which the monotonic BatchNorm + ReLU allows),
//! and backward hands the convolution the group's input gradient one sample at a time, so
//! neither direction re-reads a whole-batch activation (6.4 MB for conv1 at batch 64).

use std::ops::Range;

use super::rng::Rng;
use super::tensor::Tensor;
use crate::ops::conv2d::DoutSource;
use crate::ops::{
    Backward, BatchNorm2d, BufferMut, Conv2d, Conv2dParams, Flatten, Layer, Linear, MaxPool2d,
    Relu, SoftmaxCrossEntropy, SumFn,
};

/// Errors building or feeding a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The layers do not chain for the declared input shape.
    #[error("layer {name} ({kind}) cannot take input {dims:?}: {why}; fix the model definition")]
    Shape {
        /// Layer name.
        name: String,
        /// Layer kind.
        kind: &'static str,
        /// Input dimensions it was given.
        dims: Vec<usize>,
        /// What the layer says is wrong.
        why: String,
    },
    /// A target label is out of range for the number of classes.
    #[error("label {label} is out of range for {classes} classes; is the label file from the same dataset?")]
    Label {
        /// The label.
        label: u8,
        /// Number of classes.
        classes: usize,
    },
}

/// Where one named parameter lives in the flat vector.
#[derive(Clone, Debug)]
pub struct ParamEntry {
    /// Full PyTorch name (`module1.0.weight`).
    pub name: String,
    /// Dimensions.
    pub dims: Vec<usize>,
    /// Element range in the flat parameter (and gradient) vector.
    pub range: Range<usize>,
}

/// One non-parameter state tensor, by full PyTorch name.
#[derive(Debug)]
pub enum StateMut<'a> {
    /// `f32` buffer.
    F32(String, &'a mut Vec<f32>),
    /// `i64` scalar.
    I64(String, &'a mut i64),
}

/// A sequence of named layers with flat parameters.
pub struct Model {
    layers: Vec<(String, Box<dyn Layer>)>,
    layer_ranges: Vec<Range<usize>>,
    /// Flat parameters in `state_dict` order.
    pub params: Vec<f32>,
    /// Name, shape and range of every parameter.
    pub entries: Vec<ParamEntry>,
    acts: Vec<Tensor>, // acts[0]: input (N, C, H, W); acts[i+1]: output of layer i
    dbuf: [Tensor; 2], // gradient ping-pong, sized to the largest activation
    loss: SoftmaxCrossEntropy,
    classes: usize,
    /// `fusable[i]`: layers `i..i + 3` are BatchNorm, ReLU and a 2x2 stride-2 max-pool over even
    /// sides, which forward and backward run as one pass (`BatchNorm2d::forward_relu_pool`).
    fusable: Vec<bool>,
    /// `ran_fused[i]`: the last forward took the fused path for the group at `i` (so it left
    /// `acts[i + 1]` and `acts[i + 2]` unwritten and backward must take it too).
    ran_fused: Vec<bool>,
    /// Whether forward fuses the groups of `fusable` (on by default; tests turn it off to compare).
    fuse: bool,
}

impl Model {
    /// Build a model from named layers, checking that they chain for `input` dimensions.
    pub fn new(
        layers: Vec<(String, Box<dyn Layer>)>,
        input: &[usize],
    ) -> Result<Model, ModelError> {
        let mut dims = input.to_vec();
        let mut entries = Vec::new();
        let mut layer_ranges = Vec::new();
        let mut off = 0;
        let mut acts = vec![Tensor::zeros(input)];
        for (name, l) in &layers {
            let start = off;
            for s in l.param_specs() {
                let n = s.numel();
                entries.push(ParamEntry {
                    name: format!("{name}.{}", s.name),
                    dims: s.dims.clone(),
                    range: off..off + n,
                });
                off += n;
            }
            layer_ranges.push(start..off);
            dims = l.out_dims(&dims).map_err(|why| ModelError::Shape {
                name: name.clone(),
                kind: l.kind(),
                dims: dims.clone(),
                why,
            })?;
            acts.push(Tensor::zeros(&dims));
        }
        let classes = *dims.last().unwrap_or(&0);
        let biggest = acts.iter().map(|a| a.numel()).max().unwrap_or(0);
        let dbuf = [Tensor::zeros(&[biggest]), Tensor::zeros(&[biggest])];
        let fusable: Vec<bool> = (0..layers.len())
            .map(|i| fusable_at(&layers, &acts, i))
            .collect();
        let ran_fused = vec![false; layers.len()];
        Ok(Model {
            layers,
            layer_ranges,
            params: vec![0.0; off],
            entries,
            acts,
            dbuf,
            loss: SoftmaxCrossEntropy::default(),
            classes,
            fusable,
            ran_fused,
            fuse: true,
        })
    }

    /// The FashionMNIST CNN with PyTorch module names, for `batch` images of 1x28x28.
    pub fn fashion_cnn(batch: usize) -> Result<Model, ModelError> {
        let conv = |in_c, out_c| Conv2d::new(Conv2dParams::new(in_c, out_c, 5, 1, 2));
        let l: Vec<(&str, Box<dyn Layer>)> = vec![
            ("module1.0", Box::new(conv(1, 32))),
            ("module1.1", Box::new(BatchNorm2d::new(32))),
            ("module1.2", Box::new(Relu)),
            ("module1.3", Box::new(MaxPool2d::new(2, 2))),
            ("module2.0", Box::new(conv(32, 64))),
            ("module2.1", Box::new(BatchNorm2d::new(64))),
            ("module2.2", Box::new(Relu)),
            ("module2.3", Box::new(MaxPool2d::new(2, 2))),
            ("flatten", Box::new(Flatten)),
            ("linear1", Box::new(Linear::new(7 * 7 * 64, 64))),
            ("relu", Box::new(Relu)),
            ("linear2", Box::new(Linear::new(64, 10))),
        ];
        Model::new(
            l.into_iter().map(|(n, b)| (n.to_string(), b)).collect(),
            &[batch, 1, 28, 28],
        )
    }

    /// Initialise parameters as PyTorch does by default, module by module in order, from `seed`.
    pub fn init(&mut self, seed: u64) {
        let mut rng = Rng::new(seed, 1);
        for (i, (_, l)) in self.layers.iter().enumerate() {
            let mut off = self.layer_ranges[i].start;
            for s in l.param_specs() {
                let n = s.numel();
                s.init.fill(&mut self.params[off..off + n], &mut rng);
                off += n;
            }
        }
    }

    /// Number of parameters.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }

    /// Number of output classes.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// The input tensor to fill before [`Model::forward`] (`[N, C, H, W]`; resize for a smaller
    /// batch).
    pub fn input_mut(&mut self) -> &mut Tensor {
        &mut self.acts[0]
    }

    /// The logits of the last forward pass, `[N, classes]`.
    pub fn logits(&self) -> &Tensor {
        self.acts.last().expect("a model has an input tensor")
    }

    /// Run every layer on the current input.
    pub fn forward(&mut self, train: bool) {
        let _ = self.forward_with::<std::convert::Infallible>(train, None);
    }

    /// Forward where, in training, BatchNorm layers marked `sync` sum their statistics over
    /// ranks through `sum` (an all-reduce supplied by the trainer).
    pub fn forward_with<E>(
        &mut self,
        train: bool,
        mut sum: Option<&mut SumFn<'_, E>>,
    ) -> Result<(), E> {
        self.ran_fused.iter_mut().for_each(|f| *f = false);
        let mut i = 0;
        while i < self.layers.len() {
            let synced = train && sum.is_some();
            if self.fuse
                && i + 1 < self.layers.len()
                && self.fusable[i + 1]
                && self.forward_from_conv(i, train, synced)
            {
                // A convolution fed the fused group after it sample by sample.
                self.ran_fused[i + 1] = true;
                i += 4;
                continue;
            }
            let (before, after) = self.acts.split_at_mut(i + 1);
            let p = &self.params[self.layer_ranges[i].clone()];
            if self.fuse && self.fusable[i] {
                let (head, tail) = self.layers.split_at_mut(i + 1);
                if let (Some(bn), Some(pool)) = (
                    as_batchnorm(head[i].1.as_mut()),
                    as_maxpool(tail[1].1.as_mut()),
                ) {
                    if !(synced && bn.sync) {
                        // BatchNorm + ReLU + pool in one pass, straight into the pool's output.
                        bn.forward_relu_pool(p, &before[i], &mut after[2], &mut pool.argmax, train);
                        self.ran_fused[i] = true;
                        i += 3;
                        continue;
                    }
                }
            }
            let l = &mut self.layers[i].1;
            match (train, sum.as_deref_mut(), as_batchnorm(l.as_mut())) {
                (true, Some(f), Some(bn)) if bn.sync => {
                    bn.forward_synced(p, &before[i], &mut after[0], f)?
                }
                _ => l.forward(p, &before[i], &mut after[0], train),
            }
            i += 1;
        }
        Ok(())
    }

    /// The convolution at `c` and the fused group at `c + 1` forward together, when the
    /// convolution runs sample by sample and the group's BatchNorm is not synchronised: each
    /// sample's output goes from the convolution to the BatchNorm while it is in cache
    /// (statistics and raw pooling, [`BatchNorm2d::stream_sample`]), and only the pooled values
    /// are normalised afterwards. The convolution's output is still stored whole, for backward.
    /// Returns false, having done nothing, when the layers are not of that shape.
    fn forward_from_conv(&mut self, c: usize, train: bool, synced: bool) -> bool {
        let g = c + 1;
        let (rc, rb) = (self.layer_ranges[c].clone(), self.layer_ranges[g].clone());
        let Some((conv, bn, pool)) = conv_group(&mut self.layers, c) else {
            return false;
        };
        if !conv.streams_samples() || (synced && bn.sync) {
            return false;
        }
        let (pconv, pbn) = (&self.params[rc], &self.params[rb]);
        let (before, after) = self.acts.split_at_mut(g);
        let (conv_out, rest) = after.split_at_mut(1);
        let (inp, conv_out, pooled) = (&before[c], &mut conv_out[0], &mut rest[2]);
        let n = inp.dims()[0];
        let dims = conv
            .params
            .out_dims(inp.dims())
            .expect("the model checked the shapes");
        let argmax = &mut pool.argmax;
        let mut sink =
            |b: usize, o: &[f32]| bn.stream_sample(pbn, n, b, o, (dims[2], dims[3]), argmax, train);
        conv.forward_samples(pconv, inp, conv_out, train, Some(&mut sink));
        bn.stream_finish(pbn, &dims, pooled, train);
        true
    }

    /// Run BatchNorm + ReLU + max-pool groups as one fused pass (the default) or as three layers
    /// (for comparing the two).
    pub fn set_fusion(&mut self, fuse: bool) {
        self.fuse = fuse;
    }

    /// Mark every BatchNorm layer as synchronised (`--sync-bn`) or local.
    pub fn set_sync_bn(&mut self, sync: bool) {
        for (_, l) in self.layers.iter_mut() {
            if let Some(bn) = as_batchnorm(l.as_mut()) {
                bn.sync = sync;
            }
        }
    }

    /// Mean cross-entropy of the last forward pass against `targets`.
    pub fn loss(&mut self, targets: &[u8]) -> Result<f32, ModelError> {
        if let Some(&label) = targets.iter().find(|&&t| t as usize >= self.classes) {
            return Err(ModelError::Label {
                label,
                classes: self.classes,
            });
        }
        let logits = self.acts.last().expect("a model has an input tensor");
        Ok(self.loss.forward(logits, targets))
    }

    /// Backward from the loss of the last [`Model::loss`] call, accumulating into `grads` (flat,
    /// same layout as `params`; callers zero it per step). Layers run in reverse order; the first
    /// layer computes no input gradient.
    pub fn backward(&mut self, targets: &[u8], grads: &mut [f32]) {
        let _ = self.backward_with::<std::convert::Infallible>(targets, grads, None);
    }

    /// Backward matching [`Model::forward_with`]: synchronised BatchNorm layers sum their
    /// input-gradient statistics over ranks through `sum`.
    pub fn backward_with<E>(
        &mut self,
        targets: &[u8],
        grads: &mut [f32],
        mut sum: Option<&mut SumFn<'_, E>>,
    ) -> Result<(), E> {
        let [mut dout, mut dinp] = std::mem::take(&mut self.dbuf);
        let last = self.acts.len() - 1;
        self.loss
            .backward(&mut dout, self.acts[last].dims(), targets);
        let mut result = Ok(());
        let mut next = self.layers.len();
        while next > 0 {
            let i = next - 1;
            if i >= 2 && self.ran_fused[i - 2] {
                // The fused group ending at this pool: BatchNorm's input gradient in one pass.
                // (`ran_fused` is only set where both downcasts succeeded.)
                let g = i - 2;
                if g > 0 && self.backward_into_conv(g, &dout, &mut dinp, grads) {
                    // The convolution before the group took its output gradient sample by sample.
                    std::mem::swap(&mut dout, &mut dinp);
                    next = g - 1;
                    continue;
                }
                let r = self.layer_ranges[g].clone();
                let want = if g > 0 { Some(&mut dinp) } else { None };
                let (p, dp) = (&self.params[r.clone()], &mut grads[r]);
                let (head, tail) = self.layers.split_at_mut(g + 1);
                if let (Some(bn), Some(pool)) = (
                    as_batchnorm(head[g].1.as_mut()),
                    as_maxpool(tail[1].1.as_mut()),
                ) {
                    bn.backward_relu_pool(
                        p,
                        dp,
                        &self.acts[g],
                        &self.acts[g + 3],
                        &dout,
                        &pool.argmax,
                        want,
                    );
                    std::mem::swap(&mut dout, &mut dinp);
                    next = g;
                    continue;
                }
            }
            next = i;
            let r = self.layer_ranges[i].clone();
            let want = if i > 0 { Some(&mut dinp) } else { None };
            let (p, dp) = (&self.params[r.clone()], &mut grads[r]);
            let l = &mut self.layers[i].1;
            match (sum.as_deref_mut(), as_batchnorm(l.as_mut())) {
                (Some(f), Some(bn)) if bn.sync => {
                    if let Err(e) = bn.backward_synced(p, dp, &self.acts[i], &dout, want, f) {
                        result = Err(e);
                        break;
                    }
                }
                _ => l.backward(Backward {
                    p,
                    dp,
                    inp: &self.acts[i],
                    out: &self.acts[i + 1],
                    dout: &dout,
                    dinp: want,
                }),
            }
            std::mem::swap(&mut dout, &mut dinp);
        }
        // The buffers go back even on error, so the model stays usable.
        self.dbuf = [dout, dinp];
        result
    }

    /// The fused group at `g` (BatchNorm, ReLU, pool) and the convolution at `g - 1` backward
    /// together, when that convolution runs sample by sample: the group's input gradient is
    /// made one sample at a time, straight into the convolution's per-sample buffer, instead
    /// of as a whole-batch tensor written out and read back (conv1's output gradient is 6.4 MB
    /// at batch 64, larger than L2). `dout` is the pool's output gradient; the convolution's
    /// input gradient, if any, goes to `dinp`. Returns false, having done nothing, when the
    /// layers are not of that shape.
    fn backward_into_conv(
        &mut self,
        g: usize,
        dout: &Tensor,
        dinp: &mut Tensor,
        grads: &mut [f32],
    ) -> bool {
        let c = g - 1;
        let (rc, rb) = (self.layer_ranges[c].clone(), self.layer_ranges[g].clone());
        let Some((conv, bn, pool)) = conv_group(&mut self.layers, c) else {
            return false;
        };
        if !conv.streams_samples() {
            return false;
        }
        let (lo, hi) = grads.split_at_mut(rb.start);
        let (gconv, gbn) = (&mut lo[rc.clone()], &mut hi[..rb.len()]);
        let (pconv, pbn) = (&self.params[rc], &self.params[rb]);
        let (x, pooled) = (&self.acts[g], &self.acts[g + 3]);
        bn.pooled_grad_sums(gbn, x, pooled, dout, &pool.argmax);
        let argmax = &pool.argmax;
        let mut fill = |b: usize, buf: &mut [f32]| {
            bn.pooled_input_grad_sample(pbn, x, pooled, dout, argmax, b, buf)
        };
        let want = if c > 0 { Some(dinp) } else { None };
        conv.backward_samples(
            pconv,
            gconv,
            &self.acts[c],
            DoutSource::Fill(&mut fill),
            want,
        );
        true
    }

    /// Predicted class of every sample of the last forward pass (written into `out`).
    pub fn argmax(&self, out: &mut Vec<u8>) {
        out.clear();
        let c = self.classes;
        for row in self.logits().data().chunks_exact(c) {
            let mut best = 0;
            for j in 1..c {
                if row[j] > row[best] {
                    best = j;
                }
            }
            out.push(best as u8);
        }
    }

    /// Non-parameter state (BatchNorm running statistics and counters) by full name.
    pub fn state_mut(&mut self) -> Vec<StateMut<'_>> {
        let mut v = Vec::new();
        for (name, l) in self.layers.iter_mut() {
            for b in l.buffers_mut() {
                match b {
                    BufferMut::F32(n, x) => v.push(StateMut::F32(format!("{name}.{n}"), x)),
                    BufferMut::I64(n, x) => v.push(StateMut::I64(format!("{name}.{n}"), x)),
                }
            }
        }
        v
    }

    /// The layers in order, with their names (read-only: the device engine derives its launch
    /// schedule from them).
    pub fn layers(&self) -> impl Iterator<Item = (&str, &dyn Layer)> + '_ {
        self.layers.iter().map(|(n, l)| (n.as_str(), l.as_ref()))
    }

    /// Dimensions of one input sample (`[C, H, W]` for images): the input tensor's dimensions
    /// after the batch.
    pub fn sample_dims(&self) -> &[usize] {
        self.acts[0].dims().get(1..).unwrap_or(&[])
    }

    /// Names of all layers in order, with their kinds.
    pub fn layer_names(&self) -> Vec<(String, &'static str)> {
        self.layers
            .iter()
            .map(|(n, l)| (n.clone(), l.kind()))
            .collect()
    }

    /// Bytes held by activation and scratch tensors (for memory reporting).
    pub fn activation_bytes(&self) -> usize {
        self.acts
            .iter()
            .chain(self.dbuf.iter())
            .map(|t| t.capacity_bytes())
            .sum()
    }
}

/// `layer` as a BatchNorm, for the synchronised-BatchNorm path and the fused groups.
fn as_batchnorm(layer: &mut dyn Layer) -> Option<&mut BatchNorm2d> {
    let any: &mut dyn std::any::Any = layer;
    any.downcast_mut::<BatchNorm2d>()
}

/// `layer` as a convolution, for the fused groups' streamed backward.
fn as_conv(layer: &mut dyn Layer) -> Option<&mut Conv2d> {
    let any: &mut dyn std::any::Any = layer;
    any.downcast_mut::<Conv2d>()
}

/// `layer` as a max-pool, for the fused groups.
fn as_maxpool(layer: &mut dyn Layer) -> Option<&mut MaxPool2d> {
    let any: &mut dyn std::any::Any = layer;
    any.downcast_mut::<MaxPool2d>()
}

/// The convolution at `c` and the BatchNorm and max-pool of the fused group after it (`c + 1`
/// BatchNorm, `c + 2` ReLU, `c + 3` max-pool), or `None` when the layers there are not of that
/// shape.
fn conv_group(
    layers: &mut [(String, Box<dyn Layer>)],
    c: usize,
) -> Option<(&mut Conv2d, &mut BatchNorm2d, &mut MaxPool2d)> {
    let (head, group) = layers.split_at_mut(c + 1);
    let [bn, _relu, pool, ..] = group else {
        return None;
    };
    Some((
        as_conv(head[c].1.as_mut())?,
        as_batchnorm(bn.1.as_mut())?,
        as_maxpool(pool.1.as_mut())?,
    ))
}

/// Whether layers `i..i + 3` are BatchNorm, ReLU and a 2x2 stride-2 max-pool over an input with
/// even height and width (so every input value lies in exactly one window, which the fused
/// backward relies on).
fn fusable_at(layers: &[(String, Box<dyn Layer>)], acts: &[Tensor], i: usize) -> bool {
    if i + 3 > layers.len() {
        return false;
    }
    let any = |k: usize| -> &dyn std::any::Any { layers[i + k].1.as_ref() };
    let pool_ok = any(2)
        .downcast_ref::<MaxPool2d>()
        .is_some_and(|p| p.kernel == 2 && p.stride == 2);
    let even = matches!(acts[i].dims(), [_, _, h, w] if h % 2 == 0 && w % 2 == 0);
    any(0).is::<BatchNorm2d>() && any(1).is::<Relu>() && pool_ok && even
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fashion_cnn_names_and_sizes() {
        let m = Model::fashion_cnn(2).unwrap();
        let names: Vec<&str> = m.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "module1.0.weight",
                "module1.0.bias",
                "module1.1.weight",
                "module1.1.bias",
                "module2.0.weight",
                "module2.0.bias",
                "module2.1.weight",
                "module2.1.bias",
                "linear1.weight",
                "linear1.bias",
                "linear2.weight",
                "linear2.bias"
            ]
        );
        assert_eq!(
            m.num_params(),
            800 + 32 + 64 + 51200 + 64 + 128 + 3136 * 64 + 64 + 640 + 10
        );
    }

    /// Both models forward (`train` as [`Model::forward`]'s), their logits bit-identical.
    fn same_forward(a: &mut Model, b: &mut Model, train: bool, what: &str) {
        a.forward(train);
        b.forward(train);
        assert_eq!(a.logits().data(), b.logits().data(), "{what}");
    }

    /// The fused BatchNorm + ReLU + pool groups (the first streamed with conv1, the second not)
    /// against the three layers run one by one: the forward (training and evaluation) is
    /// bit-identical, the gradients equal up to rounding (the fused sums skip the zeros and add
    /// in lanes), over several steps so the running statistics move too.
    #[test]
    fn fused_groups_match_separate_layers() {
        let mut a = Model::fashion_cnn(6).unwrap();
        a.init(3);
        assert_eq!(
            a.fusable.iter().filter(|&&f| f).count(),
            2,
            "both blocks of the FashionMNIST CNN fuse"
        );
        // Some negative BatchNorm weights, so the streamed forward's pooling of the raw input
        // takes its minimum path (the normalisation is then decreasing) as well as the maximum.
        for name in ["module1.1.weight", "module2.1.weight"] {
            let r = a
                .entries
                .iter()
                .find(|e| e.name == name)
                .unwrap()
                .range
                .clone();
            for (k, g) in a.params[r].iter_mut().enumerate() {
                *g = if k % 3 == 1 {
                    -0.7
                } else {
                    0.4 + 0.1 * k as f32
                };
            }
        }
        let mut b = Model::fashion_cnn(6).unwrap();
        b.init(3);
        b.params.copy_from_slice(&a.params);
        b.set_fusion(false);
        let mut rng = Rng::new(4, 4);
        let labels: Vec<u8> = (0..6).map(|i| (i * 7 % 10) as u8).collect();
        for step in 0..3 {
            let x: Vec<f32> = (0..6 * 784).map(|_| rng.uniform(-1.0, 1.0)).collect();
            a.input_mut().data_mut().copy_from_slice(&x);
            b.input_mut().data_mut().copy_from_slice(&x);
            same_forward(
                &mut a,
                &mut b,
                true,
                &format!("step {step}: training forward"),
            );
            let (la, lb) = (a.loss(&labels).unwrap(), b.loss(&labels).unwrap());
            assert_eq!(la, lb);
            let (mut ga, mut gb) = (vec![0.0; a.num_params()], vec![0.0; b.num_params()]);
            a.backward(&labels, &mut ga);
            b.backward(&labels, &mut gb);
            let scale = gb.iter().fold(0.0f32, |m, g| m.max(g.abs()));
            assert!(scale > 0.0);
            for (e, (x, y)) in a
                .entries
                .iter()
                .flat_map(|e| std::iter::repeat_n(e, e.range.len()))
                .zip(ga.iter().zip(&gb))
            {
                assert!(
                    (x - y).abs() <= 1e-5 * scale,
                    "step {step}: {} gradient {x} vs {y}",
                    e.name
                );
            }
            // Same update on both, so they stay identical.
            for (p, g) in a.params.iter_mut().zip(&ga) {
                *p -= 0.01 * g;
            }
            b.params.copy_from_slice(&a.params);
            same_forward(
                &mut a,
                &mut b,
                false,
                &format!("step {step}: evaluation forward"),
            );
        }
    }

    #[test]
    fn init_bounds_follow_pytorch() {
        let mut m = Model::fashion_cnn(1).unwrap();
        m.init(42);
        let get = |n: &str| {
            m.entries
                .iter()
                .find(|e| e.name == n)
                .unwrap()
                .range
                .clone()
        };
        let w = &m.params[get("module2.0.weight")];
        let bound = 1.0 / 800f32.sqrt();
        assert!(w.iter().all(|x| x.abs() <= bound));
        assert!(w.iter().any(|x| x.abs() > 0.9 * bound));
        assert!(m.params[get("module1.1.weight")].iter().all(|&x| x == 1.0));
        assert!(m.params[get("module1.1.bias")].iter().all(|&x| x == 0.0));
    }
}
