//! The reference training loop the device-engine tests compare with: the CPU engine's step
//! (forward, loss, backward, optional norm clipping, Adam), one batch at a time.

use lockstep_train::data::Dataset;
use lockstep_train::model::Model;
use lockstep_train::ops::optim::Adam;
use lockstep_train::trainer::{clip_grad_norm, load_batch};

/// Learning rate of the reference loop (Adam).
pub const LR: f32 = 0.005;

/// `steps` CPU-engine steps from `model`'s parameters on batches `idx[s*b..(s+1)*b]` of `data`,
/// clipping the gradient norm to `clip` when given: the loss of each step, the norm before
/// clipping at each step (empty without `clip`) and the final model.
pub fn cpu_engine_run(
    model: &Model,
    data: &Dataset,
    idx: &[usize],
    b: usize,
    steps: usize,
    clip: Option<f32>,
) -> (Vec<f32>, Vec<f64>, Model) {
    let mut m = Model::fashion_cnn(b).unwrap();
    m.params.copy_from_slice(&model.params);
    let mut opt = Adam::new(m.num_params(), LR);
    let mut grads = vec![0.0f32; m.num_params()];
    let (mut losses, mut norms, mut labels) = (Vec::new(), Vec::new(), Vec::new());
    for s in 0..steps {
        load_batch(&mut m, data, &idx[s * b..(s + 1) * b], &mut labels);
        m.forward(true);
        losses.push(m.loss(&labels).unwrap());
        grads.fill(0.0);
        m.backward(&labels, &mut grads);
        if let Some(c) = clip {
            norms.push(clip_grad_norm(&mut grads, c));
        }
        opt.step(&mut m.params, &grads);
    }
    (losses, norms, m)
}
