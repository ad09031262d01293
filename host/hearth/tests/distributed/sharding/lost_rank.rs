//! A rank lost in the middle of a FULL_SHARD step, seen from the library:
//! the collective of the forward pass (a unit's all-gather) or of the
//! backward pass (a gradient reduce-scatter) that times out is an error
//! the caller gets from `PreparedModel::try_forward_t` or
//! `Accelerator::backward`, naming the unit and the silent rank — not a
//! panic, and not passed off as libtorch's own error.

use super::{accelerator, bench_gpt, pool, Setup};
use hearth::models::Gpt;
use hearth::parallel::ShardingStrategy;
use hearth::precision::MixedPrecision;
use hearth_testkit::{mpirun, scratch, CHILD};
use std::time::{Duration, Instant};
use tch::Device;

/// The collective timeout of these runs.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One rank of a FULL_SHARD step whose rank 1 hangs before the pass of
/// mode `lost:<forward|backward>`; rank 0 reports what it got and exits 1.
#[test]
fn child_lost_rank() {
    let Some(pass) = std::env::var(CHILD)
        .ok()
        .and_then(|m| m.strip_prefix("lost:").map(str::to_string))
    else {
        return; // only under mpirun
    };
    let mut acc = accelerator(
        Setup {
            strategy: Some(ShardingStrategy::FullShard),
            batch: 2,
            accumulation: 1,
            precision: MixedPrecision::No,
            clip: None,
            custom: false,
            checkpointing: false,
        },
        TIMEOUT,
    );
    let r = acc.process_index();
    tch::manual_seed(1);
    let model = acc.prepare(Gpt::new(bench_gpt(), Device::Cpu)).unwrap();
    let (x, y) = pool(1).remove(0);
    let (x, y) = (x.unsqueeze(0), y.unsqueeze(0));
    let hang = |at: &str| {
        if r == 1 && pass == at {
            std::thread::sleep(Duration::from_secs(60));
        }
    };
    let fail = |what: &str, e: &dyn std::error::Error| -> ! {
        eprintln!("rank {r}: {what}: {}", hearth::ops::error_chain(e));
        std::process::exit(1);
    };
    hang("forward");
    let logits = model
        .try_forward_t(&x, true)
        .unwrap_or_else(|e| fail("forward", &e));
    let loss = logits
        .view([-1, 256])
        .cross_entropy_for_logits(&y.view([-1]));
    hang("backward");
    if let Err(e) = acc.backward(&loss) {
        fail("backward", &e);
    }
    eprintln!("rank {r}: the step completed");
}

/// Runs mode `lost:<pass>` on 2 ranks and returns rank 0's stderr, checked
/// to hold no panic and no claim that libtorch failed.
fn lost_in(pass: &str) -> String {
    let started = Instant::now();
    let out = mpirun(
        2,
        &hearth_testkit::child!("child_lost_rank"),
        &format!("lost:{pass}"),
        &scratch(&format!("lost_{pass}")),
    );
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stderr.contains("Internal torch error"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "the hung rank does not hold the job for its 60 s"
    );
    stderr
}

#[test]
fn a_rank_lost_before_a_full_shard_forward_is_an_error_naming_the_unit_and_rank() {
    let stderr = lost_in("forward");
    assert!(
        stderr.contains("rank 0: forward: FULL_SHARD: all-gather of unit `")
            && stderr.contains("did not complete within 5s on rank 0 of 2: rank 1 did not answer (it hangs, or its process is gone)"),
        "{stderr}"
    );
}

#[test]
fn a_rank_lost_before_a_full_shard_backward_is_an_error_naming_the_unit_and_rank() {
    let stderr = lost_in("backward");
    assert!(
        stderr.contains("rank 0: backward: FULL_SHARD: ")
            && stderr.contains("did not complete within 5s on rank 0 of 2: rank 1 did not answer (it hangs, or its process is gone)"),
        "{stderr}"
    );
}
