//! A custom model and training loop on hearth's Accelerator, in plain Rust:
//! fit y = sin(3x) with a small MLP, two micro-batches per optimizer step,
//! a warmup + cosine schedule from the built-in `cosine` plugin, gradient
//! clipping, and whatever device and precision the environment names
//! (`HEARTH_USE_CPU`, `HEARTH_MIXED_PRECISION`, as Accelerate reads
//! `ACCELERATE_*`). Run it with `cargo run --release --example custom_loop`.

use anyhow::Result;
use hearth::accelerator::Accelerator;
use hearth::data::{DataLoader, Dataset};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::plugins::{load_scheduler, Registry, SearchPath};
use hearth::tch::nn::{self, Module};
use hearth::tch::{Device, Kind, Reduction, Tensor};

/// 512 points of y = sin(3x) on [-1, 1].
struct Sine(Tensor, Tensor);

impl Dataset for Sine {
    type Item = (Tensor, Tensor);
    fn len(&self) -> usize {
        self.0.size()[0] as usize
    }
    fn get(&self, i: usize) -> (Tensor, Tensor) {
        (self.0.get(i as i64), self.1.get(i as i64))
    }
}

fn main() -> Result<()> {
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(2)
        .build()?;
    acc.set_seed(0, false, false);
    let x = Tensor::linspace(-1.0, 1.0, 512, (Kind::Float, Device::Cpu)).unsqueeze(1);
    let loader = DataLoader::new(Sine(x.shallow_clone(), (&x * 3.0).sin()), 32).shuffle(0);

    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "0", 1, 64, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "2", 64, 1, Default::default()));
    let hyper = AdamHyper {
        weight_decay: 0.0,
        ..AdamHyper::adamw(2e-2)
    };
    let opt = Adam::new(vs.trainable_variables(), hyper);

    let (epochs, micro_batches) = (30, loader.len().unwrap_or(0));
    let steps = (epochs * micro_batches / acc.gradient_accumulation_steps()) as u64;
    let registry = Registry::discover(&SearchPath::standard(&[], None))?;
    let cosine = &registry.find("cosine")?.manifest;
    let schedule = load_scheduler(cosine, r#"{"warmup-steps": 20}"#, &[hyper.lr], Some(steps))?;

    let (_vs, mut opt, loader, mut sched) = acc.prepare((vs, opt, loader, schedule))?;
    for epoch in 1..=epochs {
        let mut total = 0.0;
        for (x, y) in loader.iter() {
            total += acc.accumulate(|| -> Result<f64> {
                let loss = net.forward(&x).mse_loss(&y, Reduction::Mean);
                acc.backward(&loss)?;
                acc.clip_grad_norm_(&mut opt, 1.0, 2.0)?; // L2, only at the sync step
                opt.step()?;
                sched.step()?;
                opt.zero_grad();
                Ok(f64::try_from(&loss)?)
            })?;
        }
        if epoch % 5 == 0 {
            let mean = total / micro_batches as f64;
            acc.print(format!(
                "epoch {epoch:2}: mse {mean:.5}, lr {:.2e}",
                opt.lr()
            ));
        }
    }
    Ok(())
}
