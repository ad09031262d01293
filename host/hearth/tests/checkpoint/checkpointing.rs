//! `save_state` / `load_state`: a run stopped mid-epoch and resumed from its
//! checkpoint is bit-identical to one that never stopped; numbered
//! checkpoints rotate; a checkpoint is never overwritten; incomplete ones
//! are skipped. What fails (a save, a load, a rotation) and what it
//! leaves is in `failures`.

mod failures;

use common::scratch;
use hearth::accelerator::{
    AcceleratedOptimizer, AcceleratedScheduler, Accelerator, Checkpointable, LrSchedule,
    PreparedDataLoader, ProjectConfiguration,
};
use hearth::checkpoint::{CheckpointError, MANIFEST_NAME};
use hearth::data::{DataLoader, MapStyle};
use hearth::ops::AdamHyper;
use hearth::optim::Adam;
use hearth::plugins::PluginError;
use hearth_testkit as common;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};

/// The tests seed libtorch's global generator: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// `1 - step / 40`, as PyTorch's LambdaLR would give.
struct Decay;
impl LrSchedule for Decay {
    fn lrs(&mut self, step: u64) -> Result<Vec<f64>, PluginError> {
        let f = 1.0 - step as f64 / 40.0;
        Ok(vec![1e-2 * f, 3e-3 * f])
    }
}

/// A registered object: counts the batches it saw.
struct Counter(u64);
impl Checkpointable for Counter {
    fn state_dict(&self) -> Vec<u8> {
        self.0.to_le_bytes().to_vec()
    }
    fn load_state_dict(&mut self, state: &[u8]) -> Result<(), String> {
        self.0 = u64::from_le_bytes(state.try_into().map_err(|_| "8 bytes expected")?);
        Ok(())
    }
}

type Loader = PreparedDataLoader<MapStyle<Vec<(Tensor, Tensor)>>>;

struct Run {
    acc: Accelerator,
    net: nn::Sequential,
    vs: nn::VarStore,
    opt: AcceleratedOptimizer,
    sched: AcceleratedScheduler,
    loader: Loader,
    counter: Arc<Mutex<Counter>>,
}

/// A fresh run; `init` seeds the weights (a resumed run starts from other
/// weights to prove they come from the checkpoint).
fn setup(project: &Path, init: i64) -> Run {
    setup_with(project, init, false)
}

fn setup_with(project: &Path, init: i64, async_save: bool) -> Run {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(2)
        .project_config(ProjectConfiguration {
            project_dir: project.into(),
            automatic_checkpoint_naming: true,
            async_save,
            ..Default::default()
        })
        .build()
        .unwrap();
    tch::manual_seed(1000);
    let xs = Tensor::randn([20, 3], (Kind::Float, Device::Cpu));
    let ys = xs.sum_dim_intlist(1, true, Kind::Float).sin();
    let data: Vec<(Tensor, Tensor)> = (0..20).map(|i| (xs.get(i), ys.get(i))).collect();
    tch::manual_seed(init);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = nn::seq()
        .add(nn::linear(vs.root() / "0", 3, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs.root() / "2", 16, 1, Default::default()));
    let named = hearth::models::sorted_variables(&vs);
    let opt = Adam::new(
        hearth::optim::no_decay_groups(named, &["bias"]),
        AdamHyper::adamw(1e-2),
    );
    let schedule: Box<dyn LrSchedule> = Box::new(Decay);
    let (vs, opt, loader, sched) = acc
        .prepare((vs, opt, DataLoader::new(data, 4).shuffle(9), schedule))
        .unwrap();
    let counter = Arc::new(Mutex::new(Counter(0)));
    acc.register_for_checkpointing(counter.clone());
    // The training's own randomness starts from the same place in every run.
    acc.set_seed(77, false, false);
    Run {
        acc,
        net,
        vs,
        opt,
        sched,
        loader,
        counter,
    }
}

/// Trains until `epochs` epochs are done, or until `stop_after` optimizer
/// steps; returns the loss bits of every micro-batch.
fn train(run: &mut Run, epochs: u64, stop_after: Option<usize>) -> Vec<u32> {
    let mut losses = Vec::new();
    let mut steps = 0;
    while run.loader.state().epoch < epochs {
        for (x, y) in run.loader.iter() {
            let Run {
                acc,
                net,
                opt,
                sched,
                counter,
                ..
            } = run;
            let loss = acc.accumulate(|| {
                // Noise from the global generator: resuming must restore it.
                let noisy = &x + Tensor::randn_like(&x) * 0.01;
                let loss = net.forward(&noisy).mse_loss(&y, Reduction::Mean);
                acc.backward(&loss).unwrap();
                acc.clip_grad_norm_(opt, 1.0, 2.0).unwrap();
                opt.step().unwrap();
                sched.step().unwrap();
                opt.zero_grad();
                f32::try_from(&loss).unwrap().to_bits()
            });
            counter.lock().unwrap().0 += 1;
            losses.push(loss);
            if acc.sync_gradients() {
                steps += 1;
                if Some(steps) == stop_after {
                    return losses;
                }
            }
        }
    }
    losses
}

