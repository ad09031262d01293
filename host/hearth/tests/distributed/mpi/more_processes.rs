//! A checkpoint of 2 processes loaded on 3: the third process starts each
//! per-process object from process 0's state where the object can, and
//! where one cannot, every process refuses the load, naming it.

use hearth::accelerator::Checkpointable;
use hearth_testkit::{mpirun, mpirun_ok, results, scratch, write_result, CHILD, OUT};
use std::sync::{Arc, Mutex};

/// A per-process counter; `adopts` says whether a process the checkpoint
/// was not saved by may start from process 0's value (it adds 1000, so
/// the test sees which path ran).
struct PerRank {
    value: u64,
    adopts: bool,
}

impl Checkpointable for PerRank {
    fn state_dict(&self) -> Vec<u8> {
        self.value.to_le_bytes().to_vec()
    }
    fn load_state_dict(&mut self, state: &[u8]) -> Result<(), String> {
        self.value = u64::from_le_bytes(state.try_into().map_err(|_| "8 bytes".to_string())?);
        Ok(())
    }
    fn per_process(&self) -> bool {
        true
    }
    fn load_state_dict_of_process_zero(&mut self, state: &[u8]) -> Result<(), String> {
        if !self.adopts {
            return Err("a new process has no count".into());
        }
        self.load_state_dict(state)?;
        self.value += 1000;
        Ok(())
    }
}

/// `more:save` (2 ranks) saves values 10 and 11 into the folder beside
/// `$HEARTH_MPI_OUT`; `more:adopt` and `more:refuse` (3 ranks) load it and
/// write the value or the error each rank got.
#[test]
fn child_more_processes() {
    let Some(mode) = std::env::var(CHILD).ok().filter(|m| m.starts_with("more:")) else {
        return; // only under mpirun
    };
    let out = std::path::PathBuf::from(std::env::var(OUT).unwrap());
    let checkpoint = out.parent().unwrap().join("checkpoint");
    let mut acc = super::common::child_builder().build().unwrap();
    let rank = acc.process_index();
    let object = Arc::new(Mutex::new(PerRank {
        value: 10 + rank as u64,
        adopts: mode != "more:refuse",
    }));
    acc.register_for_checkpointing(object.clone());
    let result = if mode == "more:save" {
        acc.save_state(Some(&checkpoint)).unwrap();
        serde_json::json!({ "saved": true })
    } else {
        object.lock().unwrap().value = 0;
        match acc.load_state(Some(&checkpoint)) {
            Ok(_) => serde_json::json!({ "value": object.lock().unwrap().value }),
            Err(e) => serde_json::json!({ "error": format!("{e:#}") }),
        }
    };
    write_result(rank, &result);
}

#[test]
fn a_checkpoint_of_two_processes_loads_on_three_where_each_object_can_start_the_third() {
    let dir = scratch("more");
    let (saved, adopted, refused) = (dir.join("saved"), dir.join("adopt"), dir.join("refuse"));
    mpirun_ok(
        2,
        &hearth_testkit::child!("child_more_processes"),
        "more:save",
        &saved,
    );
    mpirun_ok(
        3,
        &hearth_testkit::child!("child_more_processes"),
        "more:adopt",
        &adopted,
    );
    let values: Vec<_> = results(&adopted, 3)
        .iter()
        .map(|r| r["value"].clone())
        .collect();
    assert_eq!(
        values,
        [10, 11, 1010],
        "ranks 0 and 1 restore their own; rank 2 starts from rank 0's"
    );
    // An object that cannot start a new process: every rank refuses the
    // load (none waits in a collective for the others), rank 2 with the
    // object's reason and the others naming rank 2.
    let run = mpirun(
        3,
        &hearth_testkit::child!("child_more_processes"),
        "more:refuse",
        &refused,
    );
    assert!(
        run.status.success(),
        "the children report errors as results"
    );
    let ranks = results(&refused, 3);
    let error = |r: usize| ranks[r]["error"].as_str().unwrap_or_default().to_string();
    assert!(
        error(2).contains("process 2 was not among the processes that saved")
            && error(2).contains("a new process has no count"),
        "{}",
        error(2)
    );
    for r in 0..2 {
        assert!(
            error(r).contains("rank 2 could not load it"),
            "rank {r}: {}",
            error(r)
        );
    }
}
