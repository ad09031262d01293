//! Checkpoint hooks (Wasm plugins around save_state / load_state): the two
//! built-in hooks do what they say, checked against libtorch's own rounding
//! and a tampered file; misbehaving hooks (tests/plugins/bad-hook) fail
//! closed, name themselves, never damage the previous checkpoint, and stay
//! inside their folder.

use common::{scratch, Limited};
use hearth_testkit as common;

use hearth::accelerator::{Accelerator, ProjectConfiguration};
use hearth::checkpoint::{load_safetensors, verify_complete, MANIFEST_NAME};
use hearth::ops::AdamHyper;
use hearth::optim::{Adam, ParamGroup};
use hearth::plugins::{load_checkpoint_hook, CheckpointHookPlugin, Manifest};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::nn;
use tch::{Device, Kind, Tensor};

/// A built-in hook (installed by `make plugins`) with `options`.
fn builtin(name: &str, options: &str) -> CheckpointHookPlugin {
    let dir = common::repo_root().join("target/plugins").join(name);
    let manifest =
        Manifest::read(&dir).expect("built-in plugins are installed: run `make plugins`");
    load_checkpoint_hook(&manifest, options).unwrap()
}

/// The bad-hook fixture doing `behaviour`, with `limits` in its manifest.
fn bad_hook(work: &Path, behaviour: &str, limits: &str) -> CheckpointHookPlugin {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let wasm = BUILT.get_or_init(|| {
        let root = common::repo_root();
        // A build from nothing takes longer than a test's usual limit.
        let built = std::process::Command::new("cargo")
            .args(["build", "--release", "--quiet", "-p", "fixture-bad-hook"])
            .current_dir(root.join("tests/plugins"))
            .run_for(common::limit().max(std::time::Duration::from_secs(900)))
            .unwrap();
        assert!(
            built.status.success(),
            "building tests/plugins/bad-hook failed:\n{}",
            String::from_utf8_lossy(&built.stderr)
        );
        root.join("target/test-plugins-build/wasm32-wasip2/release/fixture_bad_hook.wasm")
    });
    let dir = work.join("plugins").join(format!("bad-hook-{behaviour}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(wasm, dir.join("bad-hook.wasm")).unwrap();
    std::fs::write(
        dir.join("plugin.toml"),
        format!(
            "name = \"bad-hook\"\nversion = \"0.1.0\"\nkind = \"checkpoint-hook\"\n\
             world = \"hearth:plugin/checkpoint-plugin@0.3.0\"\ncomponent = \"bad-hook.wasm\"\n{limits}"
        ),
    )
    .unwrap();
    let manifest = Manifest::read(&dir).unwrap();
    load_checkpoint_hook(&manifest, &format!("{{\"do\":\"{behaviour}\"}}")).unwrap()
}

/// An accelerator with Linear(3,16)+Linear(16,1) and AdamW prepared, one
/// optimizer step taken (so the optimizer has state).
fn setup(project: &Path, async_save: bool) -> (Accelerator, nn::VarStore) {
    let mut acc = Accelerator::builder()
        .cpu(true)
        .project_config(ProjectConfiguration {
            project_dir: project.into(),
            automatic_checkpoint_naming: true,
            async_save,
            ..Default::default()
        })
        .build()
        .unwrap();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let l1 = nn::linear(vs.root() / "0", 3, 16, Default::default());
    let l2 = nn::linear(vs.root() / "2", 16, 1, Default::default());
    let params: Vec<Tensor> = hearth::models::sorted_variables(&vs)
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    let opt = Adam::new(vec![ParamGroup::new(params)], AdamHyper::adamw(1e-2));
    let (vs, mut opt) = acc.prepare((vs, opt)).unwrap();
    let x = Tensor::randn([8, 3], (Kind::Float, Device::Cpu));
    let loss = x.apply(&l1).tanh().apply(&l2).square().mean(Kind::Float);
    acc.backward(&loss).unwrap();
    opt.step().unwrap();
    opt.zero_grad();
    (acc, vs)
}

fn weights(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    hearth::models::sorted_variables(vs)
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect()
}

fn zero(vs: &nn::VarStore) {
    tch::no_grad(|| {
        for (_, mut t) in hearth::models::sorted_variables(vs) {
            let _ = t.zero_();
        }
    });
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.kind() == b.kind() && a.equal(b)
}

fn names(dir: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

#[test]
fn reduced_precision_saves_weights_in_bf16_and_restores_them_as_libtorch_rounds() {
    let dir = scratch("reduced");
    let (mut acc, vs) = setup(&dir, false);
    acc.register_checkpoint_hook(builtin("reduced-precision", r#"{"tensors": ["*.weight"]}"#));
    let before = weights(&vs);
    let saved = acc.save_state(None).unwrap();

    // The model file holds the biases only; the hook's file the weights, in BF16.
    let model: Vec<String> = load_safetensors(&saved.join("model.safetensors"), Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(model, ["0.bias", "2.bias"]);
    let reduced =
        load_safetensors(&saved.join("reduced_precision.safetensors"), Device::Cpu).unwrap();
    assert_eq!(
        reduced
            .iter()
            .map(|(n, t)| (n.as_str(), t.kind()))
            .collect::<Vec<_>>(),
        [("0.weight", Kind::BFloat16), ("2.weight", Kind::BFloat16)]
    );
    let manifest = verify_complete(&saved).unwrap();
    assert!(manifest
        .files
        .iter()
        .any(|f| f.name == "reduced_precision.safetensors"));
    assert_eq!(manifest.hooks[0].name, "reduced-precision");
    assert_eq!(manifest.hooks[0].claimed.len(), 2);

    zero(&vs);
    acc.load_state(Some(&saved)).unwrap();
    for ((name, was), (_, now)) in before.iter().zip(weights(&vs)) {
        let expected = if name.ends_with("weight") {
            was.to_kind(Kind::BFloat16).to_kind(Kind::Float)
        } else {
            was.shallow_clone()
        };
        assert!(same(&now, &expected), "{name} after load");
        if name.ends_with("weight") {
            assert!(!same(&now, was), "{name} really went through bf16");
        }
    }
}

#[test]
fn a_checkpoint_whose_tensors_a_hook_saved_needs_that_hook_to_load() {
    let dir = scratch("needs-hook");
    let (mut acc, _) = setup(&dir, false);
    acc.register_checkpoint_hook(builtin("reduced-precision", "{}"));
    let saved = acc.save_state(None).unwrap();
    let (mut plain, vs) = setup(&dir.join("other"), false);
    zero(&vs);
    let err = plain.load_state(Some(&saved)).unwrap_err().to_string();
    assert!(
        err.contains("`reduced-precision`") && err.contains("register"),
        "{err}"
    );
    assert!(weights(&vs)
        .iter()
        .all(|(_, t)| t.abs().sum(Kind::Float).double_value(&[]) == 0.0));
}

#[test]
fn manifest_sha256_refuses_a_changed_byte_and_restores_nothing() {
    let dir = scratch("sha");
    let (mut acc, vs) = setup(&dir, false);
    acc.register_checkpoint_hook(builtin("manifest-sha256", "{}"));
    let saved = acc.save_state(None).unwrap();
    assert!(saved.join("sha256_manifest.json").is_file());
    acc.load_state(None)
        .expect("an untouched checkpoint verifies");

    // Same size, one byte different, and hearth's own manifest rewritten
    // to match (a tamperer, not a failing disk): only the hook's sha256
    // can tell.
    let victim = saved.join("optimizer.safetensors");
    let mut bytes = std::fs::read(&victim).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&victim, &bytes).unwrap();
    let manifest_path = saved.join(hearth::checkpoint::MANIFEST_NAME);
    let untouched_manifest = std::fs::read(&manifest_path).unwrap();
    let mut manifest: hearth::checkpoint::Manifest =
        serde_json::from_slice(&untouched_manifest).unwrap();
    for f in &mut manifest.files {
        if f.name == "optimizer.safetensors" {
            f.xxh3 = Some(hearth::checkpoint::digest::of_bytes(&bytes));
        }
    }
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    zero(&vs);
    let err = acc.load_state(None).unwrap_err();
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(
        chain.contains("`manifest-sha256`") && chain.contains("optimizer.safetensors has sha256"),
        "{chain}"
    );
    assert!(weights(&vs)
        .iter()
        .all(|(_, t)| t.abs().sum(Kind::Float).double_value(&[]) == 0.0));

    // A file added after the save is refused too.
    bytes[last] ^= 0x40;
    std::fs::write(&victim, &bytes).unwrap();
    std::fs::write(&manifest_path, &untouched_manifest).unwrap();
    std::fs::write(saved.join("extra.txt"), "x").unwrap();
    let chain = format!(
        "{:#}",
        anyhow::Error::from(acc.load_state(None).unwrap_err())
    );
    assert!(
        chain.contains("extra.txt is not in the manifest"),
        "{chain}"
    );
}

#[test]
fn a_failing_hook_abandons_the_save_names_itself_and_leaves_the_previous_checkpoint() {
    let dir = scratch("fail-closed");
    let cases = [
        ("save-err", "", "refusing this checkpoint on purpose"),
        ("save-trap", "", "trapped"),
        (
            "seal-spin",
            "[limits]\ncall-timeout-ms = 300\n",
            "call deadline of 300 ms",
        ),
        (
            "save-hog",
            "[limits]\nmemory-mb = 32\n",
            "memory cap of 32 MiB",
        ),
        ("claim-unknown", "", "claimed tensor `no.such.tensor`"),
        (
            "save-squat",
            "",
            "left `model.safetensors`, a name hearth writes itself",
        ),
        (
            "seal-clobber",
            "",
            "changed or removed `trainer_state.json`",
        ),
    ];
    for (behaviour, limits, expected) in cases {
        let project = dir.join(behaviour);
        let (mut acc, _) = setup(&project, false);
        let good = acc.save_state(None).unwrap();
        acc.register_checkpoint_hook(bad_hook(&dir, behaviour, limits));
        let err = acc.save_state(None).unwrap_err();
        let chain = format!("{:#}", anyhow::Error::from(err));
        assert!(
            chain.contains("hook `bad-hook`") && chain.contains(expected),
            "{behaviour}: {chain}"
        );
        assert_eq!(
            names(&project.join("checkpoints")),
            ["checkpoint_0"],
            "{behaviour}"
        );
        verify_complete(&good).unwrap();
        assert_eq!(acc.load_state(None).unwrap(), good, "{behaviour}");
    }
}

#[test]
fn a_failing_hook_in_a_background_save_is_reported_by_the_next_call() {
    let dir = scratch("fail-async");
    let (mut acc, _) = setup(&dir, true);
    acc.save_state(None).unwrap();
    acc.wait_for_checkpoint().unwrap();
    acc.register_checkpoint_hook(bad_hook(&dir, "save-err", ""));
    acc.save_state(None)
        .expect("returns once the state is copied");
    let chain = format!(
        "{:#}",
        anyhow::Error::from(acc.wait_for_checkpoint().unwrap_err())
    );
    assert!(
        chain.contains("hook `bad-hook`") && chain.contains("on purpose"),
        "{chain}"
    );
    assert_eq!(names(&dir.join("checkpoints")), ["checkpoint_0"]);
}

#[test]
fn two_hooks_claiming_one_tensor_are_refused_naming_both() {
    let dir = scratch("double-claim");
    let (mut acc, _) = setup(&dir, false);
    acc.register_checkpoint_hook(builtin("reduced-precision", "{}"));
    acc.register_checkpoint_hook(bad_hook(&dir, "claim-first", ""));
    let err = acc.save_state(None).unwrap_err().to_string();
    assert!(
        err.contains("`reduced-precision` and `bad-hook` both claimed tensor `0.bias`"),
        "{err}"
    );
    assert!(!dir.join("checkpoints/checkpoint_0").exists());
}

#[test]
fn a_hook_restores_what_it_claimed_and_nothing_else_or_the_load_fails() {
    let dir = scratch("restore");
    for (behaviour, expected) in [
        ("claim-first", None),
        ("load-err", Some("refusing this load on purpose")),
        (
            "load-partial",
            Some("restored 32 of the 64 bytes of tensor `0.bias` of model 0"),
        ),
        ("load-unclaimed", Some("was not claimed by this hook")),
    ] {
        let project = dir.join(behaviour);
        let (mut acc, vs) = setup(&project, false);
        acc.register_checkpoint_hook(bad_hook(&dir, behaviour, ""));
        let saved = acc.save_state(None).unwrap();
        let before = weights(&vs);
        let model: Vec<String> = load_safetensors(&saved.join("model.safetensors"), Device::Cpu)
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert!(
            !model.contains(&"0.bias".to_string()),
            "claimed tensors are left out"
        );
        tch::no_grad(|| {
            for (_, mut t) in hearth::models::sorted_variables(&vs) {
                let _ = t.fill_(7.0);
            }
        });
        let result = acc.load_state(Some(&saved));
        let now = weights(&vs);
        match expected {
            None => {
                result.unwrap();
                for ((name, was), (_, got)) in before.iter().zip(&now) {
                    if name == "0.bias" {
                        assert!(
                            same(got, &was.zeros_like()),
                            "the hook restores it as zeros"
                        );
                    } else {
                        assert!(same(got, was), "{name} comes from the model file");
                    }
                }
            }
            Some(fragment) => {
                let chain = format!("{:#}", anyhow::Error::from(result.unwrap_err()));
                assert!(
                    chain.contains("hook `bad-hook`") && chain.contains(fragment),
                    "{behaviour}: {chain}"
                );
                assert!(
                    now.iter()
                        .all(|(_, t)| t.eq(7.0).all().int64_value(&[]) == 1),
                    "{behaviour}: nothing restored"
                );
            }
        }
    }
}

#[test]
fn a_hook_sees_only_its_checkpoint_folder() {
    let dir = scratch("escape");
    let _ = std::fs::remove_file("/tmp/outside.txt");
    let (mut acc, _) = setup(&dir, false);
    acc.register_checkpoint_hook(bad_hook(&dir, "escape", ""));
    let saved = acc.save_state(None).unwrap();
    let report = std::fs::read_to_string(saved.join("escape.txt")).unwrap();
    assert_eq!(report.matches("refused").count(), 4, "{report}");
    assert!(!report.contains("ALLOWED"), "{report}");
    assert!(!Path::new("/tmp/outside.txt").exists());
    assert!(!dir.join("checkpoints/outside.txt").exists());
    // While loading, the folder is read-only (the hook fails the load if it
    // could write).
    acc.load_state(Some(&saved)).unwrap();
    assert!(!saved.join("written-on-load.txt").exists());
    assert!(verify_complete(&saved).is_ok());
    assert!(saved.join(MANIFEST_NAME).is_file());
}

/// This process's threads named `name` (as /proc gives it: its first 15
/// bytes).
fn threads_named(name: &str) -> usize {
    let name = &name[..name.len().min(15)];
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// A hook's file calls run on its executor's blocking pool, whose idle
/// threads tokio kept for 10 s: hooks called every few seconds kept every
/// thread a burst ever started (the hour-long soak saw 5). They now go
/// after 2 s (`IDLE_THREAD_KEEP_ALIVE` in plugins/src/runtime.rs), and are
/// named after the plugin.
#[test]
fn a_hooks_idle_file_threads_go_after_the_keep_alive() {
    let dir = scratch("idle-threads");
    // The built-in manifest-sha256 hook under a name of its own, so that
    // no other test's plugin threads are counted.
    let built = common::repo_root().join("target/plugins/manifest-sha256");
    let copy = dir.join("plugins/idle-probe");
    std::fs::create_dir_all(&copy).unwrap();
    for file in
        std::fs::read_dir(&built).expect("built-in plugins are installed: run `make plugins`")
    {
        let file = file.unwrap().path();
        std::fs::copy(&file, copy.join(file.file_name().unwrap())).unwrap();
    }
    let manifest = std::fs::read_to_string(copy.join("plugin.toml")).unwrap();
    let renamed = manifest.replace("name = \"manifest-sha256\"", "name = \"idle-probe\"");
    assert_ne!(manifest, renamed);
    std::fs::write(copy.join("plugin.toml"), renamed).unwrap();
    let hook = load_checkpoint_hook(&Manifest::read(&copy).unwrap(), "{}").unwrap();

    let (mut acc, _vs) = setup(&dir.join("run"), false);
    acc.register_checkpoint_hook(hook);
    let thread = "plugin-idle-probe";
    // The pool's thread is watched from before the save: its last file
    // call may end more than the keep-alive before save_state returns
    // (the commit's syncs come after the hook's calls). The watcher has
    // looked once before the save starts, and once more after it ends
    // whenever it is scheduled: on a loaded machine (CI) its first look
    // could otherwise come after the save and see nothing.
    let saving = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let started = std::sync::Arc::new(std::sync::Barrier::new(2));
    let watcher = {
        let (saving, started) = (saving.clone(), started.clone());
        std::thread::spawn(move || {
            let mut most = threads_named(thread);
            started.wait();
            loop {
                let done = !saving.load(std::sync::atomic::Ordering::Acquire);
                most = most.max(threads_named(thread));
                if done {
                    return most;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        })
    };
    started.wait();
    acc.save_state(None).unwrap();
    saving.store(false, std::sync::atomic::Ordering::Release);
    let seen = watcher.join().unwrap().max(threads_named(thread));
    assert!(seen >= 1, "the hook's file calls ran on its named pool");
    let since = std::time::Instant::now();
    while threads_named(thread) > 0 {
        assert!(
            // 2 s, and a margin for a loaded machine: tokio's 10 s fails.
            since.elapsed() < std::time::Duration::from_secs(5),
            "{} idle thread(s) of the hook still there after {:?}",
            threads_named(thread),
            since.elapsed()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The pool serves the next save again.
    let second = acc.save_state(None).unwrap();
    verify_complete(&second).unwrap();
}
