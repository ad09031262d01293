//! The bodies of the fuzz targets in `fuzz/` (libFuzzer through cargo-fuzz)
//! and of `tests/corpus.rs` beside it, which replays their checked-in corpus.
//!
//! Each `pub fn <target>(data: &[u8])` runs arbitrary bytes through a real
//! entry of hearth that reads untrusted input — most write the bytes to a
//! scratch file and call the function `hearth` itself calls with that file —
//! and ignores every `Err`: a panic, an abort, a hang or a runaway
//! allocation is the bug being looked for. None of them panics by itself,
//! but for [`store_protocol`]'s check that the store still answers.
//!
//! Inputs made of several files separate them with [`SEP`].
//!
//! Scratch files live in `/dev/shm/hearth-fuzz-<pid>/` (a memory
//! filesystem, so the fsyncs of checkpoint writes cost nothing), else in
//! the temporary folder; one folder per process, reused by every input
//! (the next process removes those of processes that have ended).

use hearth::accelerator::{
    AcceleratedOptimizer, AcceleratedScheduler, Accelerator, Checkpointable, LrSchedule,
    PreparedDataLoader,
};
use hearth::checkpoint as ck;
use hearth::data::{DataLoader, MapStyle};
use hearth::models::ModuleTree;
use hearth::optim::{Adam, ParamGroup};
use hearth_plugins::{self as plugins, PluginError, PluginSource, SearchPath};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};

/// Between the files of a multi-file input.
pub const SEP: &[u8] = b"\n--8<--\n";

/// This process's scratch folder.
fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        // Those of processes gone (a fuzzer or test run ended) go first.
        for entry in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let gone = name
                .strip_prefix("hearth-fuzz-")
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
            if gone {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = base.join(format!("hearth-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the scratch folder can be created");
        dir
    })
}

/// `scratch/name`, emptied.
fn fresh(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch folder can be created");
    dir
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("a scratch file can be written");
}

/// `data` cut at each [`SEP`], at most `max` parts (the last keeps the rest).
pub fn split(data: &[u8], max: usize) -> Vec<&[u8]> {
    let mut parts = Vec::new();
    let mut rest = data;
    while parts.len() + 1 < max {
        match rest.windows(SEP.len()).position(|w| w == SEP) {
            Some(i) => {
                parts.push(&rest[..i]);
                rest = &rest[i + SEP.len()..];
            }
            None => break,
        }
    }
    parts.push(rest);
    parts
}

/// A small float tensor with fixed values.
fn values(shape: &[i64], kind: Kind) -> Tensor {
    let n: i64 = shape.iter().product();
    Tensor::arange(n, (Kind::Float, Device::Cpu))
        .to_kind(kind)
        .reshape(shape)
}

/// The model the weight-file targets load into: names, shapes and dtypes
/// the seeds use (`a` f32 [2, 3], `b` i64 [4], `c` bf16 [3], `d` f16 []).
fn weights_model() -> Vec<(String, Tensor)> {
    vec![
        ("a".into(), values(&[2, 3], Kind::Float)),
        ("b".into(), values(&[4], Kind::Int64)),
        ("c".into(), values(&[3], Kind::BFloat16)),
        ("d".into(), values(&[], Kind::Half)),
    ]
}

// ---------------------------------------------------------------- run config

/// `hearth run CONFIG`: the TOML config read and validated
/// ([`hearth::train::TrainConfig::from_file`]), then every accessor the run
/// reads it through (defaults, durations, FSDP settings, plugin options
/// as JSON, the flat entries trackers get).
pub fn run_config(data: &[u8]) {
    use hearth::train::config::Invalid;
    use hearth::train::TrainConfig;
    let dir = fresh("run_config");
    let path = dir.join("job.toml");
    write(&path, data);
    let _ = hearth::train::flatten_toml(&String::from_utf8_lossy(data));
    let Ok(c) = TrainConfig::from_file(&path) else {
        return;
    };
    let _ = c.entries();
    let _ = c.resolve(Path::new("data.txt"));
    let _ = c.run.max_shard_size();
    let _ = (c.optimizer.lr(), c.optimizer.weight_decay());
    let _ = (c.optimizer.betas(), c.optimizer.eps());
    let named = weights_model()
        .into_iter()
        .map(|(n, t)| (format!("{n}.bias"), t))
        .collect();
    let _ = c.optimizer.param_groups(named);
    let _ = (c.data.digits(), c.data.seq_len(), c.data.vocab_size());
    let _ = (c.model.context(), c.model.hidden());
    let _ = (c.distributed.ddp(), c.distributed.timeout());
    if let Some(s) = &c.scheduler {
        let _ = s.options_json();
    }
    for h in &c.checkpoint_hooks {
        let _ = h.options_json();
    }
    if let Some(f) = &c.fsdp {
        let invalid: &Invalid = &|key: &str, message: String| c.invalid(key, message);
        let _ = f.plugin(invalid);
    }
    let _ = c.fsdp_settings();
}

