//! The steps before training in `hearth run`: the accelerator, the
//! plugins, the dataset, the model, the optimizer and the scheduler, each
//! built from its config section.

use super::config::{DataKind, DeviceChoice, ModelKind, OptimizerKind, TrainConfig};
use super::error::TrainError;
use super::eval::Evaluation;
use super::RunOptions;
use crate::accelerator::{Accelerator, AcceleratorBuilder, GradientAccumulationPlugin};
use crate::data::documents::{self, DocumentFormat, DocumentsSpec, LoadedTokenizer};
use crate::data::{RandomTokens, SortDigits, TextFile, TokenDataset, Tokens, TokensSpec};
use crate::models::{Gpt, GptConfig, Mlp, MlpConfig, Model, TorchScriptModel};
use crate::optim::{Adam, Optimizer, Sgd};
use hearth_ops::{AdamHyper, SgdHyper};
use hearth_plugins::{
    load_checkpoint_hook, load_scheduler, load_tracker_with, CheckpointHookPlugin, PluginError,
    Registry, SchedulerPlugin, SearchPath, TrackerPlugin, Value,
};
use std::path::Path;

/// The accelerator a config asks for: device, precision, accumulation,
/// the run folder as its project, `[distributed]` and `[fsdp]`.
pub(super) fn accelerator(
    config: &TrainConfig,
    options: &RunOptions,
    run_dir: &Path,
) -> Result<Accelerator, TrainError> {
    let device_choice = if options.cpu {
        DeviceChoice::Cpu
    } else {
        config.run.device
    };
    if device_choice == DeviceChoice::Cuda && !hearth_ops::cuda::is_available() {
        return Err(TrainError::NoCuda(config.source.clone()));
    }
    let mut builder = Accelerator::builder();
    if device_choice != DeviceChoice::Auto {
        builder = builder.cpu(device_choice == DeviceChoice::Cpu);
    }
    if let Some(mode) = config.run.mixed_precision {
        builder = builder.mixed_precision(mode);
    }
    let run = &config.run;
    if run.sync_with_dataloader.is_some()
        || run.sync_each_batch.is_some()
        || run.adjust_scheduler.is_some()
    {
        let defaults = GradientAccumulationPlugin::default();
        let num_steps = match run.gradient_accumulation_steps {
            Some(steps) => steps,
            None => crate::accelerator::accumulation_steps_from_env()?.unwrap_or(1),
        };
        builder = builder.gradient_accumulation_plugin(GradientAccumulationPlugin {
            num_steps,
            sync_with_dataloader: run
                .sync_with_dataloader
                .unwrap_or(defaults.sync_with_dataloader),
            sync_each_batch: run.sync_each_batch.unwrap_or(defaults.sync_each_batch),
            adjust_scheduler: run.adjust_scheduler.unwrap_or(defaults.adjust_scheduler),
        });
    } else if let Some(ga) = run.gradient_accumulation_steps {
        builder = builder.gradient_accumulation_steps(ga);
    }
    builder = builder.project_config(crate::accelerator::ProjectConfiguration {
        project_dir: run_dir.to_path_buf(),
        logging_dir: None,
        automatic_checkpoint_naming: true,
        iteration: 0,
        total_limit: config.run.keep_checkpoints,
        // By default training goes on while a checkpoint is written; the
        // next save and the end of the run wait for it.
        async_save: config.run.async_save,
        save_on_each_node: config.distributed.save_on_each_node,
    });
    builder = distributed(builder, config)?;
    builder = builder.plugin_path(search_path(config, options));
    Ok(builder.build()?)
}

/// `[distributed]` and `[fsdp]` on the builder.
fn distributed(
    mut builder: AcceleratorBuilder,
    config: &TrainConfig,
) -> Result<AcceleratorBuilder, TrainError> {
    // The parallelism, resolved once when the config was read (no
    // HEARTH_FSDP_* variable is read again).
    builder = builder.strategy(config.strategy());
    if let Some(method) = config.distributed.init_method() {
        builder = builder.init_method(method);
    }
    if let Some(backend) = config.distributed.backend {
        builder = builder.backend(backend);
    }
    if let Some(timeout) = config.distributed.timeout() {
        builder = builder.timeout(timeout);
    }
    Ok(builder)
}

/// Where the run's plugins are looked for: `--plugin-dir` folders, then
/// the standard places with the config's folder as the project.
pub(super) fn search_path(config: &TrainConfig, options: &RunOptions) -> SearchPath {
    let project = config
        .source
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    SearchPath::standard(&options.plugin_dirs, Some(project))
}

