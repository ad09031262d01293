//! The config-driven training loop behind `hearth run`.

use super::config::{OnSaveError, TrainConfig};
use super::error::TrainError;
use super::eval::{try_score, Evaluation, Plan as EvalPlan, Shard};
use super::graphed::GraphedStep;
use super::history::{History, HISTORY_NAME};
use super::profile::RunProfile;
use super::progress::Progress;
use super::results::{write_results, Finished, RunSummary, Trained};
use super::setup::{self, eval_entries, io_err};
use super::step::{slowest_rank, update};
use super::stream::DataStream;
use super::RunOptions;
use crate::accelerator::{AcceleratedOptimizer, AcceleratedScheduler, Accelerator, PreparedModel};
use crate::checkpoint::CheckpointError;
use crate::data::TokenDataset;
use crate::models::Model;
use hearth_plugins::{Entries, Registry, Value};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tch::{Kind, Tensor};

/// Trains the model a config describes, evaluates it, and writes
/// `model.safetensors`, `config.toml` and `summary.json` to the run folder.
pub fn run(config: &TrainConfig, options: &RunOptions) -> Result<RunSummary, TrainError> {
    let run_dir = options
        .output_dir
        .clone()
        .unwrap_or_else(|| config.run.output_dir.clone())
        .join(&config.run.name);
    let plugins_before = hearth_plugins::plugin_usage();
    let mut acc = setup::accelerator(config, options, &run_dir)?;
    let registry = setup::plugin_registry(config, options)?;
    // The data and the model (with its pretrained weights) first: bad
    // input stops the run before anything is written.
    let built = Built::new(&mut acc, config)?;
    attach_plugins(&mut acc, config, options, registry.as_ref())?;
    let mut job = Job::prepare(
        &mut acc,
        built,
        config,
        options,
        registry.as_ref(),
        &run_dir,
    )?;
    // Stopped by a signal, it returns the error after its checkpoint and
    // the trackers' end.
    let trained = job.train(&mut acc, config, options, &run_dir)?;
    let eval = job.evaluate(&acc, config)?;
    if let Some(e) = &eval {
        let mut values = eval_entries(e);
        values.push(("eval/summary".into(), Value::Text(e.to_string())));
        job.log(&acc, values, job.steps)?;
    }
    acc.end_training().map_err(TrainError::State)?;
    let plugin_calls = hearth_plugins::plugin_usage_since(&plugins_before);
    let finished = Finished {
        model: &job.model,
        file_names: &job.file_names,
        adapter: job.adapter.as_ref(),
        steps: job.steps,
        cuda_graph: job.graphed.as_ref().map(GraphedStep::stats),
        trained,
    };
    write_results(&acc, config, &run_dir, finished, eval, plugin_calls)
}

/// Trackers (main process only) and checkpoint hooks from the config.
fn attach_plugins(
    acc: &mut Accelerator,
    config: &TrainConfig,
    options: &RunOptions,
    registry: Option<&Registry>,
) -> Result<(), TrainError> {
    let trackers = if acc.is_main_process() {
        let logging_dir = acc.project_configuration().logging_dir().to_path_buf();
        setup::trackers(config, registry, &logging_dir, !resuming(acc, options))?
    } else {
        Vec::new()
    };
    acc.init_trackers(
        &config.run.project,
        &config.run.name,
        trackers,
        config.entries(),
    );
    for hook in setup::checkpoint_hooks(config, registry)? {
        acc.register_checkpoint_hook(hook);
    }
    Ok(())
}

/// Whether the run resumes from its newest checkpoint (`--resume`, or
/// `--resume-if-any` and it has one).
fn resuming(acc: &Accelerator, options: &RunOptions) -> bool {
    options.resume
        || (options.resume_if_any && own_checkpoint(&acc.project_configuration().checkpoints_dir()))
}

/// The prepared training objects of a run.
struct Job {
    data: Box<dyn TokenDataset>,
    model: PreparedModel<Box<dyn Model>>,
    /// The pretrained file's name of each tensor `init-from` loaded: the
    /// model is saved under them.
    file_names: std::collections::HashMap<String, String>,
    /// The PEFT adapter `adapter-from` read, written back at the end.
    adapter: Option<super::adapter::RunAdapter>,
    opt: AcceleratedOptimizer,
    schedule: Option<AcceleratedScheduler>,
    /// Process r draws its batches from stream r of the seed.
    stream: Arc<Mutex<DataStream>>,
    steps: u64,
    first_step: u64,
    /// The run's own `metrics.jsonl` (the main process's).
    history: Option<History>,
    /// The gradient norm of the last clipped step, read when logging.
    grad_norm: Option<Tensor>,
    /// The step as a CUDA graph (`run.cuda-graph`).
    graphed: Option<GraphedStep>,
    /// The signals that stop the run politely (`run.save-on-signal`).
    preemption: Option<super::preempt::Preemption>,
    /// Steps whose checkpoint failed, with `on-save-error = "continue"`.
    not_saved: Vec<u64>,
    /// The step of the checkpoint last started.
    saving: Option<u64>,
    /// How many parameters train and how many are frozen.
    trainable: crate::models::Trainable,
}