fn weights(run: &Run) -> Vec<Tensor> {
    hearth::models::sorted_variables(&run.vs)
        .into_iter()
        .map(|(_, t)| t.copy())
        .collect()
}

#[test]
fn a_run_stopped_mid_epoch_and_resumed_is_bit_identical() {
    let _serial = serial();
    let dir = scratch("resume");
    let mut whole = setup(&dir.join("a"), 1);
    let expected = train(&mut whole, 4, None);

    // Epoch 0 has 5 micro-batches (syncs after the 2nd, 4th and 5th); stop
    // after 4 optimizer steps: inside epoch 1, after its 2nd batch.
    let mut first = setup(&dir.join("b"), 1);
    let mut seen = train(&mut first, 4, Some(4));
    assert_eq!(first.loader.state().epoch, 1, "stopped mid-epoch");
    let saved = first.acc.save_state(None).unwrap();
    assert!(saved.ends_with("checkpoints/checkpoint_0"));
    drop(first);

    let mut resumed = setup(&dir.join("b"), 2);
    assert_ne!(weights(&resumed)[0].sum(Kind::Float).double_value(&[]), 0.0);
    let loaded = resumed.acc.load_state(None).unwrap();
    assert_eq!(loaded, saved);
    assert_eq!(
        resumed.acc.project_configuration().iteration,
        1,
        "the count goes on after the checkpoint"
    );
    assert_eq!(resumed.counter.lock().unwrap().0, seen.len() as u64);
    seen.extend(train(&mut resumed, 4, None));

    assert_eq!(seen, expected, "loss bits per micro-batch");
    for (a, b) in weights(&whole).iter().zip(weights(&resumed)) {
        assert!(a.equal(&b), "final weights differ");
    }
    assert_eq!(whole.opt.lrs(), resumed.opt.lrs());
}

#[test]
fn total_limit_keeps_the_newest_and_a_checkpoint_is_never_overwritten() {
    let _serial = serial();
    let dir = scratch("rotate");
    let mut acc = Accelerator::builder()
        .cpu(true)
        .project_config(ProjectConfiguration {
            project_dir: dir.to_path_buf(),
            automatic_checkpoint_naming: true,
            total_limit: Some(2),
            ..Default::default()
        })
        .build()
        .unwrap();
    for _ in 0..11 {
        acc.save_state(None).unwrap();
    }
    let mut left: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["checkpoint_10", "checkpoint_9"]);

    let manifest =
        std::fs::read(dir.join("checkpoints/checkpoint_10").join(MANIFEST_NAME)).unwrap();
    let err = acc
        .save_state(Some(&dir.join("checkpoints/checkpoint_10")))
        .unwrap_err();
    assert!(matches!(err, CheckpointError::Exists(_)), "{err}");
    assert_eq!(
        std::fs::read(dir.join("checkpoints/checkpoint_10").join(MANIFEST_NAME)).unwrap(),
        manifest
    );

    // A newer but incomplete checkpoint (no manifest, as after a crash) is
    // skipped; the newest complete one loads and the count follows it.
    std::fs::create_dir_all(dir.join("checkpoints/checkpoint_11")).unwrap();
    std::fs::write(
        dir.join("checkpoints/checkpoint_11/trainer_state.json"),
        "{",
    )
    .unwrap();
    let mut fresh = Accelerator::builder()
        .cpu(true)
        .project_config(ProjectConfiguration {
            project_dir: dir.to_path_buf(),
            automatic_checkpoint_naming: true,
            ..Default::default()
        })
        .build()
        .unwrap();
    let loaded = fresh.load_state(None).unwrap();
    assert!(loaded.ends_with("checkpoint_10"));
    assert_eq!(fresh.project_configuration().iteration, 11);
    let err = fresh
        .load_state(Some(&dir.join("checkpoints/checkpoint_11")))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("checkpoint_11") && err.contains(MANIFEST_NAME),
        "{err}"
    );

    // A file cut short after the commit makes the checkpoint incomplete.
    let rng = dir.join("checkpoints/checkpoint_10/random_states_0.safetensors");
    let bytes = std::fs::read(&rng).unwrap();
    std::fs::write(&rng, &bytes[..bytes.len() / 2]).unwrap();
    let err = fresh
        .load_state(Some(&dir.join("checkpoints/checkpoint_10")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("random_states_0.safetensors"), "{err}");
    assert!(fresh.load_state(None).unwrap().ends_with("checkpoint_9"));
    let no_tmp = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-"));
    assert!(no_tmp, "no temporary folder is left behind");
}