/// The configured dataset; documents (`jsonl`, `parquet`) are tokenized
/// into their token cache first, by the first process of each machine of
/// `acc` while the others wait (by this process without one).
pub(super) fn dataset(
    config: &TrainConfig,
    acc: Option<&Accelerator>,
) -> Result<Box<dyn TokenDataset>, TrainError> {
    let d = &config.data;
    let path = || config.resolve(d.path.as_deref().expect("validated: the kind has a path"));
    let tokens = |path: &Path, val_path: Option<&Path>, vocab_size: i64| {
        Tokens::open(&TokensSpec {
            path,
            val_path,
            dtype: d.dtype(),
            val_fraction: d.val_fraction(),
            seq_len: d.seq_len(),
            vocab_size,
            max_val_windows: config.eval.samples as usize,
        })
    };
    Ok(match d.kind {
        DataKind::SortDigits => Box::new(SortDigits::new(d.digits())),
        DataKind::RandomTokens => Box::new(RandomTokens::new(d.vocab_size(), d.seq_len())),
        DataKind::TextFile => Box::new(TextFile::open(&path(), d.seq_len())?),
        DataKind::Tokens => {
            let val_path = d.val_path.as_deref().map(|p| config.resolve(p));
            Box::new(tokens(&path(), val_path.as_deref(), d.vocab_size())?)
        }
        DataKind::Jsonl | DataKind::Parquet => {
            let spec = |pattern: &Path| -> Result<DocumentsSpec, TrainError> {
                Ok(DocumentsSpec {
                    files: documents::expand(&config.resolve(pattern))?,
                    format: match d.kind {
                        DataKind::Jsonl => DocumentFormat::Jsonl,
                        _ => DocumentFormat::Parquet,
                    },
                    text_field: d.text_field().to_string(),
                    tokenizer: config.resolve(d.tokenizer.as_deref().expect("validated")),
                    eos_token: d.eos_token.clone(),
                })
            };
            let train = spec(d.path.as_deref().expect("validated"))?;
            let tokenizer = LoadedTokenizer::open(&train)?;
            let cache = token_cache(acc, &train, &tokenizer)?;
            let val_cache = match &d.val_path {
                Some(p) => Some(token_cache(acc, &spec(p)?, &tokenizer)?),
                None => None,
            };
            let vocab = d.vocab_size.unwrap_or(tokenizer.vocab_size() as i64);
            Box::new(tokens(&cache, val_cache.as_deref(), vocab)?)
        }
    })
}

/// The token cache of `spec`, tokenized now by the first process of each
/// machine when it is absent; every process learns whether that worked.
fn token_cache(
    acc: Option<&Accelerator>,
    spec: &DocumentsSpec,
    tokenizer: &LoadedTokenizer,
) -> Result<std::path::PathBuf, TrainError> {
    let cache = documents::cache_path(spec, tokenizer)?;
    let tokenizes = acc.is_none_or(Accelerator::is_local_main_process);
    let mine = if tokenizes && !cache.exists() {
        let started = std::time::Instant::now();
        let progress = acc.is_none_or(Accelerator::is_main_process);
        documents::tokenize_into(spec, tokenizer, &cache, progress).map(|n| {
            tracing::info!(
                "tokenized {} file(s) into {n} tokens in {:.1} s: {}",
                spec.files.len(),
                started.elapsed().as_secs_f64(),
                cache.display()
            )
        })
    } else {
        Ok(())
    };
    let Some(acc) = acc else {
        mine?;
        return Ok(cache);
    };
    let failed = super::error::failed_rank(acc, &mine)?;
    mine?;
    if let Some((rank, message)) = failed {
        return Err(crate::data::DataError::Format {
            path: spec.files[0].clone(),
            message: format!("rank {rank} could not tokenize it: {message}"),
        }
        .into());
    }
    Ok(cache)
}

/// The configured model on `device`, its weights starting as `weights`
/// says (a TorchScript model's are the file's, on every process: on the
/// CPU read when the model is prepared, then [`probe`]d).
pub(super) fn model(
    config: &TrainConfig,
    data: &dyn TokenDataset,
    device: tch::Device,
    weights: crate::models::Weights,
) -> Result<Box<dyn Model>, TrainError> {
    let m = &config.model;
    let model: Box<dyn Model> = match m.kind {
        ModelKind::Torchscript => {
            let path = config.resolve(
                m.path
                    .as_deref()
                    .expect("validated: torchscript has a path"),
            );
            let fuse = m.fuse_graph.unwrap_or(true);
            // On the CPU its weights are read when it is prepared (one
            // unit at a time where FULL_SHARD shards it), and it is
            // probed then (`probe`).
            let model = match device {
                tch::Device::Cpu => TorchScriptModel::load_lazily(&path, fuse, weights)?,
                _ => {
                    let model = TorchScriptModel::load_with(&path, device, fuse)?;
                    model.probe(2, data.seq_len(), data.vocab_size())?;
                    model
                }
            }
            .with_output(m.output());
            if model.fused().any() {
                tracing::info!("{}: {}", path.display(), model.fused());
            }
            for line in &model.fused().unfused {
                tracing::info!("{}: {line}", path.display());
            }
            Box::new(model)
        }
        ModelKind::Gpt => Box::new(Gpt::with_weights(
            GptConfig {
                vocab_size: data.vocab_size(),
                block_size: data.seq_len(),
                d_model: m.d_model,
                layers: m.layers,
                heads: m.heads,
            },
            device,
            weights,
        )),
        ModelKind::Mlp => Box::new(Mlp::with_weights(
            MlpConfig {
                vocab_size: data.vocab_size(),
                context: m.context(),
                d_model: m.d_model,
                hidden: m.hidden(),
            },
            device,
            weights,
        )),
    };
    crate::models::set_trainable(
        &model.named_parameters(),
        m.trainable_globs(),
        m.frozen_globs(),
    )
    .map_err(|source| TrainError::Trainability {
        config: config.source.clone(),
        source,
    })?;
    Ok(model)
}

