//! NCCL in a world of one: every collective hearth calls.

use super::cuda;
use tch::{Device, Kind, Tensor};

/// The NCCL backend in a world of one GPU (one GPU cannot hold two NCCL
/// ranks): the communicator is created, every collective runs on the
/// group's stream after libtorch's, and its values come back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_world_of_one_runs_every_collective() {
    use hearth::comm::{NcclGroup, NcclPlace, ProcessGroup, ReduceOp};
    let device = cuda();
    let place = NcclPlace {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        device: 0,
    };
    let group = NcclGroup::init(place, std::time::Duration::from_secs(60), |id| {
        Ok(id.expect("rank 0 makes the id"))
    })
    .unwrap();
    // Written by libtorch just before: the collective must see it.
    let x = Tensor::arange(6, (Kind::Float, device)).view([3, 2]) * 2.0;
    let mut sum = x.copy();
    group.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
    assert_eq!(
        Vec::<f32>::try_from(sum.view([-1]).to_device(Device::Cpu)).unwrap(),
        [0., 2., 4., 6., 8., 10.]
    );
    let mean = group
        .all_reduce_start(&x, ReduceOp::Mean)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(mean.device(), device);
    assert!(mean.equal(&x));
    let gathered = group.all_gather(&x).unwrap();
    assert_eq!(gathered.size(), [3, 2]);
    assert!(gathered.equal(&x));
    let scattered = group.reduce_scatter(&x, ReduceOp::Max).unwrap();
    assert!(scattered.equal(&x));
    let mut b = x.copy();
    group.broadcast(&mut b, 0).unwrap();
    assert!(b.equal(&x));
    // A CPU tensor goes through the GPU and comes back on the CPU.
    let cpu = group.all_gather(&Tensor::from_slice(&[7i64])).unwrap();
    assert_eq!(
        (cpu.device(), Vec::<i64>::try_from(&cpu).unwrap()),
        (Device::Cpu, vec![7])
    );
    assert_eq!(
        group.all_gather_bytes(b"hearth").unwrap(),
        vec![b"hearth".to_vec()]
    );
    assert_eq!(
        group.broadcast_bytes(b"rank 0".to_vec(), 0).unwrap(),
        b"rank 0"
    );
    group.barrier().unwrap();
    let e = group
        .all_reduce_start(&x.to_kind(Kind::Int64), ReduceOp::Mean)
        .err()
        .unwrap();
    assert!(e.to_string().contains("convert it to float32"), "{e}");
}