// ----------------------------------------------------------- plugin manifest

/// `plugin.toml`: a manifest read ([`plugins::Manifest::read`]), found on
/// a search path beside a real plugin ([`plugins::Registry::discover`]),
/// and — when it names one of the fuzz plugins' components, which lie in
/// its folder — checked as `hearth plugins check` does (compiled,
/// world and version checked, instantiated; declared options checked and
/// a scheduler's `[presets]` merged with a user's).
pub fn plugin_manifest(data: &[u8]) {
    let root = scratch().join("plugin_manifest");
    let dir = root.join("fuzzed");
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir).expect("a scratch folder can be created");
        if let Some(built) = fuzz_plugins() {
            for (file, name) in FUZZ_PLUGINS {
                if let Ok(bytes) = std::fs::read(built.join(file)) {
                    write(&dir.join(format!("{name}.wasm")), &bytes);
                }
            }
        }
        let other = root.join("other");
        std::fs::create_dir_all(&other).expect("a scratch folder can be created");
        write(
            &other.join("plugin.toml"),
            b"name = \"jsonl\"\nversion = \"0.1.0\"\nkind = \"tracker\"\n\
              world = \"hearth:plugin/tracker-plugin@0.3.0\"\ncomponent = \"jsonl.wasm\"\n",
        );
    }
    write(&dir.join("plugin.toml"), data);
    let Ok(m) = plugins::Manifest::read(&dir) else {
        return;
    };
    let _ = (m.component_path(), m.world_version());
    let _ = (m.limits.memory_bytes(), m.limits.call_timeout());
    if let Ok(registry) =
        plugins::Registry::discover(&SearchPath::only([(PluginSource::Flag, root.clone())]))
    {
        let _ = registry.find(&m.name);
        let _ = registry.find("jsonl");
    }
    let ours = FUZZ_PLUGINS
        .iter()
        .any(|(_, name)| m.component == Path::new(&format!("{name}.wasm")));
    if ours && m.component_path().is_file() {
        let _ = plugins::check_plugin(&m);
        if m.kind == plugins::PluginKind::Scheduler {
            let _ = plugins::load_scheduler(&m, "{\"warmup\":1}", &[1e-3], Some(10));
        }
    }
}

// ------------------------------------------------------------- safetensors

/// A safetensors file (header and tensors) through every reader:
/// `hearth checkpoint inspect`/`verify` ([`ck::tensor_infos`]),
/// [`ck::load_safetensors`], [`ck::read_safetensor`], and loading it into
/// a model ([`ck::stage_checkpoint_in_model`], strict and not, by file and
/// by folder).
pub fn safetensors_file(data: &[u8]) {
    let dir = fresh("safetensors_file");
    let path = dir.join(ck::SAFE_WEIGHTS_NAME);
    write(&path, data);
    let _ = ck::tensor_infos(&path, false);
    let _ = ck::tensor_infos(&path, true);
    if let Ok(all) = ck::load_safetensors(&path, Device::Cpu) {
        if let Some((name, _)) = all.first() {
            let _ = ck::read_safetensor(&path, name);
        }
    }
    let _ = ck::read_safetensor(&path, "a");
    let model = weights_model();
    let _ = ck::stage_checkpoint_in_model(&model, &path, true);
    let _ = ck::load_checkpoint_in_model(&model, &dir, false);
}

