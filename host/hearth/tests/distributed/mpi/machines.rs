//! Several pretend machines: `save_on_each_node` writes a whole checkpoint
//! per machine, a machine that cannot save leaves every machine the
//! checkpoint before, and a sharded loader resumes on two ranks.

use common::{mpirun_ok, results, scratch, CHILD, OUT};
use hearth_testkit as common;

use super::values;

use hearth::accelerator::Accelerator;
use tch::{Device, Kind, Tensor};

/// This rank of 4 on two pretend machines (ranks 0–1 on `a`, 2–3 on `b`,
/// each with a folder of its own under the output folder), saving with
/// `save_on_each_node` and keeping `total_limit` checkpoints: its rank,
/// the output folder and its accelerator.
fn on_two_machines(total_limit: Option<usize>) -> (usize, std::path::PathBuf, Accelerator) {
    let rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
        .unwrap()
        .parse()
        .unwrap();
    let node = if rank < 2 { "a" } else { "b" };
    std::env::set_var("HEARTH_NODE_NAME", node);
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    let acc = common::child_builder()
        .project_config(hearth::accelerator::ProjectConfiguration {
            project_dir: out.join(format!("node_{node}")),
            automatic_checkpoint_naming: true,
            save_on_each_node: true,
            total_limit,
            ..Default::default()
        })
        .build()
        .unwrap();
    (rank, out, acc)
}

/// One rank of a run on two pretend machines (ranks 0–1 on `a`, 2–3 on
/// `b`, each with a folder of its own) saving with `save_on_each_node`,
/// then loading back: each rank reports what it drew after the save and
/// after the load.
#[test]
fn child_save_on_each_node() {
    if std::env::var(CHILD).as_deref() != Ok("each-node") {
        return; // only under mpirun
    }
    let (rank, out, mut acc) = on_two_machines(None);
    tch::manual_seed(7 + rank as i64);
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _layer = tch::nn::linear(vs.root() / "l", 3, 2, Default::default());
    let _vs = acc.prepare(vs).unwrap();
    acc.save_state(None).unwrap();
    acc.wait_for_everyone().unwrap();
    let after_save = values(&Tensor::rand([2], (Kind::Float, Device::Cpu)));
    let _ = Tensor::rand([5], (Kind::Float, Device::Cpu));
    acc.load_state(None).unwrap();
    let after_load = values(&Tensor::rand([2], (Kind::Float, Device::Cpu)));
    let result = serde_json::json!({"after_save": after_save, "after_load": after_load});
    std::fs::write(out.join(format!("rank_{rank}.json")), result.to_string()).unwrap();
}

/// One rank of two pretend machines (as `child_save_on_each_node`) keeping
/// one checkpoint: the first save succeeds; for the second, machine b's
/// writer (rank 2) may write no file past 100 bytes (RLIMIT_FSIZE), so it
/// fails there while machine a's commits. Each rank reports its error.
#[test]
fn child_a_machine_that_cannot_save() {
    if std::env::var(CHILD).as_deref() != Ok("each-node-fail") {
        return; // only under mpirun
    }
    let (rank, out, mut acc) = on_two_machines(Some(1));
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let _layer = tch::nn::linear(vs.root() / "l", 3, 2, Default::default());
    let _vs = acc.prepare(vs).unwrap();
    acc.save_state(None).unwrap();
    let limit = |bytes: u64| {
        let limit = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: setting this process's own limit (and ignoring the
        // signal a write past it would otherwise end the process with).
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
    };
    if rank == 2 {
        limit(100);
    }
    let error = acc.save_state(None).map(|_| ()).unwrap_err().to_string();
    limit(libc::RLIM_INFINITY);
    let result = serde_json::json!({ "error": error });
    std::fs::write(out.join(format!("rank_{rank}.json")), result.to_string()).unwrap();
}