/// The dataset and the model, built and checked before the run writes
/// anything.
struct Built {
    data: Box<dyn TokenDataset>,
    model: Box<dyn Model>,
    /// The pretrained file's name of each tensor `init-from` loaded.
    file_names: std::collections::HashMap<String, String>,
    /// The PEFT adapter `adapter-from` read, written back at the end.
    adapter: Option<super::adapter::RunAdapter>,
}

impl Built {
    /// Seeds the generators, opens the data and builds the model, its
    /// weights from `init-from` when the config names some.
    fn new(acc: &mut Accelerator, config: &TrainConfig) -> Result<Self, TrainError> {
        acc.set_seed(config.run.seed, false, false);
        let data = setup::dataset(config, Some(acc))?;
        let weights = acc.model_weights();
        let model = setup::model(config, data.as_ref(), acc.model_init_device(), weights)?;
        let file_names = setup::pretrained(config, model.as_ref(), weights, acc)?;
        let adapter = super::adapter::load(config, model.as_ref(), acc)?;
        Ok(Self {
            data,
            model,
            file_names,
            adapter,
        })
    }
}

impl Job {
    /// Prepares the data, model, optimizer and scheduler, and with
    /// `--resume` loads the newest checkpoint.
    fn prepare(
        acc: &mut Accelerator,
        built: Built,
        config: &TrainConfig,
        options: &RunOptions,
        registry: Option<&Registry>,
        run_dir: &std::path::Path,
    ) -> Result<Self, TrainError> {
        let steps = options.steps.unwrap_or(config.run.steps);
        let seed = config.run.seed;
        let Built {
            data,
            model,
            file_names,
            adapter,
        } = built;
        let trainable = crate::models::Trainable::of(&model.named_parameters());
        let opt = setup::optimizer(config, model.as_ref());
        let schedule = setup::scheduler(config, registry, &opt.lrs(), steps)?;
        let (model, opt) = acc.prepare((model, opt))?;
        setup::probe_prepared(config, data.as_ref(), &model, acc.model_init_device())?;
        let schedule = schedule.map(|s| acc.prepare(s)).transpose()?;
        let sequential = (config.data.sampling() == super::config::Sampling::Sequential)
            .then(|| config.data.shuffle.unwrap_or(false));
        let stream = DataStream::new(seed, acc.process_index(), acc.num_processes(), sequential);
        stream.check(data.as_ref(), config.data.batch_size, &config.source)?;
        let stream = Arc::new(Mutex::new(stream));
        acc.register_for_checkpointing(stream.clone());
        let mut first_step = 1;
        let resume = resuming(acc, options);
        if resume {
            let from = acc.load_state(None).map_err(TrainError::State)?;
            first_step = acc.step() / acc.gradient_accumulation_steps() as u64 + 1;
            acc.print(format!(
                "resumed from {} at step {first_step}",
                from.display()
            ));
        }
        let history = if acc.is_main_process() {
            let resumed_at = resume.then_some(first_step - 1);
            Some(History::open(run_dir, resumed_at).map_err(io_err(&run_dir.join(HISTORY_NAME)))?)
        } else {
            None
        };
        Ok(Self {
            data,
            model,
            opt,
            schedule,
            stream,
            steps,
            first_step,
            history,
            grad_norm: None,
            graphed: None,
            file_names,
            adapter,
            preemption: super::preempt::from_config(
                &config.run.save_on_signal,
                config.run.signal_grace_seconds,
            )?,
            not_saved: Vec::new(),
            saving: None,
            trainable,
        })
    }

    /// Logs `values` at `step` to the trackers and the run's history.
    fn log(&mut self, acc: &Accelerator, values: Entries, step: u64) -> Result<(), TrainError> {
        if let Some(history) = &mut self.history {
            let numbers: Vec<(String, f64)> = values
                .iter()
                .filter_map(|(k, v)| match v {
                    Value::Float(f) => Some((k.clone(), *f)),
                    Value::Int(i) => Some((k.clone(), *i as f64)),
                    _ => None,
                })
                .collect();
            history
                .log(step, &numbers)
                .map_err(io_err(history.path()))?;
        }
        acc.log(values, step);
        Ok(())
    }