/// A second async save copies into the first one's buffers (see
/// `checkpointing/buffers.rs`): it too holds the state of its own moment.
#[test]
fn an_async_save_holds_the_state_of_its_moment_and_matches_a_sync_save() {
    let _serial = serial();
    let dir = scratch("async");
    // One after the other: both draw noise from the global generator.
    let mut sync = setup_with(&dir.join("sync"), 1, false);
    train(&mut sync, 1, None);
    let a = sync.acc.save_state(None).unwrap();
    train(&mut sync, 2, None);
    let a2 = sync.acc.save_state(None).unwrap();
    let mut background = setup_with(&dir.join("async"), 1, true);
    train(&mut background, 1, None);
    let at_save = weights(&background);
    let b = background.acc.save_state(None).unwrap();
    // Training goes on at once and changes the weights in place…
    train(&mut background, 2, None);
    assert!(!at_save[0].equal(&weights(&background)[0]));
    background.acc.wait_for_checkpoint().unwrap();
    let b2 = background.acc.save_state(None).unwrap();
    train(&mut background, 1, None);
    background.acc.wait_for_checkpoint().unwrap();
    // …but each checkpoint holds the state of its moment, file for file.
    for (a, b) in [(a, b), (a2, b2)] {
        same_files(&a, &b);
    }
}

fn same_files(a: &Path, b: &Path) {
    for name in [
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "scheduler.json",
        "dataloader.json",
        "random_states_0.safetensors",
        "custom_checkpoint_0.bin",
        "trainer_state.json",
    ] {
        assert_eq!(
            std::fs::read(a.join(name)).unwrap(),
            std::fs::read(b.join(name)).unwrap(),
            "{} and {}: {name}",
            a.display(),
            b.display()
        );
    }
}

#[test]
fn trackers_log_into_the_project_folder_unless_a_logging_dir_is_given() {
    let mut project = ProjectConfiguration {
        project_dir: "runs/a".into(),
        ..Default::default()
    };
    assert_eq!(project.logging_dir(), Path::new("runs/a"));
    project.logging_dir = Some("logs/a".into());
    assert_eq!(project.logging_dir(), Path::new("logs/a"));
    assert_eq!(project.checkpoints_dir(), Path::new("runs/a/checkpoints"));
}

/// Rust save and load pre-hooks against Accelerate's run live
/// (`tests/oracles/accelerate_state_pre_hooks.py`): the same two models and
/// hooks give the same model files, the same weights in
/// `model.safetensors`, the same model restored, and nothing of the hooks
/// once their handles are removed (here one by `remove`, one by drop).
#[test]
fn save_and_load_pre_hooks_do_what_accelerates_do() {
    let _serial = serial();
    let dir = scratch("pre-hooks");
    let oracle: serde_json::Value = serde_json::from_str(
        common::oracle(
            "accelerate_state_pre_hooks.py",
            &[dir.join("accelerate").to_str().unwrap()],
        )
        .trim(),
    )
    .unwrap();

    let mut acc = Accelerator::builder().cpu(true).build().unwrap();
    tch::manual_seed(0);
    let (va, vb) = (
        nn::VarStore::new(Device::Cpu),
        nn::VarStore::new(Device::Cpu),
    );
    let _a = nn::linear(va.root(), 3, 4, Default::default());
    let _b = nn::linear(vb.root(), 4, 2, Default::default());
    let va = acc.prepare(va).unwrap();
    let vb = acc.prepare(vb).unwrap();
    let save_handle = acc.register_save_state_pre_hook(|weights, folder| {
        std::fs::write(folder.join("hook.txt"), "written by the save hook").unwrap();
        weights.remove(0);
    });
    let load_handle = acc.register_load_state_pre_hook(|models, _| {
        models.remove(0);
    });
    let listed = |folder: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(folder)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("model") || n == "hook.txt")
            .collect();
        names.sort();
        names
    };
    let first = acc.save_state(Some(&dir.join("first"))).unwrap();
    let keys: serde_json::Map<String, serde_json::Value> =
        Tensor::read_safetensors(first.join("model.safetensors"))
            .unwrap()
            .into_iter()
            .map(|(name, t)| (name, serde_json::json!(t.size())))
            .collect();
    let values = |vs: &nn::VarStore| -> Vec<Tensor> {
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|x, y| x.0.cmp(&y.0));
        named.into_iter().map(|(_, t)| t.copy()).collect()
    };
    let saved = [values(&va), values(&vb)];
    tch::no_grad(|| {
        for vs in [&va, &vb] {
            for mut t in vs.trainable_variables() {
                let _ = t.f_add_scalar_(1.0).unwrap();
            }
        }
    });
    acc.load_state(Some(&first)).unwrap();
    let restored: Vec<bool> = [&va, &vb]
        .iter()
        .zip(&saved)
        .map(|(vs, before)| values(vs).iter().zip(before).all(|(x, y)| x.equal(y)))
        .collect();
    save_handle.remove();
    drop(load_handle);
    let second = acc.save_state(Some(&dir.join("second"))).unwrap();
    let ours = serde_json::json!({
        "files": listed(&first),
        "model_keys": keys,
        "restored": restored,
        "files_after_remove": listed(&second),
    });
    assert_eq!(ours, oracle);
}
