//! `HEARTH_*` environment variables fill in what the builder was not given,
//! and an explicit setting wins; `patch_environment` and `clear_environment`
//! change the environment for a scope; `set_seed(.., deterministic)` turns
//! on libtorch's deterministic algorithms; a built Accelerator keeps memory
//! a step frees for the next. One test in its own binary: it
//! changes process-wide settings, which other tests must not see.

use hearth_testkit as common;

use hearth::accelerator::{Accelerator, BuildError};
use hearth::precision::MixedPrecision;

#[test]
fn environment_fills_in_and_explicit_settings_win() {
    // SAFETY: this binary runs this one test, on one thread.
    unsafe {
        std::env::set_var("HEARTH_MIXED_PRECISION", "bf16");
        std::env::set_var("HEARTH_GRADIENT_ACCUMULATION_STEPS", "4");
        std::env::set_var("HEARTH_USE_CPU", "true");
    }
    let from_env = Accelerator::builder().build().unwrap();
    assert_eq!(from_env.mixed_precision(), MixedPrecision::Bf16);
    assert_eq!(from_env.gradient_accumulation_steps(), 4);
    assert_eq!(from_env.device(), tch::Device::Cpu);

    let explicit = Accelerator::builder()
        .mixed_precision(MixedPrecision::No)
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    assert_eq!(explicit.mixed_precision(), MixedPrecision::No);
    assert_eq!(explicit.gradient_accumulation_steps(), 2);

    unsafe { std::env::set_var("HEARTH_GRADIENT_ACCUMULATION_STEPS", "zero") };
    let err = Accelerator::builder()
        .build()
        .err()
        .expect("a bad value is refused");
    assert!(matches!(
        err,
        BuildError::Env {
            name: "HEARTH_GRADIENT_ACCUMULATION_STEPS",
            ..
        }
    ));
    assert!(err.to_string().contains("\"zero\""), "{err}");

    unsafe {
        std::env::remove_var("HEARTH_GRADIENT_ACCUMULATION_STEPS");
        std::env::set_var("HEARTH_MIXED_PRECISION", "fp8");
    }
    let err = Accelerator::builder().build().err().unwrap().to_string();
    assert!(
        err.contains("HEARTH_MIXED_PRECISION") && err.contains("bf16"),
        "{err}"
    );

    // torchrun-style variables without mpirun: refused, saying what to do
    // (hearth's CPU backend is MPI), instead of a world of one that
    // believes it is rank 0 of 1.
    unsafe {
        std::env::remove_var("HEARTH_MIXED_PRECISION");
        std::env::set_var("WORLD_SIZE", "2");
        std::env::set_var("RANK", "1");
    }
    let err = Accelerator::builder().build().err().unwrap();
    assert!(matches!(err, BuildError::Dist(_)));
    let chain = format!("{:#}", anyhow::Error::from(err));
    assert!(
        chain.contains("WORLD_SIZE=2") && chain.contains("mpirun -n 2"),
        "{chain}"
    );
    unsafe {
        std::env::set_var("WORLD_SIZE", "1");
        std::env::set_var("RANK", "0");
    }
    assert_eq!(Accelerator::builder().build().unwrap().num_processes(), 1);

    scoped_changes_are_undone();
    set_seed_does_what_accelerates_does();
    freed_memory_stays_for_the_next_step();
    the_plugin_epoch_ticker_sleeps_between_calls();
}

/// Times the thread called `name` went to sleep so far (its voluntary
/// context switches, /proc/self/task/*/status).
fn sleeps_of_thread(name: &str) -> Option<u64> {
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let status = std::fs::read_to_string(task.path().join("status")).ok()?;
        return status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse().ok());
    }
    None
}

/// With no plugin call in flight the epoch ticker does not wake (it used
/// to, every 10 ms, taking the training threads' cores 100 times a second);
/// a call wakes it, so call deadlines still count (tests/test_sandbox.py).
fn the_plugin_epoch_ticker_sleeps_between_calls() {
    let _ = hearth::plugins::PluginEngine::global();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let before = sleeps_of_thread("hearth-plugin-e").expect("the ticker thread runs");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let after = sleeps_of_thread("hearth-plugin-e").unwrap();
    assert!(
        after - before <= 1,
        "the idle ticker woke {} times in 300 ms",
        after - before
    );
}