    /// Runs the optimizer steps, logging, evaluating and saving as the
    /// config says.
    fn train(
        &mut self,
        acc: &mut Accelerator,
        config: &TrainConfig,
        options: &RunOptions,
        run_dir: &std::path::Path,
    ) -> Result<Trained, TrainError> {
        let (steps, device) = (self.steps, acc.device());
        let accumulation = acc.gradient_accumulation_steps();
        if config.run.cuda_graph {
            self.use_cuda_graph(acc, config)?;
        }
        super::progress::announce(
            acc,
            config,
            super::progress::Shape {
                parameters: self.model.num_parameters(),
                trainable: self.trainable,
                steps: self.steps,
                seq_len: self.data.seq_len(),
                graphed: self.graphed.is_some(),
            },
        );
        let mut profile = RunProfile::start(acc, config, options, run_dir, self.first_step)?;
        let progress = Progress::new(steps, options.quiet, acc.is_main_process());
        // Tokens of all processes.
        let tokens_per_step = (config.data.batch_size * self.data.seq_len()) as f64
            * accumulation as f64
            * acc.num_processes() as f64;
        // Throughput leaves out the first steps (allocator and kernel warm-up).
        let warmup = (steps / 5).min(10);
        let (mut timer, mut window_start) = (Instant::now(), Instant::now());
        let (mut window_loss, mut window_micro) = (Tensor::zeros([], (Kind::Float, device)), 0u64);
        let mut window_steps = 0u64;
        // Seconds this process spent in its own steps (for the slowest rank).
        let mut window_busy = 0.0f64;
        let mut final_loss = f64::NAN;
        for step in self.first_step..=steps {
            if step == self.first_step + warmup {
                timer = Instant::now();
            }
            // The rate this optimizer step uses (the scheduler moves it on
            // once the step is taken).
            let step_lr = self.opt.lr();
            let busy = Instant::now();
            for _ in 0..accumulation {
                window_loss += self.micro_step(acc, config, step)?.detach();
                window_micro += 1;
            }
            window_busy += busy.elapsed().as_secs_f64();
            window_steps += 1;
            progress.advance();
            if step % config.run.log_every == 0 || step == steps {
                // The mean over all processes (every one logs at the same steps).
                let mean_loss = acc.reduce(
                    &window_loss.to_device(tch::Device::Cpu),
                    hearth_comm::ReduceOp::Mean,
                )?;
                final_loss = f64::try_from(&mean_loss)? / window_micro as f64;
                if !final_loss.is_finite() {
                    progress.finish();
                    return Err(TrainError::Diverged {
                        step,
                        loss: final_loss,
                    });
                }
                let rate =
                    window_steps as f64 * tokens_per_step / window_start.elapsed().as_secs_f64();
                let slowest = slowest_rank(acc, window_busy / window_steps as f64)?;
                progress.report(step, steps, final_loss, step_lr, rate, slowest);
                let mut values = vec![
                    ("loss".into(), Value::Float(final_loss)),
                    ("lr".into(), Value::Float(step_lr)),
                    ("tokens_per_sec".into(), Value::Float(rate)),
                ];
                if let Some(scale) = acc.loss_scale() {
                    values.push(("loss_scale".into(), Value::Float(scale)));
                }
                if let Some(norm) = self.grad_norm.take() {
                    values.push(("grad_norm".into(), Value::Float(f64::try_from(&norm)?)));
                }
                self.log(acc, values, step)?;
                window_loss = Tensor::zeros([], (Kind::Float, device));
                (window_micro, window_steps, window_busy) = (0, 0, 0.0);
                window_start = Instant::now();
            }
            let saved = self.between_steps(acc, config, step, &progress)?;
            if let Some(profile) = profile.as_mut() {
                profile.step()?;
            }
            if let Some(signal) =
                super::preempt::agreed_signal(acc, self.preemption.as_ref(), step)?
            {
                progress.finish();
                return Err(self.stop(acc, config, step, signal, saved, &progress)?);
            }
        }
        // The last background save's outcome, before the run's end takes it.
        let last = acc.wait_for_checkpoint_everywhere();
        self.checkpoint_failed(acc, config, last, &progress)?;
        let timed_steps = (steps + 1).saturating_sub(self.first_step + warmup);
        let tokens_per_sec = timed_steps as f64 * tokens_per_step / timer.elapsed().as_secs_f64();
        progress.finish();
        let profile = profile.map(|p| p.finish(acc)).transpose()?;
        Ok(Trained {
            final_loss,
            tokens_per_sec,
            profile,
            checkpoints_not_saved: self.not_saved.clone(),
        })
    }

