//! One micro-batch's work on the device (what `run.cuda-graph` captures)
//! and, at a log step, which process's steps were the slowest.

use super::config::TrainConfig;
use super::error::TrainError;
use super::graphed::StepOutput;
use super::loss::batch_loss;
use crate::accelerator::{AcceleratedOptimizer, Accelerator, PreparedModel};
use crate::models::{Model, ModelOutput};
use tch::Tensor;

/// A micro-batch's device work: forward, loss and backward, then at the
/// end of an accumulation group clipping and the optimizer step (what a
/// CUDA graph captures). The norm stays on the device until a log step
/// reads it.
pub(super) fn update(
    acc: &Accelerator,
    config: &TrainConfig,
    model: &PreparedModel<Box<dyn Model>>,
    opt: &mut AcceleratedOptimizer,
    inputs: &Tensor,
    targets: &Tensor,
) -> Result<StepOutput, TrainError> {
    let loss = {
        let _span = crate::profiling::span("hearth::forward");
        // Logits stay in autocast's precision: `lm_loss` upcasts them in
        // its own kernel. A model's own loss is converted as Accelerate does.
        let output = config.model.output();
        batch_loss(
            |x| match output {
                ModelOutput::Logits => model.try_forward_t_unconverted(x, true),
                ModelOutput::Loss => model.try_forward_t(x, true),
            },
            output,
            inputs,
            targets,
        )?
        .0
    };
    acc.backward(&loss)?;
    let mut grad_norm = None;
    if let Some(max_norm) = config.optimizer.max_grad_norm {
        // Clips (and unscales) only at the accumulation group's end.
        grad_norm = acc.clip_grad_norm_(opt, max_norm, 2.0)?;
    }
    opt.step()?;
    Ok(StepOutput { loss, grad_norm })
}

/// With several processes, the one whose steps took longest over the last
/// logging window, and its seconds per step (every process logs at the
/// same steps, so they all join this gather).
pub(super) fn slowest_rank(
    acc: &Accelerator,
    seconds_per_step: f64,
) -> Result<Option<(usize, f64)>, TrainError> {
    if acc.num_processes() == 1 {
        return Ok(None);
    }
    let mine = Tensor::from_slice(&[seconds_per_step]).to_device(acc.device());
    let all: Vec<f64> = Vec::try_from(&acc.gather(&mine)?.to_device(tch::Device::Cpu))?;
    Ok(all
        .into_iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1)))
}
