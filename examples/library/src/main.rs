//! A complete training program on the hearth library: its own model (a tch
//! MLP classifying points of four Gaussian blobs), gradient accumulation,
//! bf16 autocast, clipping, a warmup + cosine schedule and a tracker, both
//! by name from the built-ins embedded in hearth, evaluation with
//! `gather_for_metrics`, a checkpoint every epoch and `--resume` from the
//! newest, and the weights saved for PyTorch at the end.
//!
//! ```text
//! library-example PROJECT_DIR [--epochs N] [--stop-after K] [--resume]
//! hearth launch -n 2 -- library-example PROJECT_DIR   # on 2 processes
//! ```

use anyhow::{Context, Result};
use hearth::accelerator::{Accelerator, PreparedDataLoader, ProjectConfiguration};
use hearth::data::{DataLoader, Dataset, MapStyle};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::plugins::{load_scheduler, Registry, SearchPath};
use hearth::precision::MixedPrecision;
use hearth::tch::nn::{self, Module};
use hearth::tch::{Device, Kind, Tensor};
use std::path::PathBuf;

const CLASSES: i64 = 4;

/// `n` points around four centres, labelled by their centre.
struct Blobs {
    points: Tensor,
    labels: Tensor,
}

impl Blobs {
    fn new(n: i64, seed: i64) -> Self {
        hearth::tch::manual_seed(seed);
        let labels = Tensor::randint(CLASSES, [n], (Kind::Int64, Device::Cpu));
        let centres = Tensor::from_slice2(&[[2.0f32, 2.0], [-2.0, 2.0], [-2.0, -2.0], [2.0, -2.0]]);
        let noise = Tensor::randn([n, 2], (Kind::Float, Device::Cpu)) * 0.9;
        Self {
            points: centres.index_select(0, &labels) + noise,
            labels,
        }
    }
}

impl Dataset for Blobs {
    type Item = (Tensor, Tensor);
    fn len(&self) -> usize {
        self.labels.size()[0] as usize
    }
    fn get(&self, i: usize) -> (Tensor, Tensor) {
        (self.points.get(i as i64), self.labels.get(i as i64))
    }
}

/// What each epoch logs.
#[derive(serde::Serialize)]
struct Metrics {
    train_loss: f64,
    eval: Eval,
    lr: f64,
}

#[derive(serde::Serialize)]
struct Eval {
    accuracy: f64,
    samples: i64,
}

/// The run's settings, logged as its config.
#[derive(serde::Serialize)]
struct Config {
    epochs: usize,
    batch_size: usize,
    gradient_accumulation_steps: usize,
    lr: f64,
}

struct Args {
    project: PathBuf,
    epochs: usize,
    /// Stop after this many epochs, as if interrupted (`--resume` goes on).
    stop_after: Option<usize>,
    resume: bool,
}

fn args() -> Result<Args> {
    let mut args = std::env::args().skip(1);
    let mut parsed = Args {
        project: PathBuf::new(),
        epochs: 4,
        stop_after: None,
        resume: false,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--resume" => parsed.resume = true,
            "--epochs" => parsed.epochs = args.next().context("--epochs N")?.parse()?,
            "--stop-after" => {
                parsed.stop_after = Some(args.next().context("--stop-after K")?.parse()?)
            }
            _ => parsed.project = arg.into(),
        }
    }
    anyhow::ensure!(
        !parsed.project.as_os_str().is_empty(),
        "usage: library-example PROJECT_DIR [--epochs N] [--stop-after K] [--resume]"
    );
    Ok(parsed)
}

