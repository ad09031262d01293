//! Mixed precision: the mode (`no`, `bf16`, `fp16`) and the dynamic loss
//! scaler fp16 needs (PyTorch's `GradScaler`, with Accelerate's
//! `GradScalerKwargs` defaults).

use hearth_ops::{amp_unscale_, amp_update_scale_};
use tch::{Device, Kind, TchError, Tensor};

/// Which precision the forward pass runs in (Accelerate's
/// `PrecisionType`, with its spellings; `"fp8"` is refused, see
/// [`Fp8RecipeKwargs`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum MixedPrecision {
    /// Float32 throughout.
    #[default]
    No,
    /// Autocast to bfloat16 (CPU and CUDA; other devices run float32); no
    /// loss scaling.
    Bf16,
    /// Autocast to float16 with a dynamic loss scaler (CUDA). On the CPU,
    /// as in Accelerate, there is no fp16 autocast and no scaler: training
    /// runs in float32.
    Fp16,
}

impl MixedPrecision {
    /// The kind autocast casts to on `device`, if any.
    pub fn autocast_kind(self, device: Device) -> Option<Kind> {
        match (self, device) {
            (Self::Bf16, Device::Cpu | Device::Cuda(_)) => Some(Kind::BFloat16),
            (Self::Fp16, Device::Cuda(_)) => Some(Kind::Half),
            _ => None,
        }
    }
    /// True when gradients go through a loss scaler on `device`.
    pub fn scales_loss(self, device: Device) -> bool {
        self == Self::Fp16 && matches!(device, Device::Cuda(_))
    }
}

/// The spellings `MixedPrecision::from_str` takes, in any case (`fp32`
/// is `no`; `fp8` is refused).
impl schemars::JsonSchema for MixedPrecision {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "MixedPrecision".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "no, bf16 or fp16, in any case (fp32 is no)",
            "type": "string",
            "pattern": "^([Nn][Oo]|[Ff][Pp]32|[Bb][Ff]16|[Ff][Pp]16)$",
        })
    }
}

hearth_ops::spelled_enum! {
    MixedPrecision: "mixed precision" {
        No = "no" ("fp32"),
        Bf16 = "bf16",
        Fp16 = "fp16",
    }
    refused |_s| {
        "fp8" => fp8_refusal(None),
    }
}

/// Why FP8 training is refused, on `device` when known. What it would take:
/// a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada
/// Lovelace, Hopper, Blackwell) and an FP8 backend that swaps linear layers
/// for FP8 ones with per-tensor scaling (Transformer Engine, MS-AMP or
/// torchao's float8, which is what Accelerate's recipes configure); hearth
/// has neither the backend nor a machine with such a GPU to test one on.
pub fn fp8_refusal(device: Option<Device>) -> String {
    let here = match device {
        Some(Device::Cuda(i)) => format!(
            "this process trains on cuda:{i}, but hearth has no FP8 backend yet (Transformer Engine's, MS-AMP's or torchao's FP8 linear layers)"
        ),
        Some(_) => "this process trains on the CPU, which has none".to_string(),
        None => "hearth has no FP8 backend yet".to_string(),
    };
    format!(
        "mixed precision \"fp8\" needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell) and an FP8 backend; {here}. Use \"bf16\" instead"
    )
}

/// The FP8 recipe (Accelerate's `FP8RecipeKwargs`, for the Transformer
/// Engine, MS-AMP and torchao backends), accepted by
/// [`AcceleratorBuilder::fp8_recipe`](crate::accelerator::AcceleratorBuilder::fp8_recipe)
/// so that a ported script compiles, and refused when the accelerator is
/// built (see [`fp8_refusal`]). `Default` is Accelerate's recipe.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8RecipeKwargs {
    /// `"te"`, `"msamp"` or `"ao"`.
    pub backend: String,
    /// `"HYBRID"` (E4M3 forward, E5M2 backward), `"E4M3"` or `"E5M2"`.
    pub fp8_format: String,
    /// Margin of the scaling factor (Transformer Engine).
    pub margin: i32,
    /// Steps between scaling-factor updates (Transformer Engine).
    pub interval: i32,
    /// Length of the amax history window (Transformer Engine).
    pub amax_history_len: usize,
    /// `"most_recent"` or `"max"` (Transformer Engine).
    pub amax_compute_algo: String,
    /// Keep the forward, data-gradient and weight-gradient GEMMs in higher
    /// precision (Transformer Engine).
    pub override_linear_precision: (bool, bool, bool),
    /// FP8 also during evaluation (Transformer Engine).
    pub use_autocast_during_eval: bool,
    /// `"O1"` or `"O2"` (MS-AMP).
    pub opt_level: String,
    /// MXFP8 block scaling (Transformer Engine on Blackwell).
    pub use_mxfp8_block_scaling: bool,
}

impl Default for Fp8RecipeKwargs {
    fn default() -> Self {
        Self {
            backend: "te".into(),
            fp8_format: "HYBRID".into(),
            margin: 0,
            interval: 1,
            amax_history_len: 1024,
            amax_compute_algo: "most_recent".into(),
            override_linear_precision: (false, false, false),
            use_autocast_during_eval: false,
            opt_level: "O2".into(),
            use_mxfp8_block_scaling: false,
        }
    }
}