// ------------------------------------------------------------ the HF index

/// `model.safetensors.index.json` beside two real shards (`a`, `b` in the
/// first; `c`, `d` in the second), loaded into a model through the index
/// file and through the folder ([`ck::load_checkpoint_in_model`], which
/// reads it with `weight_files`).
pub fn hf_index(data: &[u8]) {
    let dir = scratch().join("hf_index");
    let index = dir.join(ck::SAFE_WEIGHTS_INDEX_NAME);
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir).expect("a scratch folder can be created");
        let model = weights_model();
        let (first, second) = model.split_at(2);
        let save = |name: &str, part: &[(String, Tensor)]| {
            ck::save_safetensors(&dir.join(name), part).expect("a shard can be written")
        };
        save("model-00001-of-00002.safetensors", first);
        save("model-00002-of-00002.safetensors", second);
    }
    write(&index, data);
    let model = weights_model();
    let _ = ck::stage_checkpoint_in_model(&model, &index, true);
    let _ = ck::load_checkpoint_in_model(&model, &dir, false);
    let _ = ck::parse_size(&String::from_utf8_lossy(data));
}

// ---------------------------------------------------------- checkpoints

/// A tiny training setup whose checkpoints the checkpoint targets read:
/// Linear(3,4) + Linear(4,2) under AdamW (two parameter groups), a
/// schedule, a shuffled loader, a registered object, fp16 loss scaling on
/// the CPU (so `scaler.json` is written and read), two accumulation steps.
struct Run {
    acc: Accelerator,
    net: nn::Sequential,
    _vs: nn::VarStore,
    opt: AcceleratedOptimizer,
    sched: AcceleratedScheduler,
    loader: PreparedDataLoader<MapStyle<Vec<(Tensor, Tensor)>>>,
}

/// Each group's base rate over `1 + step / 1000`: valid at every step
/// (as the built-in constant schedule), so any saved step count loads.
struct Decay;
impl LrSchedule for Decay {
    fn lrs(&mut self, step: u64) -> Result<Vec<f64>, PluginError> {
        let f = 1.0 / (1.0 + step as f64 / 1000.0);
        Ok(vec![1e-2 * f, 3e-3 * f])
    }
    fn save(&mut self) -> Result<Vec<u8>, PluginError> {
        Ok(b"decay".to_vec())
    }
    fn load(&mut self, state: &[u8]) -> Result<(), PluginError> {
        match state {
            b"decay" => Ok(()),
            _ => Err(PluginError::Runtime {
                name: "decay".into(),
                message: "not my state".into(),
            }),
        }
    }
}

/// A registered object: 8 bytes of state.
struct Counter(u64);
impl Checkpointable for Counter {
    fn state_dict(&self) -> Vec<u8> {
        self.0.to_le_bytes().to_vec()
    }
    fn load_state_dict(&mut self, state: &[u8]) -> Result<(), String> {
        let bytes: [u8; 8] = state.try_into().map_err(|_| "8 bytes expected")?;
        self.0 = u64::from_le_bytes(bytes);
        Ok(())
    }
}

impl Run {
    fn new() -> Self {
        let mut acc = Accelerator::builder()
            .cpu(true)
            .gradient_accumulation_steps(2)
            .mixed_precision(hearth::precision::MixedPrecision::Fp16)
            .cpu_loss_scaling(true)
            .build()
            .expect("a CPU accelerator builds");
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let net = nn::seq()
            .add(nn::linear(vs.root() / "0", 3, 4, Default::default()))
            .add_fn(|x| x.tanh())
            .add(nn::linear(vs.root() / "2", 4, 2, Default::default()));
        let named = hearth::models::sorted_variables(&vs);
        let (bias, weight): (Vec<_>, Vec<_>) =
            named.into_iter().partition(|(n, _)| n.ends_with("bias"));
        let take = |v: Vec<(String, Tensor)>| v.into_iter().map(|(_, t)| t).collect::<Vec<_>>();
        let opt = Adam::new(
            vec![
                ParamGroup::new(take(weight)),
                ParamGroup::new(take(bias)).weight_decay(0.0),
            ],
            hearth_ops::AdamHyper::adamw(1e-2),
        );
        let xs = values(&[10, 3], Kind::Float) / 10.0;
        let data: Vec<(Tensor, Tensor)> = (0..10).map(|i| (xs.get(i), xs.get(i).sin())).collect();
        let schedule: Box<dyn LrSchedule> = Box::new(Decay);
        let (vs, opt, loader, sched) = acc
            .prepare((vs, opt, DataLoader::new(data, 3).shuffle(5), schedule))
            .expect("the tiny run prepares");
        acc.register_for_checkpointing(Arc::new(Mutex::new(Counter(3))));
        Self {
            acc,
            net,
            _vs: vs,
            opt,
            sched,
            loader,
        }
    }