    /// Checks that this run's step can be captured (`run.cuda-graph`) and
    /// sets it up: the optimizer reads its learning rates from the GPU.
    fn use_cuda_graph(
        &mut self,
        acc: &Accelerator,
        config: &TrainConfig,
    ) -> Result<(), TrainError> {
        let refused = |why: String| TrainError::CudaGraphRefused {
            path: config.source.clone(),
            why,
        };
        if let Some(why) = super::graphed::refusal(acc) {
            return Err(refused(why));
        }
        self.opt
            .with_inner(|inner| inner.use_device_lrs())
            .map_err(|why| refused(format!("cannot be used with this optimizer: {why}")))?;
        if let Some(why) = super::graphed::device_refusal(acc) {
            return Err(refused(why));
        }
        self.graphed = Some(GraphedStep::new());
        Ok(())
    }

    /// One micro-batch of optimizer step `step`: forward, backward and (at
    /// the end of an accumulation group) clipping, the optimizer and
    /// scheduler steps; replayed from a CUDA graph with `run.cuda-graph`.
    fn micro_step(
        &mut self,
        acc: &Accelerator,
        config: &TrainConfig,
        step: u64,
    ) -> Result<Tensor, TrainError> {
        let device = acc.device();
        let batch = {
            let _span = crate::profiling::span("hearth::next_batch");
            self.stream
                .lock()
                .unwrap()
                .next_batch(self.data.as_ref(), config.data.batch_size)
        };
        let (model, opt, schedule) = (&self.model, &mut self.opt, &mut self.schedule);
        let grad_norm = &mut self.grad_norm;
        let graphed = &mut self.graphed;
        acc.accumulate(|| -> Result<Tensor, TrainError> {
            let out = match graphed {
                Some(graphed) => {
                    let out = graphed.run(step, &batch, device, |inputs, targets| {
                        update(acc, config, model, opt, inputs, targets)
                    })?;
                    // Once captured, the graph owns the gradients.
                    if !graphed.is_captured() {
                        opt.zero_grad();
                    }
                    out
                }
                None => {
                    let inputs = batch.inputs.to_device(device);
                    let out = update(
                        acc,
                        config,
                        model,
                        opt,
                        &inputs,
                        &batch.targets.to_device(device),
                    )?;
                    opt.zero_grad();
                    out
                }
            };
            if let Some(norm) = out.grad_norm {
                *grad_norm = Some(norm);
            }
            if let Some(schedule) = schedule.as_mut() {
                schedule.step().map_err(TrainError::Scheduler)?;
            }
            Ok(out.loss)
        })
    }

    /// Stops politely after step `step` for `signal`: the checkpoint of
    /// that step (`saved` if one was just saved, else a new one) written
    /// and committed. Returns the error the run ends with.
    fn stop(
        &mut self,
        acc: &mut Accelerator,
        config: &TrainConfig,
        step: u64,
        signal: i32,
        saved: Option<std::path::PathBuf>,
        progress: &Progress,
    ) -> Result<TrainError, TrainError> {
        let checkpoint = match saved {
            Some(saved) => saved,
            None => {
                // The previous save's outcome is that save's (with
                // `continue` it does not keep this one from being tried).
                let previous = acc.wait_for_checkpoint_everywhere();
                self.checkpoint_failed(acc, config, previous, progress)?;
                self.saving = Some(step);
                acc.save_state(None).map_err(TrainError::State)?
            }
        };
        // This checkpoint must be on disk on every process: a polite stop
        // without it is a failure, whatever `on-save-error` says.
        acc.wait_for_checkpoint_everywhere()
            .map_err(TrainError::State)?;
        let signal = super::preempt::signal_name(signal);
        if let Some(history) = &mut self.history {
            history
                .event(step, &format!("stopped by {signal}"), &checkpoint)
                .map_err(io_err(history.path()))?;
        }
        // The trackers flushed and finished as at a run's end, and then no
        // process leaves before every one is done: a launcher (mpirun)
        // stops the rest when one exits.
        acc.end_training().map_err(TrainError::State)?;
        acc.wait_for_everyone()?;
        Ok(TrainError::Preempted {
            step,
            signal,
            checkpoint,
        })
    }