/// Settings of the loss scaler (Accelerate's `GradScalerKwargs`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// Starting scale (65536).
    pub init_scale: f64,
    /// Factor the scale grows by after `growth_interval` clean steps (2).
    pub growth_factor: f64,
    /// Factor the scale shrinks by after a step with inf/NaN gradients (0.5).
    pub backoff_factor: f64,
    /// Clean steps between growths (2000).
    pub growth_interval: i64,
    /// Whether fp16 scales the loss at all (true). Off, fp16 trains
    /// without a scaler: nothing is scaled, unscaled or skipped, and
    /// `loss_scale()` is `None` (torch's `GradScaler(enabled=False)`).
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        Self {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// A dynamic loss scaler: the loss is multiplied by the scale before
/// backward, gradients are divided by it before the step, and a step whose
/// gradients hold inf/NaN is skipped and the scale backed off. The scale
/// lives on the device (no host sync until a step asks whether to skip).
pub struct GradScaler {
    config: GradScalerConfig,
    scale: Option<Tensor>,
    growth_tracker: Option<Tensor>,
}

impl GradScaler {
    /// A scaler with `config`; its tensors are made on the device of the
    /// first loss it scales.
    pub fn new(config: GradScalerConfig) -> Self {
        Self {
            config,
            scale: None,
            growth_tracker: None,
        }
    }

    fn scale_on(&mut self, device: Device) -> &Tensor {
        let init = self.config.init_scale;
        self.growth_tracker
            .get_or_insert_with(|| Tensor::zeros([1], (Kind::Int, device)));
        self.scale
            .get_or_insert_with(|| Tensor::full([1], init, (Kind::Float, device)))
    }

    /// `loss × scale`, in float32 (the scale is a 1-element float32 tensor,
    /// as in PyTorch, so an fp16 loss does not overflow at 65536).
    pub fn scale(&mut self, loss: &Tensor) -> Tensor {
        let scale = self.scale_on(loss.device());
        loss * scale
    }

    /// Divides `grads` by the scale in place and returns a 1-element tensor
    /// that is non-zero when any of them holds an inf or NaN.
    pub fn unscale_(&mut self, grads: &[Tensor]) -> Result<Tensor, TchError> {
        let grads: Vec<Tensor> = grads
            .iter()
            .filter(|g| g.defined())
            .map(Tensor::shallow_clone)
            .collect();
        // Where the gradients are: on the GPU, or in host memory under
        // cpu-offload while the scale stays on the GPU with the loss.
        let device = match (&self.scale, grads.first()) {
            (_, Some(g)) => g.device(),
            (Some(scale), None) => scale.device(),
            (None, None) => Device::Cpu,
        };
        let scale = self.scale_on(device).to_device(device);
        let inv = scale
            .to_kind(Kind::Double)
            .reciprocal()
            .to_kind(Kind::Float);
        let found_inf = Tensor::zeros([1], (Kind::Float, device));
        amp_unscale_(&grads, &found_inf, &inv)?;
        Ok(found_inf)
    }

    /// Updates the scale after a step given what `unscale_` found.
    pub fn update(&mut self, found_inf: &Tensor) -> Result<(), TchError> {
        let device = self
            .scale
            .as_ref()
            .map_or(found_inf.device(), Tensor::device);
        let found_inf = found_inf.to_device(device);
        self.scale_on(device);
        let (Some(scale), Some(tracker)) = (&self.scale, &self.growth_tracker) else {
            unreachable!("scale_on made both");
        };
        let c = self.config;
        amp_update_scale_(
            scale,
            tracker,
            &found_inf,
            c.growth_factor,
            c.backoff_factor,
            c.growth_interval,
        )
    }

    /// The current scale (a host sync).
    pub fn get_scale(&self) -> f64 {
        self.scale.as_ref().map_or(self.config.init_scale, |s| {
            f64::try_from(s).unwrap_or(f64::NAN)
        })
    }

    /// The settings.
    pub fn config(&self) -> GradScalerConfig {
        self.config
    }

    /// Scale and growth tracker, for checkpoints (`None` before first use).
    pub fn state(&self) -> Option<(f64, i64)> {
        let tracker = self.growth_tracker.as_ref()?;
        Some((self.get_scale(), i64::try_from(tracker).unwrap_or(0)))
    }

    /// Restores what [`state`](Self::state) returned.
    pub fn load_state(&mut self, scale: f64, growth_tracker: i64, device: Device) {
        self.scale = Some(Tensor::full([1], scale, (Kind::Float, device)));
        self.growth_tracker = Some(Tensor::full([1], growth_tracker, (Kind::Int, device)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grads_of(value: f32) -> Tensor {
        Tensor::from_slice(&[value, 1.0])
    }

    #[test]
    fn grows_after_the_interval_and_backs_off_on_overflow() {
        let mut s = GradScaler::new(GradScalerConfig {
            growth_interval: 2,
            ..GradScalerConfig::default()
        });
        for _ in 0..2 {
            let found = s.unscale_(&[grads_of(1.0)]).unwrap();
            s.update(&found).unwrap();
        }
        assert_eq!(s.get_scale(), 131072.0);
        let found = s.unscale_(&[grads_of(f32::INFINITY)]).unwrap();
        assert_eq!(f64::try_from(&found.sum(Kind::Float)).unwrap(), 1.0);
        s.update(&found).unwrap();
        assert_eq!(s.get_scale(), 65536.0);
        assert_eq!(s.state(), Some((65536.0, 0)));
    }

    #[test]
    fn parses_the_modes() {
        assert_eq!("BF16".parse::<MixedPrecision>(), Ok(MixedPrecision::Bf16));
        assert!("fp8".parse::<MixedPrecision>().unwrap_err().contains("fp8"));
        assert_eq!(MixedPrecision::Fp16.autocast_kind(Device::Cpu), None);
    }
}
