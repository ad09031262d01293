//! `run.cuda-graph`: the training step captured once in a CUDA graph and
//! replayed, so a GPU step costs one launch instead of one per kernel
//! (PyTorch's "whole-network capture" with `torch.cuda.graph`; Accelerate
//! has nothing like it).
//!
//! As PyTorch's recipe asks: a few eager warm-up steps on a side stream
//! (optimizer state, cuBLAS workspaces and autocast's kernels all exist
//! before the capture), gradients dropped before the capture so that the
//! graph owns them, inputs copied into the same device buffers before each
//! replay, and learning rates read from device tensors that the scheduler
//! fills between replays ([`crate::optim::Optimizer::use_device_lrs`]).
//! Forward, loss, backward, clipping and the optimizer step are captured;
//! the scheduler, logging, evaluation and checkpoints stay outside.

use crate::accelerator::Accelerator;
use crate::data::Batch;
use crate::precision::MixedPrecision;
use hearth_ops::cuda_graph::{self, CaptureError, CudaGraph};
use serde::Serialize;
use tch::Tensor;

/// Eager steps before the capture (PyTorch's examples use 3).
pub const WARMUP_STEPS: u64 = 3;

/// What the CUDA graph did in a run (in `summary.json`).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct GraphStats {
    /// Eager warm-up steps run before the capture.
    pub warmup_steps: u64,
    /// The step whose work was captured (then replayed as that step), if any.
    pub captured_at_step: Option<u64>,
    /// Replays of the graph, the captured step's own included.
    pub replays: u64,
}

/// Why `run.cuda-graph` cannot be used with this run's settings, in
/// words that say what to change; `None` when it can (the optimizer's own
/// refusal comes from [`crate::optim::Optimizer::use_device_lrs`], the
/// device's from [`device_refusal`]).
pub fn refusal(acc: &Accelerator) -> Option<String> {
    if acc.gradient_accumulation_steps() > 1 {
        return Some("needs gradient-accumulation-steps = 1 (each micro-batch would need a graph of its own; raise data.batch-size instead)".into());
    }
    if acc.mixed_precision() == MixedPrecision::Fp16 {
        return Some("cannot capture fp16's loss scaling, which reads its overflow flag on the host every step; use mixed-precision = \"bf16\"".into());
    }
    if acc.num_processes() > 1 {
        return Some(format!(
            "captures a world of one process only, and this run has {}: DDP's gradient buckets are filled from host-side hooks",
            acc.num_processes()
        ));
    }
    if acc.fsdp_settings().is_some() {
        return Some("cannot capture [fsdp]: sharded units gather and free their parameters from host-side hooks; remove [fsdp]".into());
    }
    None
}

/// Why this run's device cannot capture a CUDA graph; `None` when it can.
pub fn device_refusal(acc: &Accelerator) -> Option<String> {
    if !acc.device().is_cuda() {
        return Some(format!(
            "needs a CUDA GPU, and this run trains on {}; set run.device = \"cuda\"",
            hearth_ops::spelling::device_name(acc.device())
        ));
    }
    cuda_graph::available().err().map(|e| e.to_string())
}

/// The step's progress from warm-up to replay.
pub struct GraphedStep {
    stats: GraphStats,
    captured: Option<Captured>,
}

/// The captured graph and the device buffers it reads and writes.
struct Captured {
    graph: CudaGraph,
    inputs: Tensor,
    targets: Tensor,
    loss: Tensor,
    grad_norm: Option<Tensor>,
}

/// What one graphed step returns: its loss and, when clipping, the
/// gradient norm (device tensors, valid until the next replay).
pub struct StepOutput {
    /// The step's loss.
    pub loss: Tensor,
    /// The gradient norm before clipping, when the step clips.
    pub grad_norm: Option<Tensor>,
}

impl GraphedStep {
    /// A step that starts with [`WARMUP_STEPS`] eager steps.
    pub fn new() -> Self {
        Self {
            stats: GraphStats::default(),
            captured: None,
        }
    }

    /// What the graph has done so far.
    pub fn stats(&self) -> GraphStats {
        self.stats
    }

    /// Runs optimizer step `step` on `batch` (host tensors): eagerly on a
    /// side stream while warming up, then captured, then replayed.
    /// `update` is the step's device work — forward, loss, backward,
    /// clipping, optimizer step — taking the inputs and targets on the
    /// device; the caller drops the gradients after a warm-up step and
    /// steps the scheduler after every step.
    pub fn run<E: From<cuda_graph::GraphError>>(
        &mut self,
        step: u64,
        batch: &Batch,
        device: tch::Device,
        mut update: impl FnMut(&Tensor, &Tensor) -> Result<StepOutput, E>,
    ) -> Result<StepOutput, E> {
        if let Some(c) = &self.captured {
            check_shape("inputs", &c.inputs, &batch.inputs)?;
            check_shape("targets", &c.targets, &batch.targets)?;
            c.inputs.shallow_clone().copy_(&batch.inputs);
            c.targets.shallow_clone().copy_(&batch.targets);
            c.graph.replay()?;
            self.stats.replays += 1;
            return Ok(c.output());
        }
        let (inputs, targets) = (
            batch.inputs.to_device(device),
            batch.targets.to_device(device),
        );
        if self.stats.warmup_steps < WARMUP_STEPS {
            self.stats.warmup_steps += 1;
            return cuda_graph::on_side_stream(|| update(&inputs, &targets))?;
        }
        let (graph, out) =
            CudaGraph::capture(|| update(&inputs, &targets)).map_err(|e| match e {
                CaptureError::Graph(g) => E::from(g),
                CaptureError::Step(s) => s,
            })?;
        let captured = Captured {
            graph,
            inputs,
            targets,
            loss: out.loss,
            grad_norm: out.grad_norm,
        };
        // The capture ran nothing: this step's work is the first replay.
        captured.graph.replay()?;
        self.stats.captured_at_step = Some(step);
        self.stats.replays += 1;
        let out = captured.output();
        self.captured = Some(captured);
        Ok(out)
    }

    /// Whether the graph has been captured (gradients then belong to it
    /// and must not be dropped).
    pub fn is_captured(&self) -> bool {
        self.captured.is_some()
    }
}

impl Captured {
    fn output(&self) -> StepOutput {
        StepOutput {
            loss: self.loss.shallow_clone(),
            grad_norm: self.grad_norm.as_ref().map(Tensor::shallow_clone),
        }
    }
}

fn check_shape(what: &str, fixed: &Tensor, new: &Tensor) -> Result<(), cuda_graph::GraphError> {
    if fixed.size() == new.size() {
        return Ok(());
    }
    Err(cuda_graph::GraphError::Torch(format!(
        "the batch's {what} changed shape from {:?} to {:?}; a captured step needs the same shapes every step (run.cuda-graph)",
        fixed.size(),
        new.size()
    )))
}