    /// One micro-batch of training, as a resumed run goes on.
    fn train_step(&mut self) {
        let Some((x, y)) = self.loader.iter().next() else {
            return;
        };
        let Run {
            acc,
            net,
            opt,
            sched,
            ..
        } = self;
        acc.accumulate(|| {
            let loss = net
                .forward(&x)
                .mse_loss(&y.narrow(1, 0, 2), Reduction::Mean);
            if acc.backward(&loss).is_ok() {
                let _ = opt.step();
                let _ = sched.step();
            }
            opt.zero_grad();
        });
    }
}

/// A complete checkpoint of [`Run`] after two micro-batches (written once
/// per process).
fn template_checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch().join("template").join("checkpoint_0");
        let mut run = Run::new();
        run.train_step();
        run.train_step();
        run.acc
            .save_state(Some(&dir))
            .expect("the template checkpoint saves");
        dir
    })
}

/// `dir` made a copy of the template checkpoint.
fn copy_template(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("a scratch folder can be created");
    for entry in std::fs::read_dir(template_checkpoint()).expect("the template is there") {
        let entry = entry.expect("the template is readable");
        // Not `fs::copy`: libFuzzer's timer signal can interrupt its
        // copy_file_range, which std does not retry; read and write do.
        let bytes = std::fs::read(entry.path()).expect("the template is readable");
        write(&dir.join(entry.file_name()), &bytes);
    }
}

/// Loads `dir` into a fresh [`Run`] and, when it loads, trains on and
/// saves again (what a resumed run does next).
fn resume_from(dir: &Path) {
    let mut run = Run::new();
    if run.acc.load_state(Some(dir)).is_ok() {
        run.train_step();
        run.train_step();
        let again = dir.with_extension("again");
        let _ = std::fs::remove_dir_all(&again);
        let _ = run.acc.save_state(Some(&again));
    }
}

/// `hearth_checkpoint.json` of a real checkpoint: checked
/// ([`ck::verify_complete`]), described and verified as `hearth
/// checkpoint inspect`/`verify` do, looked for among numbered checkpoints
/// ([`ck::newest_complete`]), and loaded ([`Accelerator::load_state`],
/// whose hook records it reads).
pub fn checkpoint_manifest(data: &[u8]) {
    let parent = fresh("checkpoint_manifest");
    let dir = parent.join("checkpoint_0");
    copy_template(&dir);
    write(&dir.join(ck::MANIFEST_NAME), data);
    let _ = ck::verify_complete(&dir);
    let _ = ck::describe_checkpoint(&dir, false);
    let _ = ck::verify_checkpoint(&dir);
    let _ = ck::newest_complete(&parent);
    resume_from(&dir);
}

/// The files of a checkpoint a load reads besides the manifest, from the
/// input's parts in this order (fewer parts keep the rest from the
/// template); the manifest is then rewritten to match, so each reaches
/// [`Accelerator::load_state`], which reads and checks them all, applies
/// them, and the run trains on and saves again.
pub const STATE_FILES: [&str; 8] = [
    "trainer_state.json",
    "optimizer.json",
    "scheduler.json",
    "dataloader.json",
    "scaler.json",
    "optimizer.safetensors",
    "random_states_0.safetensors",
    "custom_checkpoint_0.bin",
];