/// Probes a TorchScript model that was loaded lazily (on the CPU) now that
/// it is prepared and its weights are read ([`TorchScriptModel::probe`]):
/// its forward pass on a batch as the data gives them.
pub(super) fn probe_prepared(
    config: &TrainConfig,
    data: &dyn TokenDataset,
    model: &crate::accelerator::PreparedModel<Box<dyn Model>>,
    built_on: tch::Device,
) -> Result<(), TrainError> {
    let m = &config.model;
    if m.kind != ModelKind::Torchscript || built_on != tch::Device::Cpu {
        return Ok(());
    }
    let path = config.resolve(
        m.path
            .as_deref()
            .expect("validated: torchscript has a path"),
    );
    let device = model
        .named_parameters()
        .first()
        .map_or(built_on, |(_, p)| p.device());
    let shape = [2, data.seq_len(), data.vocab_size()];
    crate::models::probe_forward(&path, m.output(), device, shape, |x| {
        tch::no_grad(|| model.try_forward_t(x, false)).map_err(|e| {
            let chain = hearth_ops::error_chain(&e);
            let line = chain.lines().rev().find(|l| !l.trim().is_empty());
            line.unwrap_or_default().trim().to_string()
        })
    })?;
    Ok(())
}

/// Loads `[model] init-from` into `model`: every process checks the
/// files against the model (so all refuse together), and those whose
/// weights are materialised read them (under `cpu-ram-efficient-loading`
/// the others receive rank 0's when the model is prepared); every process
/// learns whether each read worked. Returns each loaded tensor's name in
/// the file, to save the fine-tuned model under.
pub(super) fn pretrained(
    config: &TrainConfig,
    model: &dyn Model,
    weights: crate::models::Weights,
    acc: &Accelerator,
) -> Result<std::collections::HashMap<String, String>, TrainError> {
    let m = &config.model;
    let Some(from) = &m.init_from else {
        return Ok(Default::default());
    };
    let source = config.resolve(from);
    let tensors = model.named_state();
    let mut buffers: std::collections::HashSet<String> =
        model.named_buffers().into_iter().map(|(n, _)| n).collect();
    // A base's weights hold no LoRA tensor: those keep their values (a new
    // adapter's) or come from adapter-from.
    let lora = super::adapter::lora_names(config, &tensors);
    let lora_names: std::collections::HashSet<String> =
        lora.model_names(&tensors).into_iter().collect();
    buffers.extend(lora_names.iter().cloned());
    let err = |source| TrainError::Init {
        config: config.source.clone(),
        source,
    };
    let plan = crate::checkpoint::pretrained::plan(
        &tensors,
        &buffers,
        &source,
        &m.init_names(),
        m.init_strict.unwrap_or(true),
    )
    .map_err(err)?;
    let report = &plan.report;
    let absent_buffers: Vec<&String> = report
        .absent_buffers
        .iter()
        .filter(|n| !lora_names.contains(*n))
        .collect();
    if !absent_buffers.is_empty() {
        tracing::warn!(
            "{}: holds no {}; these buffers keep their values",
            source.display(),
            absent_buffers
                .iter()
                .map(|n| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if !report.missing.is_empty() || !report.unexpected.is_empty() {
        tracing::warn!(
            "{} (init-strict = false): {} parameters keep their initial values ({}), {} tensors of the weights are not loaded ({})",
            source.display(),
            report.missing.len(),
            report.missing.join(", "),
            report.unexpected.len(),
            report.unexpected.join(", ")
        );
    }
    if !report.tied_copies.is_empty() {
        tracing::warn!(
            "{}: skipped {} (the same values as a tensor loaded under another name: a tied weight's second copy)",
            source.display(),
            report.tied_copies.join(", ")
        );
    }
    let file_names = plan.file_names(&tensors);
    let loaded = report.loaded;
    let mine = match weights {
        // A model read lazily reads them when it is prepared.
        crate::models::Weights::Initialised => match model.defer_init(plan) {
            None => Ok(()),
            Some(plan) => plan.load(&tensors),
        },
        crate::models::Weights::Unmaterialised => Ok(()),
    };
    if let Some((rank, message)) = super::error::failed_rank(acc, &mine)? {
        mine.map_err(err)?;
        return Err(err(crate::checkpoint::pretrained::InitError::Read(
            crate::checkpoint::CheckpointError::Format {
                path: source.clone(),
                message: format!("rank {rank} could not read it: {message}"),
            },
        )));
    }
    mine.map_err(err)?;
    acc.print(format!(
        "initialised {loaded} tensors from {}",
        source.display()
    ));
    Ok(file_names)
}

pub(super) fn optimizer(config: &TrainConfig, model: &dyn Model) -> Box<dyn Optimizer> {
    let o = &config.optimizer;
    // Only what trains: a frozen parameter gets no state and no slot.
    let mut params = model.named_parameters();
    params.retain(|(_, p)| p.requires_grad());
    let groups = o.param_groups(params);
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
pub(super) fn plugin_registry(
    config: &TrainConfig,
    options: &RunOptions,
) -> Result<Option<Registry>, TrainError> {
    if config.trackers.is_empty()
        && config.scheduler.is_none()
        && config.checkpoint_hooks.is_empty()
    {
        return Ok(None);
    }
    Registry::discover(&search_path(config, options))
        .map(Some)
        .map_err(plugin_error(config))
}

/// A plugin error of this config's run, naming the config file.
pub(super) fn plugin_error(config: &TrainConfig) -> impl Fn(PluginError) -> TrainError + Copy + '_ {
    |source| TrainError::Plugin {
        path: config.source.clone(),
        source,
    }
}

/// Finds and loads the config's trackers with their options, each logging
/// into `logging_dir/trackers/<name>`: emptied first when the run is
/// `fresh` (the WIT's contract: a tracker tells a new run from a restart or
/// a resume by what its folder holds), kept when it resumes.
pub(super) fn trackers(
    config: &TrainConfig,
    registry: Option<&Registry>,
    logging_dir: &Path,
    fresh: bool,
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
            let manifest = granted_manifest(config, &found.manifest);
            let folder = logging_dir.join("trackers").join(&t.name);
            // Checked before anything is removed: a misspelt option loses nothing.
            manifest.checked_options(&t.options).map_err(plugin_err)?;
            if fresh && folder.exists() {
                std::fs::remove_dir_all(&folder).map_err(io_err(&folder))?;
            }
            load_tracker_with(&manifest, &folder, &t.options).map_err(plugin_err)
        })
        .collect()
}

/// `manifest` with the run config's limits and grants, saying once what a
/// plugin that asks for hosts or environment variables was granted (names
/// only: never a variable's value).
fn granted_manifest(
    config: &TrainConfig,
    manifest: &hearth_plugins::Manifest,
) -> hearth_plugins::Manifest {
    let manifest = config.plugin_manifest(manifest);
    let asks = &manifest.permissions;
    if !asks.network.is_empty() || !asks.env.is_empty() {
        let list = |items: Vec<String>| match items.is_empty() {
            true => "nothing".to_string(),
            false => items.join(", "),
        };
        tracing::info!(
            "plugin {} asks for network [{}] and environment [{}]; granted network: {}; environment: {}",
            manifest.name,
            asks.network.join(", "),
            asks.env.join(", "),
            list(manifest.granted.network.iter().map(|r| r.to_string()).collect()),
            list(manifest.granted.env.clone()),
        );
    }
    manifest
}

/// Loads the config's checkpoint hooks with their options, in order.
pub(super) fn checkpoint_hooks(
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
            let manifest = granted_manifest(config, &found.manifest);
            load_checkpoint_hook(&manifest, &h.options_json()).map_err(plugin_err)
        })
        .collect()
}

/// Loads the config's scheduler plugin and creates its schedule.
pub(super) fn scheduler(
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
        &granted_manifest(config, &found.manifest),
        &section.options_json(),
        base_lrs,
        Some(steps),
    )
    .map(Some)
    .map_err(plugin_err)
}

pub(super) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.into(),
        source,
    }
}

pub(super) fn eval_entries(e: &Evaluation) -> hearth_plugins::Entries {
    match *e {
        Evaluation::ExactMatch { accuracy, .. } => {
            vec![("eval/accuracy".into(), Value::Float(accuracy))]
        }
        Evaluation::ValidationLoss { loss, .. } => vec![("eval/loss".into(), Value::Float(loss))],
    }
}