/// One rank of a sharded, shuffled loader stopped mid-epoch: mode
/// `loader:save` reads 2 batches, saves, then reads on to the end of the
/// next epoch; `loader:resume` (a fresh process) loads that checkpoint and
/// reads the same stretch. Each writes the batches it read after the save.
#[test]
fn child_loader_resume() {
    let Some(mode) = std::env::var(CHILD)
        .ok()
        .filter(|m| m.starts_with("loader:"))
    else {
        return; // only under mpirun
    };
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    // The save and the resume write into sibling folders; the checkpoint
    // lies beside them.
    let checkpoint = out.parent().unwrap().join("checkpoint");
    let mut acc = common::child_builder().build().unwrap();
    let ids: Vec<Tensor> = (0..13).map(|i| Tensor::from(i as i64)).collect();
    let loader = acc
        .prepare(hearth::data::DataLoader::new(ids, 2).shuffle(5))
        .unwrap();
    let ints = |t: &Tensor| Vec::<i64>::try_from(t).unwrap();
    let mut after = Vec::new();
    if mode == "loader:save" {
        let mut epoch = loader.iter();
        let _ = (epoch.next(), epoch.next());
        acc.save_state(Some(&checkpoint)).unwrap();
        after.extend(epoch.map(|b| ints(&b)));
    } else {
        acc.load_state(Some(&checkpoint)).unwrap();
        after.extend(loader.iter().map(|b| ints(&b)));
    }
    after.extend(loader.iter().map(|b| ints(&b)));
    let r = acc.process_index();
    let result = serde_json::json!({ "after": after, "state": loader.state().epoch });
    std::fs::write(out.join(format!("rank_{r}.json")), result.to_string()).unwrap();
}

/// Issue 43: with `save_on_each_node`, a save that one machine's writer
/// cannot write fails on every rank, naming rank 2; the machine whose copy
/// was committed sets it aside, and neither rotates: both keep the
/// checkpoint before, so a resume finds the same newest one everywhere.
#[test]
fn a_machine_that_cannot_save_leaves_every_machine_the_checkpoint_before() {
    let dir = scratch("each-node-fail");
    mpirun_ok(
        4,
        &hearth_testkit::child!("child_a_machine_that_cannot_save"),
        "each-node-fail",
        &dir,
    );
    let names = |node: &str| -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir.join(format!("node_{node}/checkpoints")))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
        names.sort();
        names
    };
    assert_eq!(names("a"), ["checkpoint_0", "checkpoint_1.incomplete"]);
    assert_eq!(names("b"), ["checkpoint_0"]);
    for (r, got) in results(&dir, 4).iter().enumerate() {
        let error = got["error"].as_str().unwrap();
        let expected = if r == 2 {
            "ulimit -f"
        } else {
            "rank 2 could not write its part"
        };
        assert!(error.contains(expected), "rank {r}: {error}");
    }
}

#[test]
fn save_on_each_node_writes_a_whole_checkpoint_per_machine_with_its_ranks_generators() {
    let dir = scratch("each-node");
    mpirun_ok(
        4,
        &hearth_testkit::child!("child_save_on_each_node"),
        "each-node",
        &dir,
    );
    let files = |node: &str| -> Vec<String> {
        let folder = dir.join(format!("node_{node}/checkpoints/checkpoint_0"));
        let mut names: Vec<String> = std::fs::read_dir(&folder)
            .unwrap_or_else(|e| panic!("{}: {e}", folder.display()))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("random_states") || n == "model.safetensors")
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        files("a"),
        [
            "model.safetensors",
            "random_states_0.safetensors",
            "random_states_1.safetensors"
        ]
    );
    assert_eq!(
        files("b"),
        [
            "model.safetensors",
            "random_states_2.safetensors",
            "random_states_3.safetensors"
        ]
    );
    // Both machines hold rank 0's weights (prepare broadcast them).
    let model = |node: &str| {
        std::fs::read(dir.join(format!(
            "node_{node}/checkpoints/checkpoint_0/model.safetensors"
        )))
        .unwrap()
    };
    assert_eq!(model("a"), model("b"));
    // Every rank's generators came back from its own machine's folder.
    let ranks = results(&dir, 4);
    for (r, got) in ranks.iter().enumerate() {
        assert_eq!(got["after_load"], got["after_save"], "rank {r}");
    }
    assert_ne!(ranks[0]["after_save"], ranks[2]["after_save"]);
}

#[test]
fn a_sharded_loader_resumed_on_two_ranks_reads_what_the_unbroken_run_read() {
    let dir = scratch("loader");
    let (saved, resumed) = (dir.join("saved"), dir.join("resumed"));
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_loader_resume"),
        "loader:save",
        &saved,
    );
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_loader_resume"),
        "loader:resume",
        &resumed,
    );
    let (saved, resumed) = (results(&saved, 2), results(&resumed, 2));
    for r in 0..2 {
        // 13 examples, batch 2, 2 ranks: 4 batches each per epoch, 2 read
        // before the save: 2 more of epoch 0, then 4 of epoch 1.
        let after = saved[r]["after"].as_array().unwrap();
        assert_eq!(after.len(), 6, "rank {r}: {after:?}");
        assert_eq!(resumed[r]["after"], saved[r]["after"], "rank {r}");
        assert_eq!(resumed[r]["state"], 2, "two epochs finished");
    }
    assert_ne!(
        saved[0]["after"], saved[1]["after"],
        "the ranks read different shards"
    );
}