/// See [`STATE_FILES`].
pub fn checkpoint_state(data: &[u8]) {
    let parent = fresh("checkpoint_state");
    let dir = parent.join("checkpoint_0");
    copy_template(&dir);
    for (name, part) in STATE_FILES.iter().zip(split(data, STATE_FILES.len())) {
        write(&dir.join(name), part);
    }
    // The manifest of what is there now.
    let mut manifest: ck::Manifest =
        serde_json::from_slice(&std::fs::read(dir.join(ck::MANIFEST_NAME)).expect("manifest"))
            .expect("the template's manifest parses");
    for f in &mut manifest.files {
        f.size = std::fs::metadata(dir.join(&f.name)).map_or(0, |m| m.len());
    }
    let text = serde_json::to_vec(&manifest).expect("a manifest serialises");
    write(&dir.join(ck::MANIFEST_NAME), &text);
    resume_from(&dir);
}

// -------------------------------------------------------- sharded checkpoints

/// A folder of sharded checkpoint files (FSDP's SHARDED_STATE_DICT, one
/// safetensors file per process with `DCP_SHARDING_INFO` offsets), one file
/// per part of the input: opened ([`ck::ShardedTensors::open`]) and every
/// tensor read whole and by rows, as `hearth checkpoint merge` and a
/// sharded `load_state` do.
pub fn sharded_index(data: &[u8]) {
    let dir = fresh("sharded_index");
    let parts = split(data, 4);
    for (rank, part) in parts.iter().enumerate() {
        write(&dir.join(ck::shard_file_name(rank)), part);
    }
    let Ok(shards) = ck::ShardedTensors::open(&dir) else {
        return;
    };
    let names: Vec<String> = shards.names().map(str::to_string).collect();
    for name in &names {
        let Some((whole, _)) = shards.shape(name) else {
            continue;
        };
        let whole = whole.to_vec();
        let _ = shards.read(name);
        if let Some(&rows) = whole.first() {
            let _ = shards.read_rows(name, 0, rows.min(1));
            let _ = shards.read_rows(name, rows / 2, rows - rows / 2);
        }
    }
}

// --------------------------------------------------- values plugins return

/// The fuzz plugins' components, as built in `fuzz/target/plugins-build`,
/// and the names the targets install them under.
const FUZZ_PLUGINS: [(&str, &str); 3] = [
    ("fuzz_scheduler.wasm", "scheduler"),
    ("fuzz_wrap_policy.wasm", "wrap-policy"),
    ("fuzz_hook.wasm", "hook"),
];

/// The folder holding the fuzz plugins' components, built on first use
/// (`cargo build` in `fuzz/plugins`) when not there; `None` if that fails.
fn fuzz_plugins() -> Option<&'static Path> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
            let out = fuzz.join("target/plugins-build/wasm32-wasip2/release");
            let missing = || FUZZ_PLUGINS.iter().any(|(f, _)| !out.join(f).is_file());
            if missing() {
                let status = std::process::Command::new("cargo")
                    .args(["build", "--release", "--quiet"])
                    .current_dir(fuzz.join("plugins"))
                    .env_remove("RUSTFLAGS")
                    .env_remove("CARGO_BUILD_RUSTFLAGS")
                    .env_remove("CARGO_ENCODED_RUSTFLAGS")
                    .env_remove("CARGO_TARGET_DIR")
                    .status();
                if !status.is_ok_and(|s| s.success()) || missing() {
                    eprintln!("hearth-fuzz-entry: building fuzz/plugins failed");
                    return None;
                }
            }
            Some(out)
        })
        .as_deref()
}

