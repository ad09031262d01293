//! The config-driven training loop behind `hearth run`.

use super::config::{DataKind, DeviceChoice, ModelKind, OptimizerKind, TrainConfig};
use super::eval::{score, Evaluation, Shard};
use super::loss::lm_loss;
use super::progress::Progress;
use crate::accelerator::{Accelerator, BackwardError, BuildError, PrepareError};
use crate::checkpoint::CheckpointError;
use crate::data::{RandomTokens, SortDigits, TextFile, TextFileError, TokenDataset};
use crate::models::{Gpt, GptConfig, Mlp, MlpConfig, Model, TorchScriptError, TorchScriptModel};
use crate::ops::{AdamHyper, SgdHyper};
use crate::optim::{Adam, Optimizer, Sgd};
use crate::plugins::{
    load_checkpoint_hook, load_scheduler, load_tracker, CheckpointHookPlugin, PluginError,
    Registry, SchedulerPlugin, SearchPath, TrackerPlugin, Value,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::{Kind, TchError, Tensor};

/// Overrides given on the command line (they win over the config file).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Replaces `run.output-dir`.
    pub output_dir: Option<PathBuf>,
    /// Replaces `run.steps`.
    pub steps: Option<u64>,
    /// Forces the CPU (replaces `run.device`).
    pub cpu: bool,
    /// No progress bar.
    pub quiet: bool,
    /// Folders searched for plugins before `HEARTH_PLUGIN_PATH`, the
    /// project's `plugins/` and the built-ins.
    pub plugin_dirs: Vec<PathBuf>,
    /// Continue from the newest complete checkpoint of the run folder.
    pub resume: bool,
}