fn main() -> Result<()> {
    let args = args()?;
    let config = Config {
        epochs: args.epochs,
        batch_size: 32,
        gradient_accumulation_steps: 2,
        lr: 1e-2,
    };
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(config.gradient_accumulation_steps)
        .mixed_precision(MixedPrecision::Bf16)
        .project_config(ProjectConfiguration {
            project_dir: args.project.clone(),
            automatic_checkpoint_naming: true,
            ..Default::default()
        })
        .log_with(["jsonl"])
        .build()?;
    acc.set_seed(0, false, false);

    let train = DataLoader::new(Blobs::new(2048, 1), config.batch_size).shuffle(0);
    let eval = DataLoader::new(Blobs::new(500, 2), 64);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "0", 2, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "2", 64, CLASSES, Default::default()));
    let hyper = AdamHyper::adamw(config.lr);
    let opt = Adam::new(vs.trainable_variables(), hyper);

    // A schedule by name, from the built-ins hearth embeds.
    let steps_per_epoch =
        train.len().unwrap_or(0).div_ceil(acc.num_processes()) / config.gradient_accumulation_steps;
    let registry = Registry::discover(&SearchPath::standard(&[], None))?;
    let cosine = &registry.find("cosine")?.manifest;
    let total = (steps_per_epoch * config.epochs) as u64;
    let schedule = load_scheduler(cosine, r#"{"warmup-steps": 10}"#, &[hyper.lr], Some(total))?;

    let (vs, mut opt, train, eval, mut sched) = acc.prepare((vs, opt, train, eval, schedule))?;
    acc.init_trackers_named("library-example", &config)?;
    let first_epoch = if args.resume {
        let from = acc.load_state(None)?;
        acc.print(format!("resumed from {}", from.display()));
        acc.project_configuration().iteration as usize
    } else {
        0
    };

    for epoch in first_epoch..config.epochs {
        let (mut total_loss, mut batches) = (0.0, 0);
        for (x, y) in train.iter() {
            total_loss += acc.accumulate(|| -> Result<f64> {
                let logits = {
                    let _bf16 = acc.autocast();
                    net.forward(&x)
                };
                let loss = logits.to_kind(Kind::Float).cross_entropy_for_logits(&y);
                acc.backward(&loss)?;
                acc.clip_grad_norm_(&mut opt, 1.0, 2.0)?;
                opt.step()?;
                sched.step()?;
                opt.zero_grad();
                Ok(f64::try_from(&loss)?)
            })?;
            batches += 1;
        }
        let accuracy = evaluate(&acc, &net, &eval)?;
        let metrics = Metrics {
            train_loss: total_loss / batches as f64,
            eval: accuracy,
            lr: opt.lr(),
        };
        acc.print(format!(
            "epoch {}: loss {:.4}, eval accuracy {:.4} on {} points",
            epoch + 1,
            metrics.train_loss,
            metrics.eval.accuracy,
            metrics.eval.samples
        ));
        acc.log_serialized(&metrics, epoch as u64 + 1)?;
        acc.save_state(None)?;
        if args.stop_after == Some(epoch + 1) {
            acc.end_training()?;
            return Ok(());
        }
    }
    acc.save_model(&vs, &args.project.join("model"), u64::MAX)?;
    acc.end_training()?;
    Ok(())
}

/// Accuracy over the whole evaluation set: each process predicts its share,
/// `gather_for_metrics` brings every prediction together (without the
/// samples padded to even the shares out).
fn evaluate(
    acc: &Accelerator,
    net: &impl Module,
    eval: &PreparedDataLoader<MapStyle<Blobs>>,
) -> Result<Eval> {
    let _no_grad = hearth::tch::no_grad_guard();
    let (mut predictions, mut labels) = (Vec::new(), Vec::new());
    for (x, y) in eval.iter() {
        let predicted = net.forward(&x).argmax(-1, false);
        let (predicted, y) = acc.gather_for_metrics(&(predicted, y))?;
        predictions.push(predicted);
        labels.push(y);
    }
    let (predictions, labels) = (Tensor::cat(&predictions, 0), Tensor::cat(&labels, 0));
    let correct = predictions.eq_tensor(&labels).sum(Kind::Int64);
    Ok(Eval {
        accuracy: i64::try_from(&correct)? as f64 / labels.size()[0] as f64,
        samples: labels.size()[0],
    })
}