/// The fuzz plugin `name` installed with a manifest of `kind`, read back.
fn fuzz_manifest(name: &str, kind: &str, world: &str) -> Option<plugins::Manifest> {
    let built = fuzz_plugins()?;
    let file = FUZZ_PLUGINS.iter().find(|(_, n)| *n == name)?.0;
    let dir = scratch().join("plugins").join(name);
    std::fs::create_dir_all(&dir).ok()?;
    std::fs::write(
        dir.join("plugin.wasm"),
        std::fs::read(built.join(file)).ok()?,
    )
    .ok()?;
    let text = format!(
        "name = \"fuzz-{name}\"\nversion = \"0.1.0\"\nkind = \"{kind}\"\n\
         world = \"hearth:plugin/{world}@0.3.0\"\ncomponent = \"plugin.wasm\"\n\
         [limits]\nmemory-mb = 16\ncall-timeout-ms = 2000\n"
    );
    write(&dir.join("plugin.toml"), text.as_bytes());
    plugins::Manifest::read(&dir).ok()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What plugins hand back through WIT, checked by the host: the first
/// byte picks the plugin, the rest is the script its answers come from
/// (see `fuzz/plugins`).
///
/// - 0, scheduler: created ([`plugins::load_scheduler`], options with the
///   script) and prepared with an optimizer of two groups, then stepped,
///   told a metric, saved and restored — each rate it returns is checked
///   (count, finite, ≥ 0) before an optimizer sees it.
/// - 1, wrap policy ([`plugins::WrapPolicyPlugin::units`]): the paths it
///   names are checked against the model's module tree and made into
///   units ([`hearth::parallel::sharded::assign_except`]).
/// - 2, checkpoint hook, registered with an accelerator: the files it
///   writes into a checkpoint being saved, the tensors it claims and the
///   bytes it restores on load ([`Accelerator::save_state`] then
///   [`Accelerator::load_state`]). Its scripts come through the run's
///   config (`fuzz.save`, `fuzz.seal`, `fuzz.load`, each a third).
pub fn plugin_values(data: &[u8]) {
    let Some((&which, script)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => fuzz_scheduler(script),
        1 => fuzz_wrap_policy(script),
        _ => fuzz_hook(script),
    }
}

fn fuzz_scheduler(script: &[u8]) {
    thread_local! {
        static MANIFEST: Option<plugins::Manifest> =
            fuzz_manifest("scheduler", "scheduler", "scheduler-plugin");
    }
    let Some(manifest) = MANIFEST.with(Clone::clone) else {
        return;
    };
    let options = format!("{{\"script\":\"{}\"}}", hex(script));
    let Ok(plugin) = plugins::load_scheduler(&manifest, &options, &[1e-2, 3e-3], Some(100)) else {
        return;
    };
    let mut acc = Accelerator::builder()
        .cpu(true)
        .build()
        .expect("a CPU accelerator builds");
    let vs = nn::VarStore::new(Device::Cpu);
    let a = vs.root().zeros("a", &[2]);
    let b = vs.root().zeros("b", &[1]);
    let opt = Adam::new(
        vec![
            ParamGroup::new(vec![a.shallow_clone()]),
            ParamGroup::new(vec![b]),
        ],
        hearth_ops::AdamHyper::adamw(1e-2),
    );
    let schedule: Box<dyn LrSchedule> = Box::new(plugin);
    let Ok((mut opt, mut sched)) = acc.prepare((opt, schedule)) else {
        return;
    };
    for _ in 0..3 {
        let loss = (&a * 2.0).sum(Kind::Float);
        if acc.backward(&loss).is_err() || opt.step().is_err() || sched.step().is_err() {
            return;
        }
        opt.zero_grad();
    }
    if sched.observe(0.5).is_err() {
        return;
    }
    if let Ok((steps, state)) = sched.state() {
        let _ = sched.load_state(steps, &state);
    }
}

fn fuzz_wrap_policy(script: &[u8]) {
    thread_local! {
        static POLICY: Option<(plugins::WrapPolicyPlugin, ModuleTree)> = {
            fuzz_manifest("wrap-policy", "wrap-policy", "wrap-policy-plugin").and_then(|m| {
                let policy = plugins::load_wrap_policy(&m).ok()?;
                let vs = nn::VarStore::new(Device::Cpu);
                for name in ["embed.weight", "blocks.0.attn.w", "blocks.0.mlp.w", "blocks.1.attn.w", "head.weight"] {
                    let (path, leaf) = name.rsplit_once('.').unwrap_or(("", name));
                    let node = path.split('.').fold(vs.root(), |p, part| p / part);
                    let _ = node.zeros(leaf, &[2]);
                }
                let variables = hearth::models::sorted_variables(&vs);
                let tree = ModuleTree::from_variables(
                    &variables,
                    "Model",
                    &[("blocks.0", "Block"), ("blocks.1", "Block")],
                );
                Some((policy, tree))
            })
        };
    }
    POLICY.with(|p| {
        let Some((policy, tree)) = p else {
            return;
        };
        let options = format!("{{\"script\":\"{}\"}}", hex(script));
        let modules = hearth::accelerator::policy_modules(tree);
        let Ok(mut units) = policy.units(&options, &modules) else {
            return;
        };
        units.retain(|p| !p.is_empty());
        let _ = hearth::parallel::sharded::assign_except(tree, &units, &[]);
        let _ = hearth::parallel::sharded::assign_except(tree, &units, &["blocks.1".into()]);
    });
}

fn fuzz_hook(script: &[u8]) {
    thread_local! {
        static HOOK: Option<plugins::Manifest> =
            fuzz_manifest("hook", "checkpoint-hook", "checkpoint-plugin");
    }
    let Some(manifest) = HOOK.with(Clone::clone) else {
        return;
    };
    let Ok(hook) = plugins::load_checkpoint_hook(&manifest, "{}") else {
        return;
    };
    let third = script.len().div_ceil(3);
    let mut parts = script.chunks(third.max(1));
    let mut entry = |key: &str| {
        let part = parts.next().unwrap_or_default();
        (key.to_string(), plugins::Value::Text(hex(part)))
    };
    let config = vec![entry("fuzz.save"), entry("fuzz.seal"), entry("fuzz.load")];
    let dir = fresh("plugin_values").join("checkpoint_0");
    let mut run = Run::new();
    run.acc.register_checkpoint_hook(hook);
    run.acc.init_trackers("fuzz", "fuzz", Vec::new(), config);
    run.train_step();
    if run.acc.save_state(Some(&dir)).is_err() {
        return;
    }
    let _ = ck::verify_checkpoint(&dir);
    if run.acc.load_state(Some(&dir)).is_ok() {
        run.train_step();
    }
}

// ------------------------------------------------------------- the store

/// The job token the fuzzed store is served with (the seeds present it).
pub const STORE_TOKEN: &str = "fuzz-job-token";

/// The rendezvous store's server (`hearth launch`'s TCP store, rank 0's
/// [`hearth_comm::TcpStore`] served with [`STORE_TOKEN`], once per
/// process): the input is sent as one client's bytes (its requests, which
/// must start with the token to be answered), the connection is closed,
/// and then the store must still answer a well-behaved client (a set and a
/// get on a fresh connection) — or this panics. The frame decoding is
/// private to `dist/store.rs`, so it is reached over TCP.
pub fn store_protocol(data: &[u8]) {
    use hearth_comm::TcpStore;
    use std::io::{Read, Write};
    use std::net::{Shutdown, TcpStream};
    use std::time::Duration;
    static STORE: OnceLock<Option<(TcpStore, u16)>> = OnceLock::new();
    let served = STORE.get_or_init(|| {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .ok()?
            .port();
        let timeout = Duration::from_secs(5);
        let store = TcpStore::connect("127.0.0.1", port, true, timeout, Some(STORE_TOKEN)).ok()?;
        Some((store, port))
    });
    let Some((_, port)) = served else {
        return;
    };
    if let Ok(mut client) = TcpStream::connect(("127.0.0.1", *port)) {
        let _ = client.set_nodelay(true);
        let _ = client.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = client.write_all(data);
        let _ = client.shutdown(Shutdown::Write);
        // Its answers, until the store closes the connection (it does at
        // the end of the requests) or stops answering (a `get` of a key
        // nobody sets waits).
        let _ = client.set_read_timeout(Some(Duration::from_millis(5)));
        let mut answers = Vec::new();
        let _ = client.read_to_end(&mut answers);
    }
    let probe = TcpStore::connect(
        "127.0.0.1",
        *port,
        false,
        Duration::from_secs(5),
        Some(STORE_TOKEN),
    )
    .and_then(|c| {
        c.set("fuzz/probe", b"alive")?;
        c.get("fuzz/probe")
    });
    assert!(
        matches!(&probe, Ok(v) if v == b"alive"),
        "the store no longer answers a client with the job's token after this input: {probe:?}"
    );
}