/// What a finished run reports (also written as `summary.json`).
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The run folder.
    pub run_dir: PathBuf,
    /// The trained model's weights.
    pub model_path: PathBuf,
    /// Device trained on (`cpu`, `cuda:0`).
    pub device: String,
    /// Scalar parameters of the model.
    pub num_parameters: i64,
    /// Optimizer steps taken.
    pub steps: u64,
    /// Mean training loss over the last logging window.
    pub final_loss: f64,
    /// Training throughput in input tokens per second, measured after warm-up steps.
    pub tokens_per_sec: f64,
    /// The final held-out evaluation, when the dataset has one.
    pub eval: Option<Evaluation>,
    /// This process's rank (the summary file is the main process's).
    pub process_index: usize,
    /// Number of processes that trained together.
    pub num_processes: usize,
    /// What gradient averaging did on this process (the file holds the
    /// main process's counts; `bytes` is what it sent; zeros for one process).
    pub gradient_sync: crate::dist::SyncStats,
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The dataset could not be opened.
    #[error(transparent)]
    Data(#[from] TextFileError),
    /// Writing the model failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A libtorch operation failed.
    #[error("libtorch error")]
    Torch(#[from] TchError),
    /// A backward pass, or the gradient averaging after it, failed.
    #[error(transparent)]
    Backward(#[from] BackwardError),
    /// A collective between the processes failed.
    #[error("the processes could not agree")]
    Dist(#[from] crate::dist::DistError),
    /// The TorchScript model could not be loaded.
    #[error(transparent)]
    TorchScript(#[from] TorchScriptError),
    /// An accelerator setting (or `HEARTH_*` variable) is unusable.
    #[error("cannot set up the accelerator")]
    Accelerator(#[from] BuildError),
    /// Preparing the model, optimizer or scheduler failed.
    #[error("cannot prepare the training objects")]
    Prepare(#[from] PrepareError),
    /// The run folder could not be written.
    #[error("failed to write {path}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `run.device = "cuda"` on a machine without a usable GPU.
    #[error("config {0}: run.device = \"cuda\" but no CUDA device is available; use \"auto\" or \"cpu\"")]
    NoCuda(PathBuf),
    /// A tracker named in the config could not be found or loaded.
    #[error("config {path}")]
    Plugin {
        /// The config file.
        path: PathBuf,
        /// What went wrong with the plugin.
        #[source]
        source: PluginError,
    },
    /// The scheduler plugin failed during training (it cannot fail open:
    /// the run needs its rates).
    #[error("training stopped: the scheduler failed")]
    Scheduler(#[source] PluginError),
    /// Saving or loading a checkpoint failed.
    #[error("checkpoint")]
    State(#[source] CheckpointError),
    /// The loss became NaN or infinite.
    #[error("training diverged at step {step}: the loss is {loss}; lower optimizer.lr or set optimizer.max-grad-norm")]
    Diverged {
        /// Step at which it was seen.
        step: u64,
        /// The loss value.
        loss: f64,
    },
}

fn dataset(config: &TrainConfig) -> Result<Box<dyn TokenDataset>, TrainError> {
    let d = &config.data;
    Ok(match d.kind {
        DataKind::SortDigits => Box::new(SortDigits::new(d.digits())),
        DataKind::RandomTokens => Box::new(RandomTokens::new(d.vocab_size(), d.seq_len())),
        DataKind::TextFile => {
            let path = config.resolve(d.path.as_deref().expect("validated: text-file has a path"));
            Box::new(TextFile::open(&path, d.seq_len())?)
        }
    })
}

fn model(
    config: &TrainConfig,
    data: &dyn TokenDataset,
    device: tch::Device,
) -> Result<Box<dyn Model>, TrainError> {
    let m = &config.model;
    Ok(match m.kind {
        ModelKind::Torchscript => {
            let path = config.resolve(
                m.path
                    .as_deref()
                    .expect("validated: torchscript has a path"),
            );
            Box::new(TorchScriptModel::load(&path, device)?)
        }
        ModelKind::Gpt => Box::new(Gpt::new(
            GptConfig {
                vocab_size: data.vocab_size(),
                block_size: data.seq_len(),
                d_model: m.d_model,
                layers: m.layers,
                heads: m.heads,
            },
            device,
        )),
        ModelKind::Mlp => Box::new(Mlp::new(
            MlpConfig {
                vocab_size: data.vocab_size(),
                context: m.context(),
                d_model: m.d_model,
                hidden: m.hidden(),
            },
            device,
        )),
    })
}

fn optimizer(config: &TrainConfig, model: &dyn Model) -> Box<dyn Optimizer> {
    let o = &config.optimizer;
    let groups = o.param_groups(model.named_parameters());
    match o.kind {
        OptimizerKind::Adamw | OptimizerKind::Adam => Box::new(Adam::new(
            groups,
            AdamHyper {
                lr: o.lr(),
                betas: o.betas(),
                weight_decay: o.weight_decay(),
                eps: o.eps(),
                decoupled: o.kind == OptimizerKind::Adamw,
            },
        )),
        OptimizerKind::Sgd => Box::new(Sgd::new(
            groups,
            SgdHyper {
                lr: o.lr(),
                momentum: o.momentum.unwrap_or(0.0),
                dampening: o.dampening.unwrap_or(0.0),
                weight_decay: o.weight_decay(),
                nesterov: o.nesterov.unwrap_or(false),
            },
        )),
    }
}

/// The plugins on the run's search path, when the config names any.
fn plugin_registry(
    config: &TrainConfig,
    options: &RunOptions,
) -> Result<Option<Registry>, TrainError> {
    if config.trackers.is_empty()
        && config.scheduler.is_none()
        && config.checkpoint_hooks.is_empty()
    {
        return Ok(None);
    }
    let project = config
        .source
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    Registry::discover(&SearchPath::standard(&options.plugin_dirs, Some(project)))
        .map(Some)
        .map_err(plugin_error(config))
}

/// A plugin error of this config's run, naming the config file.
fn plugin_error(config: &TrainConfig) -> impl Fn(PluginError) -> TrainError + Copy + '_ {
    |source| TrainError::Plugin {
        path: config.source.clone(),
        source,
    }
}

/// Finds and loads the config's trackers, each logging into
/// `logging_dir/trackers/<name>`.
fn trackers(
    config: &TrainConfig,
    registry: Option<&Registry>,
    logging_dir: &Path,
) -> Result<Vec<TrackerPlugin>, TrainError> {
    let Some(registry) = registry else {
        return Ok(Vec::new());
    };
    let plugin_err = plugin_error(config);
    config
        .trackers
        .iter()
        .map(|t| {
            let found = registry.find(&t.name).map_err(plugin_err)?;
            load_tracker(&found.manifest, &logging_dir.join("trackers").join(&t.name))
                .map_err(plugin_err)
        })
        .collect()
}

/// Loads the config's checkpoint hooks with their options, in order.
fn checkpoint_hooks(
    config: &TrainConfig,
    registry: Option<&Registry>,
) -> Result<Vec<CheckpointHookPlugin>, TrainError> {
    let Some(registry) = registry else {
        return Ok(Vec::new());
    };
    let plugin_err = plugin_error(config);
    config
        .checkpoint_hooks
        .iter()
        .map(|h| {
            let found = registry.find(&h.name).map_err(plugin_err)?;
            load_checkpoint_hook(&found.manifest, &h.options_json()).map_err(plugin_err)
        })
        .collect()
}

/// Loads the config's scheduler plugin and creates its schedule.
fn scheduler(
    config: &TrainConfig,
    registry: Option<&Registry>,
    base_lrs: &[f64],
    steps: u64,
) -> Result<Option<SchedulerPlugin>, TrainError> {
    let (Some(section), Some(registry)) = (&config.scheduler, registry) else {
        return Ok(None);
    };
    let plugin_err = plugin_error(config);
    let found = registry.find(&section.name).map_err(plugin_err)?;
    load_scheduler(
        &found.manifest,
        &section.options_json(),
        base_lrs,
        Some(steps),
    )
    .map(Some)
    .map_err(plugin_err)
}

/// The training data stream (a seeded ChaCha generator) as a checkpointed
/// object, so a resumed run draws the batches it would have drawn.
struct DataStream(ChaCha8Rng);

impl crate::accelerator::Checkpointable for DataStream {
    fn state_dict(&self) -> Vec<u8> {
        let mut bytes = self.0.get_seed().to_vec();
        bytes.extend(self.0.get_stream().to_le_bytes());
        bytes.extend(self.0.get_word_pos().to_le_bytes());
        bytes
    }
    /// Every process draws its own batches from its own stream.
    fn per_process(&self) -> bool {
        true
    }
    fn load_state_dict(&mut self, state: &[u8]) -> Result<(), String> {
        if state.len() != 56 {
            return Err(format!(
                "the data stream state is 56 bytes, not {}",
                state.len()
            ));
        }
        let seed: [u8; 32] = state[..32].try_into().expect("32 bytes");
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(u64::from_le_bytes(
            state[32..40].try_into().expect("8 bytes"),
        ));
        rng.set_word_pos(u128::from_le_bytes(
            state[40..].try_into().expect("16 bytes"),
        ));
        self.0 = rng;
        Ok(())
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.into(),
        source,
    }
}

fn eval_entries(e: &Evaluation) -> crate::plugins::Entries {
    match *e {
        Evaluation::ExactMatch { accuracy, .. } => {
            vec![("eval/accuracy".into(), Value::Float(accuracy))]
        }
        Evaluation::ValidationLoss { loss, .. } => vec![("eval/loss".into(), Value::Float(loss))],
    }
}

/// Trains the model a config describes, evaluates it, and writes
/// `model.safetensors`, `config.toml` and `summary.json` to the run folder.
pub fn run(config: &TrainConfig, options: &RunOptions) -> Result<RunSummary, TrainError> {
    let device_choice = if options.cpu {
        DeviceChoice::Cpu
    } else {
        config.run.device
    };
    if device_choice == DeviceChoice::Cuda && !tch::Cuda::is_available() {
        return Err(TrainError::NoCuda(config.source.clone()));
    }
    let mut builder = Accelerator::builder();
    if device_choice != DeviceChoice::Auto {
        builder = builder.cpu(device_choice == DeviceChoice::Cpu);
    }
    if let Some(mode) = config.run.mixed_precision {
        builder = builder.mixed_precision(mode);
    }
    if let Some(ga) = config.run.gradient_accumulation_steps {
        builder = builder.gradient_accumulation_steps(ga);
    }
    let steps = options.steps.unwrap_or(config.run.steps);
    let seed = config.run.seed;
    let run_dir = options
        .output_dir
        .clone()
        .unwrap_or_else(|| config.run.output_dir.clone())
        .join(&config.run.name);
    builder = builder.project_config(crate::accelerator::ProjectConfiguration {
        project_dir: run_dir.clone(),
        logging_dir: None,
        automatic_checkpoint_naming: true,
        iteration: 0,
        total_limit: config.run.keep_checkpoints,
        // Training goes on while a checkpoint is written; the next save and
        // the end of the run wait for it.
        async_save: true,
        save_on_each_node: config.distributed.save_on_each_node,
    });
    builder = builder.ddp(config.distributed.ddp());
    if let Some(backend) = config.distributed.backend {
        builder = builder.backend(backend);
    }
    if let Some(timeout) = config.distributed.timeout() {
        builder = builder.timeout(timeout);
    }
    let mut acc = builder.build()?;
    let device = acc.device();
    let accumulation = acc.gradient_accumulation_steps();

    let registry = plugin_registry(config, options)?;
    let trackers = if acc.is_main_process() {
        let logging_dir = acc.project_configuration().logging_dir().to_path_buf();
        trackers(config, registry.as_ref(), &logging_dir)?
    } else {
        Vec::new()
    };
    acc.init_trackers(
        &config.run.project,
        &config.run.name,
        trackers,
        config.entries(),
    );
    for hook in checkpoint_hooks(config, registry.as_ref())? {
        acc.register_checkpoint_hook(hook);
    }

    acc.set_seed(seed, false);
    let data = dataset(config)?;
    let model = model(config, data.as_ref(), device)?;
    let opt = optimizer(config, model.as_ref());
    let schedule = scheduler(config, registry.as_ref(), &opt.lrs(), steps)?;
    let (model, mut opt) = acc.prepare((model, opt))?;
    let mut schedule = schedule.map(|s| acc.prepare(s)).transpose()?;
    let batch_size = config.data.batch_size;
    // Process r draws from stream r of the seed: different batches on
    // every process, the same ones as before for a world of one.
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(acc.process_index() as u64);
    let stream = std::sync::Arc::new(std::sync::Mutex::new(DataStream(rng)));
    acc.register_for_checkpointing(stream.clone());
    let mut first_step = 1;
    if options.resume {
        let from = acc.load_state(None).map_err(TrainError::State)?;
        first_step = acc.step() / accumulation as u64 + 1;
        acc.print(format!(
            "resumed from {} at step {first_step}",
            from.display()
        ));
    }

    acc.print(format!(
        "hearth run {}: {:?} with {} parameters on {device:?}, {steps} steps of {}{batch_size} × {} tokens{}",
        config.run.name,
        config.model.kind,
        model.num_parameters(),
        if accumulation > 1 { format!("{accumulation} × ") } else { String::new() },
        data.seq_len(),
        match acc.mixed_precision() {
            crate::precision::MixedPrecision::No => String::new(),
            mode => format!(", mixed precision {mode}"),
        }
    ));
    let progress = Progress::new(steps, options.quiet, acc.is_main_process());
    // Tokens of all processes.
    let tokens_per_step =
        (batch_size * data.seq_len()) as f64 * accumulation as f64 * acc.num_processes() as f64;
    // Throughput leaves out the first steps (allocator and kernel warm-up).
    let warmup = (steps / 5).min(10);
    let (mut timer, mut window_start) = (Instant::now(), Instant::now());
    let (mut window_loss, mut window_micro) = (Tensor::zeros([], (Kind::Float, device)), 0u64);
    let mut window_steps = 0u64;
    let mut final_loss = f64::NAN;
    // Each process scores its shard of the held-out data; the sums of all
    // shards are the evaluation (Accelerate's gather_for_metrics pattern).
    let shard = Shard {
        index: acc.process_index(),
        count: acc.num_processes(),
    };
    let run_eval = |acc: &Accelerator| -> Result<Option<Evaluation>, TrainError> {
        let eval = &config.eval;
        let scored = score(
            &model,
            data.as_ref(),
            seed,
            eval.samples,
            eval.batch_size,
            device,
            shard,
        );
        let Some(scores) = scored else {
            return Ok(None);
        };
        let sums = acc.reduce(&scores.to_tensor(), crate::dist::ReduceOp::Sum)?;
        Ok(Some(scores.with_sums(&sums).evaluation()))
    };
    for step in first_step..=steps {
        if step == first_step + warmup {
            timer = Instant::now();
        }
        // The rate this optimizer step uses (the scheduler moves it on
        // once the step is taken).
        let step_lr = opt.lr();
        for _ in 0..accumulation {
            let batch = data.sample_batch(batch_size, &mut stream.lock().unwrap().0);
            let (inputs, targets) = (
                batch.inputs.to_device(device),
                batch.targets.to_device(device),
            );
            let loss = acc.accumulate(|| -> Result<Tensor, TrainError> {
                let loss = lm_loss(&model.forward_t(&inputs, true), &targets);
                acc.backward(&loss)?;
                if let Some(max_norm) = config.optimizer.max_grad_norm {
                    // Clips (and unscales) only at the accumulation group's end.
                    let _norm = acc.clip_grad_norm_(&mut opt, max_norm)?;
                }
                opt.step()?;
                if let Some(schedule) = schedule.as_mut() {
                    schedule.step().map_err(TrainError::Scheduler)?;
                }
                opt.zero_grad();
                Ok(loss)
            })?;
            window_loss += loss.detach();
            window_micro += 1;
        }
        window_steps += 1;
        progress.advance();
        if step % config.run.log_every == 0 || step == steps {
            // The mean over all processes (every one logs at the same steps).
            let mean_loss = acc.reduce(
                &window_loss.to_device(tch::Device::Cpu),
                crate::dist::ReduceOp::Mean,
            )?;
            final_loss = f64::try_from(&mean_loss)? / window_micro as f64;
            if !final_loss.is_finite() {
                progress.finish();
                return Err(TrainError::Diverged {
                    step,
                    loss: final_loss,
                });
            }
            let rate = window_steps as f64 * tokens_per_step / window_start.elapsed().as_secs_f64();
            progress.report(step, steps, final_loss, step_lr, rate);
            let mut values = vec![
                ("loss".into(), Value::Float(final_loss)),
                ("lr".into(), Value::Float(step_lr)),
                ("tokens_per_sec".into(), Value::Float(rate)),
            ];
            if let Some(scale) = acc.loss_scale() {
                values.push(("loss_scale".into(), Value::Float(scale)));
            }
            acc.log(values, step);
            window_loss = Tensor::zeros([], (Kind::Float, device));
            (window_micro, window_steps) = (0, 0);
            window_start = Instant::now();
        }
        if let Some(every) = config.eval.every {
            if step % every == 0 && step != steps {
                if let Some(e) = run_eval(&acc)? {
                    progress.log(format!("step {step}: {e}"));
                    if let Some(schedule) = schedule.as_mut() {
                        // reduce-on-plateau reacts to it; other schedules ignore it.
                        schedule
                            .observe(e.metric())
                            .map_err(TrainError::Scheduler)?;
                    }
                    acc.log(eval_entries(&e), step);
                }
            }
        }
        if config.run.save_every.is_some_and(|every| step % every == 0) {
            let saved = acc.save_state(None).map_err(TrainError::State)?;
            progress.log(format!("step {step}: checkpoint {}", saved.display()));
        }
    }
    let timed_steps = (steps + 1).saturating_sub(first_step + warmup);
    let tokens_per_sec = timed_steps as f64 * tokens_per_step / timer.elapsed().as_secs_f64();
    progress.finish();

    let eval = run_eval(&acc)?;
    if let Some(e) = &eval {
        let mut values = eval_entries(e);
        values.push(("eval/summary".into(), Value::Text(e.to_string())));
        acc.log(values, steps);
    }
    acc.end_training().map_err(TrainError::State)?;
    // The weights: model.safetensors, or shards and their index.
    let saved = acc.save_model(&model, &run_dir, config.run.max_shard_size())?;
    let model_path = saved
        .map(|s| s.index.unwrap_or_else(|| s.files[0].clone()))
        .unwrap_or_else(|| run_dir.join(crate::checkpoint::SAFE_WEIGHTS_NAME));
    let summary = RunSummary {
        run_dir: run_dir.clone(),
        model_path: model_path.clone(),
        device: format!("{device:?}").to_lowercase(),
        num_parameters: model.num_parameters(),
        steps,
        final_loss,
        tokens_per_sec,
        eval,
        process_index: acc.process_index(),
        num_processes: acc.num_processes(),
        gradient_sync: acc.gradient_sync_stats(),
    };
    if acc.is_main_process() {
        std::fs::create_dir_all(&run_dir).map_err(io_err(&run_dir))?;
        let config_copy = run_dir.join("config.toml");
        if let Ok(text) = std::fs::read_to_string(&config.source) {
            std::fs::write(&config_copy, text).map_err(io_err(&config_copy))?;
        }
        let summary_path = run_dir.join("summary.json");
        let json = serde_json::to_string_pretty(&summary).expect("summary serialises");
        std::fs::write(&summary_path, json).map_err(io_err(&summary_path))?;
    }
    Ok(summary)
}