    /// After optimizer step `step`: evaluation and checkpoints when due.
    /// Returns the checkpoint saved, if one was.
    fn between_steps(
        &mut self,
        acc: &mut Accelerator,
        config: &TrainConfig,
        step: u64,
        progress: &Progress,
    ) -> Result<Option<std::path::PathBuf>, TrainError> {
        if let Some(every) = config.eval.every {
            if step % every == 0 && step != self.steps {
                if let Some(e) = self.evaluate(acc, config)? {
                    progress.log(format!("step {step}: {e}"));
                    if let Some(schedule) = self.schedule.as_mut() {
                        // reduce-on-plateau reacts to it; other schedules ignore it.
                        schedule
                            .observe(e.metric())
                            .map_err(TrainError::Scheduler)?;
                    }
                    self.log(acc, eval_entries(&e), step)?;
                }
            }
        }
        if config.run.save_every.is_some_and(|every| step % every == 0) {
            // The previous (background) save's outcome first: reported as
            // that save's, and the next one starts clean.
            let previous = acc.wait_for_checkpoint_everywhere();
            self.checkpoint_failed(acc, config, previous, progress)?;
            self.saving = Some(step);
            let saved = match acc.save_state(None) {
                Ok(saved) => saved,
                Err(e) => {
                    self.checkpoint_failed(acc, config, Err(e), progress)?;
                    return Ok(None);
                }
            };
            progress.log(format!("step {step}: checkpoint {}", saved.display()));
            if let Some(history) = &mut self.history {
                history
                    .event(step, "checkpoint", &saved)
                    .map_err(io_err(history.path()))?;
            }
            return Ok(Some(saved));
        }
        Ok(None)
    }

    /// The outcome of the checkpoint last started (at step `self.saving`):
    /// a failure is the run's error with `on-save-error = "stop"`; with
    /// `continue`, it is logged, put in `metrics.jsonl` and the summary,
    /// and training goes on.
    fn checkpoint_failed(
        &mut self,
        acc: &Accelerator,
        config: &TrainConfig,
        outcome: Result<(), CheckpointError>,
        progress: &Progress,
    ) -> Result<(), TrainError> {
        let Err(error) = outcome else { return Ok(()) };
        let step = self.saving.unwrap_or(self.steps);
        // A collective that timed out on the way leaves no process group
        // to go on with.
        if config.run.on_save_error == OnSaveError::Stop || hearth_comm::collectives_broken() {
            return Err(TrainError::State(error));
        }
        let message = format!("{error:#}");
        progress.warn(format!(
            "step {step}: a checkpoint was not saved; training goes on (on-save-error = \"continue\"): {message}"
        ));
        self.not_saved.push(step);
        if let Some(history) = &mut self.history {
            let folder = match &error {
                CheckpointError::Storage { path, .. } | CheckpointError::State { path, .. } => {
                    path.clone()
                }
                _ => acc.project_configuration().checkpoints_dir(),
            };
            history
                .event(step, &format!("checkpoint not saved: {message}"), &folder)
                .map_err(io_err(history.path()))?;
        }
        Ok(())
    }

    /// Each process scores its shard of the held-out data; the sums of all
    /// shards are the evaluation (Accelerate's gather_for_metrics pattern).
    fn evaluate(
        &self,
        acc: &Accelerator,
        config: &TrainConfig,
    ) -> Result<Option<Evaluation>, TrainError> {
        let shard = Shard {
            index: acc.process_index(),
            count: acc.num_processes(),
        };
        let eval = &config.eval;
        let forward = |x: &Tensor| self.model.try_forward_t(x, false);
        let scored = try_score(
            &forward,
            config.model.output(),
            self.data.as_ref(),
            EvalPlan {
                seed: config.run.seed,
                samples: eval.samples,
                batch_size: eval.batch_size,
            },
            acc.device(),
            shard,
        )?;
        let Some(scores) = scored else {
            return Ok(None);
        };
        let sums = acc.reduce(&scores.to_tensor(), hearth_comm::ReduceOp::Sum)?;
        Ok(Some(scores.with_sums(&sums).evaluation()))
    }
}

/// Whether the newest complete checkpoint in `folder` was written by the
/// `hearth launch` that started this process (a restarted job continues
/// from its own checkpoints, never from an older run's in the same folder).
fn own_checkpoint(folder: &std::path::Path) -> bool {
    let Some((_, newest)) = crate::checkpoint::newest_complete(folder) else {
        return false;
    };
    let written_by = std::fs::read(newest.join("trainer_state.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<crate::accelerator::TrainerState>(&b).ok())
        .and_then(|t| t.launch_id);
    written_by.is_some() && written_by == hearth_comm::launch_id()
}
