//! SHARD_GRAD_OP (ZeRO-2): gradients and optimizer state sharded, the
//! parameters whole; the weights of DDP and of one process, on about half
//! the memory, on a hearth model and on a user's VarStore.

use super::{
    reference, run, sharding_matches_ddp_and_one_process, worst_difference, Setup, STEPS, TOLERANCE,
};
use hearth::parallel::ShardingStrategy;
use hearth::precision::MixedPrecision;

fn shard_grad_op_matches_ddp_and_one_process(
    n: usize,
    batch: usize,
    accumulation: usize,
    precision: MixedPrecision,
) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    sharding_matches_ddp_and_one_process(
        ShardingStrategy::ShardGradOp,
        false,
        n,
        batch,
        accumulation,
        precision,
    )
}

#[test]
fn shard_grad_op_with_fp16_loss_scaling_trains_what_ddp_and_one_process_do() {
    shard_grad_op_matches_ddp_and_one_process(2, 2, 1, MixedPrecision::Fp16);
}

#[test]
fn a_custom_var_store_model_is_sharded_by_its_declared_classes() {
    let sharded = Setup {
        strategy: Some(ShardingStrategy::ShardGradOp),
        batch: 3,
        accumulation: 1,
        precision: MixedPrecision::No,
        clip: Some(2.0),
        custom: true,
        checkpointing: false,
    };
    let want = reference(sharded, 2);
    let (ranks, reports, _dir) = run(2, sharded);
    for (r, got) in ranks.iter().enumerate() {
        let worst = worst_difference(got, &want);
        assert!(
            worst <= TOLERANCE,
            "rank {r}: {worst:e} from one process's weights"
        );
    }
    // Four `Layer` units; the root holds nothing of its own.
    assert_eq!(reports[0]["reduce_scatters"], 4 * STEPS, "{}", reports[0]);
}

#[test]
fn shard_grad_op_on_two_ranks_trains_what_ddp_and_one_process_do_on_half_the_memory() {
    let (ddp, sharded) = shard_grad_op_matches_ddp_and_one_process(2, 2, 1, MixedPrecision::No);
    for r in 0..2 {
        let (full, shard) = (&ddp[r]["memory"], &sharded[r]["memory"]);
        assert_eq!(
            full["param_bytes"], shard["param_bytes"],
            "parameters stay whole"
        );
        for key in ["grad_bytes", "optimizer_bytes"] {
            let (f, s) = (full[key].as_f64().unwrap(), shard[key].as_f64().unwrap());
            let ratio = s / f;
            // Half, within the padding of odd row counts.
            assert!(
                (ratio - 0.5).abs() < 0.01,
                "rank {r} {key}: {s} of {f} ({ratio})"
            );
        }
    }
}

#[test]
fn shard_grad_op_on_four_ranks_with_accumulation_trains_what_ddp_and_one_process_do() {
    shard_grad_op_matches_ddp_and_one_process(4, 1, 2, MixedPrecision::No);
}

#[test]
fn shard_grad_op_with_bf16_trains_what_ddp_and_one_process_with_bf16_do() {
    shard_grad_op_matches_ddp_and_one_process(2, 2, 1, MixedPrecision::Bf16);
}