/// This process's resident memory in bytes (/proc/self/statm).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// After an Accelerator is built (`ops::keep_freed_memory_for_reuse`),
/// 32 MiB freed in 1 MiB blocks, as a step frees its activations, stays in
/// the process for the next step. With glibc's defaults those blocks are
/// mapped one by one (or trimmed off the heap's top) and go back to the
/// system at once, to be faulted in again.
fn freed_memory_stays_for_the_next_step() {
    let _acc = Accelerator::builder().cpu(true).build().unwrap();
    let blocks: Vec<Vec<u8>> = (0..32).map(|i| vec![i as u8 + 1; 1 << 20]).collect();
    let held = resident_bytes();
    drop(blocks);
    let after = resident_bytes();
    assert!(
        after + (16 << 20) > held,
        "freeing 32 MiB gave {} MiB back to the system",
        (held - after) >> 20
    );
}

/// `set_seed(seed, false, true)` against Accelerate's `set_seed(seed,
/// deterministic=True)` run live: the same first values from the CPU
/// generator, deterministic algorithms on, fresh tensors filled with NaN.
fn set_seed_does_what_accelerates_does() {
    let oracle: serde_json::Value =
        serde_json::from_str(&common::oracle("accelerate_set_seed.py", &["1234"])).unwrap();
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    assert!(!hearth::ops::deterministic_algorithms());
    acc.set_seed(1234, false, true);
    let rand: Vec<f64> = Vec::try_from(tch::Tensor::rand(
        [4],
        (tch::Kind::Double, tch::Device::Cpu),
    ))
    .unwrap();
    let want: Vec<f64> = oracle["rand"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    // serde_json's default float parsing may miss the last ulp.
    assert!(
        rand.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-15),
        "{rand:?} != {want:?}"
    );
    assert_eq!(
        hearth::ops::deterministic_algorithms(),
        oracle["deterministic"].as_bool().unwrap()
    );
    let empty = tch::Tensor::empty([8], (tch::Kind::Float, tch::Device::Cpu));
    assert_eq!(
        empty.isnan().all().int64_value(&[]) == 1,
        oracle["empty_is_nan"].as_bool().unwrap()
    );
    hearth::ops::use_deterministic_algorithms(false).unwrap();
}

/// Accelerate's `patch_environment` (upper-cased names, values as strings,
/// each variable back to its value before or unset) and
/// `clear_environment` (empty inside, exactly restored after).
fn scoped_changes_are_undone() {
    use hearth::comm::environment::{clear_environment, patch_environment};
    let var = |k: &str| std::env::var(k).ok();
    unsafe {
        std::env::set_var("HEARTH_KEPT", "before");
        std::env::remove_var("HEARTH_NEW");
    }
    {
        let _guard = patch_environment([("hearth_kept", 1), ("Hearth_New", 2)]);
        assert_eq!(var("HEARTH_KEPT").as_deref(), Some("1"));
        assert_eq!(var("HEARTH_NEW").as_deref(), Some("2"));
        assert_eq!(var("hearth_kept"), None, "names are upper-cased");
        {
            let _inner = patch_environment([("HEARTH_NEW", "inner")]);
            assert_eq!(var("HEARTH_NEW").as_deref(), Some("inner"));
        }
        assert_eq!(var("HEARTH_NEW").as_deref(), Some("2"));
    }
    assert_eq!(var("HEARTH_KEPT").as_deref(), Some("before"));
    assert_eq!(var("HEARTH_NEW"), None);

    let before: Vec<_> = std::env::vars_os().collect();
    let guard = clear_environment();
    assert_eq!(std::env::vars_os().count(), 0);
    unsafe {
        std::env::set_var("HEARTH_KEPT", "changed inside");
        std::env::set_var("HEARTH_ADDED", "inside");
    }
    guard.restore();
    let mut after: Vec<_> = std::env::vars_os().collect();
    let mut expected = before;
    after.sort();
    expected.sort();
    assert_eq!(after, expected);
}
