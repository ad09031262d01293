//! Communication between the processes of a run, with Accelerate's names
//! and semantics: gather, reduce, broadcast, objects, padding and
//! splitting, triggers, barriers and who-goes-first, and running work on
//! chosen processes.

use super::{Accelerator, RngType, TensorTree};
use hearth_comm::{DistError, DistributedType, ReduceOp};
use hearth_ops as ops;
use std::sync::atomic::Ordering;
use tch::{Device, Tensor};

impl Accelerator {
    /// What kind of world this is (Accelerate's `distributed_type`): one
    /// process, several on CPUs, several with a GPU each, or — with an FSDP
    /// plugin on GPUs — `FSDP`, as Accelerate says. On CPUs it stays
    /// `MultiCpu` even with an FSDP plugin (hearth still shards there):
    /// Accelerate's `AcceleratorState` turns only the multi-device types
    /// (`MULTI_GPU`, `MULTI_XPU`, …) into `FSDP`, and code written for it
    /// branches on that.
    pub fn distributed_type(&self) -> DistributedType {
        if self.num_processes() == 1 {
            DistributedType::No
        } else if self.device.is_cuda() && self.data_parallel.fsdp().is_some() {
            DistributedType::Fsdp
        } else if self.device.is_cuda() {
            DistributedType::MultiGpu
        } else {
            DistributedType::MultiCpu
        }
    }

    /// Every process's `value` concatenated along dimension 0 in rank
    /// order (Accelerate's `gather`; a scalar counts as one row). The first
    /// dimension may differ between processes. `value` is a tensor or any
    /// [`TensorTree`] (tuples, vectors, string-keyed maps… of tensors), each
    /// tensor gathered in place, as Accelerate's `recursively_apply` does:
    /// every process passes the same structure.
    pub fn gather<T: TensorTree>(&self, value: &T) -> Result<T, DistError> {
        each_tensor(value, |tensor| {
            let rows = if tensor.dim() == 0 {
                tensor.view([1])
            } else {
                tensor.shallow_clone()
            };
            self.group.all_gather(&rows)
        })
    }

    /// Gathers evaluation outputs from every process (see
    /// [`gather`](Self::gather)); on the last batch of a prepared loader's
    /// epoch, keeps only the real examples of it, dropping those repeated
    /// to give every process a full batch (Accelerate's
    /// `gather_for_metrics`, with the loader's `remainder`).
    pub fn gather_for_metrics<T: TensorTree>(&self, value: &T) -> Result<T, DistError> {
        let all = self.gather(value)?;
        each_tensor(&all, |all| match self.state.remainder() {
            Some(r) if self.state.end_of_dataloader() && r > 0 && all.size()[0] > r as i64 => {
                Ok(all.narrow(0, 0, r as i64))
            }
            _ => Ok(all.shallow_clone()),
        })
    }

    /// Every process's `items` (anything serialisable: strings, records),
    /// one list in rank order (Accelerate's `gather_for_metrics(items,
    /// use_gather_object=True)`, which gathers with `gather_object` and
    /// flattens); on the last batch of a prepared loader's epoch, only the
    /// first `remainder` are kept, dropping the items of examples repeated
    /// to give every process a full batch.
    pub fn gather_objects_for_metrics<T: serde::Serialize + serde::de::DeserializeOwned>(
        &self,
        items: Vec<T>,
    ) -> Result<Vec<T>, DistError> {
        let mut all: Vec<T> = self.gather_object(&items)?.into_iter().flatten().collect();
        if let Some(r) = self.state.remainder() {
            if self.state.end_of_dataloader() && r > 0 {
                all.truncate(r);
            }
        }
        Ok(all)
    }

    /// `value` combined across processes with `op` (Accelerate's `reduce`:
    /// sum, mean, max; min too), as new tensors; a tensor or any
    /// [`TensorTree`], as [`gather`](Self::gather) takes.
    pub fn reduce<T: TensorTree>(&self, value: &T, op: ReduceOp) -> Result<T, DistError> {
        each_tensor(value, |tensor| {
            let mut out = tensor.detach().copy();
            self.group.all_reduce(&mut out, op)?;
            Ok(out)
        })
    }

    /// Process `from`'s `value`, on every process (Accelerate's
    /// `broadcast`; every process passes tensors of the same shapes in the
    /// same structure).
    pub fn broadcast<T: TensorTree>(&self, value: &T, from: usize) -> Result<T, DistError> {
        each_tensor(value, |tensor| {
            let mut out = tensor.detach().copy();
            self.group.broadcast(&mut out, from)?;
            Ok(out)
        })
    }

    /// Every process's `object`, in rank order (Accelerate's
    /// `gather_object`), sent as JSON.
    pub fn gather_object<T: serde::Serialize + serde::de::DeserializeOwned>(
        &self,
        object: &T,
    ) -> Result<Vec<T>, DistError> {
        let bytes = serde_json::to_vec(object).expect("a Serialize value serialises to JSON");
        self.group
            .all_gather_bytes(&bytes)?
            .iter()
            .enumerate()
            .map(|(rank, b)| {
                serde_json::from_slice(b).map_err(|e| DistError::Mismatch {
                    op: "gather_object",
                    rank: self.process_index(),
                    message: format!("rank {rank} sent another type: {e}"),
                })
            })
            .collect()
    }

    /// Process `from`'s `object`, on every process (Accelerate's
    /// `broadcast_object_list`), sent as JSON.
    pub fn broadcast_object<T: serde::Serialize + serde::de::DeserializeOwned>(
        &self,
        object: &T,
        from: usize,
    ) -> Result<T, DistError> {
        let bytes = serde_json::to_vec(object).expect("a Serialize value serialises to JSON");
        let got = self.group.broadcast_bytes(bytes, from)?;
        serde_json::from_slice(&got).map_err(|e| DistError::Mismatch {
            op: "broadcast_object",
            rank: self.process_index(),
            message: format!("rank {from} sent another type: {e}"),
        })
    }

    /// Runs `f` on the main process only.
    pub fn on_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_main_process().then(f)
    }

    /// Runs `f` on the first process of each machine only.
    pub fn on_local_main_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.is_local_main_process().then(f)
    }

    /// Waits until every process reaches this point (a world of one does
    /// not wait).
    pub fn wait_for_everyone(&self) -> Result<(), DistError> {
        self.group.barrier()
    }

    /// `tensor` combined across processes with `op` and cut into equal
    /// chunks along dimension 0, one per process: this process gets the
    /// chunk of its index (`reduce_scatter_tensor`). The first dimension
    /// must divide by the number of processes.
    pub fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Tensor, DistError> {
        self.group.reduce_scatter(tensor, op)
    }

    /// `tensor` padded along `dim` to the largest size any process has
    /// there, with `pad_value`, at the end (or at the start with
    /// `pad_first`), so that it can be gathered (Accelerate's
    /// `pad_across_processes`). A negative `dim` counts from the last; a
    /// `dim` the tensor does not have returns it unchanged, as there. Any
    /// [`TensorTree`] is padded tensor by tensor.
    ///
    /// ```no_run
    /// # fn demo(acc: &hearth::accelerator::Accelerator, predictions: &tch::Tensor) -> Result<(), hearth::comm::DistError> {
    /// // Sequences of different lengths on each process, padded with -100.
    /// let padded = acc.pad_across_processes(predictions, 1, -100.0, false)?;
    /// let all = acc.gather(&padded)?;
    /// # Ok(()) }
    /// ```
    pub fn pad_across_processes<T: TensorTree>(
        &self,
        value: &T,
        dim: i64,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<T, DistError> {
        each_tensor(value, |tensor| {
            self.pad_tensor(tensor, dim, pad_value, pad_first)
        })
    }

    /// [`pad_across_processes`](Self::pad_across_processes) of one tensor.
    fn pad_tensor(
        &self,
        tensor: &Tensor,
        dim: i64,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor, DistError> {
        let rank = tensor.dim() as i64;
        if dim >= rank || dim < -rank {
            return Ok(tensor.shallow_clone());
        }
        let dim = if dim < 0 { dim + rank } else { dim };
        let size = tensor.size();
        let sizes = self.gather_object(&size)?;
        let longest = sizes
            .iter()
            .map(|s| s.get(dim as usize).copied())
            .collect::<Option<Vec<i64>>>()
            .ok_or_else(|| DistError::Mismatch {
                op: "pad_across_processes",
                rank: self.process_index(),
                message: format!(
                    "every process pads along dimension {dim}, but the shapes are {sizes:?}"
                ),
            })?
            .into_iter()
            .max()
            .unwrap_or(0);
        let own = size[dim as usize];
        if longest == own {
            return Ok(tensor.shallow_clone());
        }
        let mut new_size = size;
        new_size[dim as usize] = longest;
        let padded = Tensor::full(
            new_size.as_slice(),
            pad_value,
            (tensor.kind(), tensor.device()),
        );
        let start = if pad_first { longest - own } else { 0 };
        tch::no_grad(|| padded.narrow(dim, start, own).copy_(tensor));
        Ok(padded)
    }

    /// This process's share of `items`, split as evenly as possible in
    /// order: the first `len % num_processes` processes get one more
    /// (Accelerate's `split_between_processes`). With `apply_padding`
    /// every process gets the same number, the short ones completed with
    /// the last item, so the results can be gathered (drop the repeats
    /// afterwards).
    ///
    /// ```no_run
    /// # fn demo(acc: &hearth::accelerator::Accelerator) {
    /// // Two processes: ["A", "B"] on process 0, ["C"] on process 1.
    /// let mine = acc.split_between_processes(&["A", "B", "C"], false);
    /// # }
    /// ```
    pub fn split_between_processes<T: Clone>(&self, items: &[T], apply_padding: bool) -> Vec<T> {
        let (start, end, longest) = self.share_of(items.len());
        let mut mine = items[start..end].to_vec();
        if apply_padding {
            if let Some(last) = items.last() {
                mine.resize(longest, last.clone());
            }
        }
        mine
    }

    /// This process's rows of `tensor` (dimension 0), split as
    /// [`split_between_processes`](Self::split_between_processes) splits a
    /// list; with `apply_padding` the short shares are completed with the
    /// tensor's last row.
    pub fn split_tensor_between_processes(&self, tensor: &Tensor, apply_padding: bool) -> Tensor {
        let rows = tensor.size().first().copied().unwrap_or(1) as usize;
        let (start, end, longest) = self.share_of(rows);
        let mine = tensor.narrow(0, start as i64, (end - start) as i64);
        if !apply_padding || rows == 0 || end - start == longest {
            return mine;
        }
        let last = tensor.narrow(0, rows as i64 - 1, 1);
        let fill = last.expand(
            [&[(longest - (end - start)) as i64], &tensor.size()[1..]].concat(),
            false,
        );
        Tensor::cat(&[mine, fill], 0)
    }

    /// Where this process's share of `len` items starts and ends, and the
    /// largest share of any process.
    fn share_of(&self, len: usize) -> (usize, usize, usize) {
        let (n, r) = (self.num_processes(), self.process_index());
        let (each, extra) = (len / n, len % n);
        let start = (r * each + r.min(extra)).min(len);
        let end = (start + each + usize::from(r < extra)).min(len);
        (start, end, each + usize::from(extra > 0))
    }

    /// Raises this process's flag for [`check_trigger`](Self::check_trigger)
    /// (Accelerate's `set_trigger`): one process deciding to stop early can
    /// make every process stop at the same step.
    pub fn set_trigger(&self) {
        self.trigger.store(true, Ordering::Relaxed);
    }

    /// True on every process when any process called
    /// [`set_trigger`](Self::set_trigger) since the last check, which
    /// lowers the flags again (Accelerate's `check_trigger`). All
    /// processes must call it at the same point.
    ///
    /// ```no_run
    /// # fn demo(acc: &hearth::accelerator::Accelerator, loss: f64) -> Result<(), hearth::comm::DistError> {
    /// if loss.is_nan() {
    ///     acc.set_trigger();
    /// }
    /// if acc.check_trigger()? {
    ///     return Ok(()); // every process leaves the loop here
    /// }
    /// # Ok(()) }
    /// ```
    pub fn check_trigger(&self) -> Result<bool, DistError> {
        let mine = i64::from(self.trigger.load(Ordering::Relaxed));
        let raised = self.reduce(&Tensor::from_slice(&[mine]), ReduceOp::Sum)?;
        let any = raised.int64_value(&[0]) >= 1;
        if any {
            self.trigger.store(false, Ordering::Relaxed);
        }
        Ok(any)
    }

    /// Runs `f` on the main process first and on the others once it has
    /// finished (Accelerate's `main_process_first`): downloads, caches and
    /// dataset preparation are done once and then read by everyone.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R, DistError> {
        self.goes_first(self.is_main_process(), f)
    }

    /// Runs `f` on the first process of each machine first and on the
    /// others after it (Accelerate's `local_main_process_first`; as there,
    /// the processes wait for each other across machines).
    pub fn local_main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R, DistError> {
        self.goes_first(self.is_local_main_process(), f)
    }

    fn goes_first<R>(&self, first: bool, f: impl FnOnce() -> R) -> Result<R, DistError> {
        if !first {
            self.wait_for_everyone()?;
        }
        let result = f();
        if first {
            self.wait_for_everyone()?;
        }
        Ok(result)
    }

    /// Runs `f` on the process of index `process_index` only
    /// (Accelerate's `on_process`).
    pub fn on_process<R>(&self, process_index: usize, f: impl FnOnce() -> R) -> Option<R> {
        (self.process_index() == process_index).then(f)
    }

    /// Runs `f` on the process of index `local_process_index` of each
    /// machine only (Accelerate's `on_local_process`).
    pub fn on_local_process<R>(
        &self,
        local_process_index: usize,
        f: impl FnOnce() -> R,
    ) -> Option<R> {
        (self.local_process_index() == local_process_index).then(f)
    }

    /// Runs `f` on the last process only (Accelerate's `on_last_process`).
    pub fn on_last_process<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        self.on_process(self.num_processes() - 1, f)
    }

    /// Gives every process the main process's random generators: the CPU
    /// generator and, on a GPU, this process's device generator
    /// (Accelerate's `synchronize_rng_states`). Draws after it are the
    /// same on every process.
    pub fn synchronize_rng_state(&self) -> Result<(), DistError> {
        self.synchronize_rng_states(&[RngType::Torch, RngType::Cuda])
    }

    /// [`synchronize_rng_state`](Self::synchronize_rng_state) for the
    /// generators `rng_types` name (Accelerate's `synchronize_rng_states(
    /// rng_types)`): `Torch` the CPU generator, `Cuda` this process's GPU
    /// generator (nothing on a CPU process), `Generator` nothing — a
    /// prepared loader's order comes from its seed and the epoch, the same
    /// on every process, where Accelerate's comes from a generator it must
    /// synchronise.
    pub fn synchronize_rng_states(&self, rng_types: &[RngType]) -> Result<(), DistError> {
        let mut devices = Vec::new();
        for t in rng_types {
            match t {
                RngType::Torch => devices.push(Device::Cpu),
                RngType::Cuda if self.device.is_cuda() => devices.push(self.device),
                RngType::Cuda | RngType::Generator => {}
            }
        }
        devices.dedup();
        let failed = |e: tch::TchError| DistError::Mismatch {
            op: "synchronize_rng_state",
            rank: self.process_index(),
            message: e.to_string(),
        };
        for device in devices {
            let state = ops::rng_state(device).map_err(failed)?.contiguous();
            let bytes = crate::checkpoint::tensor_bytes(&state).to_vec();
            let main = self.group.broadcast_bytes(bytes, 0)?;
            let main = Tensor::from_data_size(&main, &[main.len() as i64], state.kind());
            ops::set_rng_state(device, &main).map_err(failed)?;
        }
        Ok(())
    }
}

/// `f` applied to every tensor of `value` in [`TensorTree::tensors`]'s
/// order, the structure kept: a collective over a nested value, one tensor
/// at a time (the same order on every process).
fn each_tensor<T: TensorTree>(
    value: &T,
    f: impl FnMut(&Tensor) -> Result<Tensor, DistError>,
) -> Result<T, DistError> {
    let done = value
        .tensors()
        .into_iter()
        .map(f)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(T::from_tensors(&value.shape(), &mut done.into_iter())
        .expect("one tensor back for each of the structure's"))
}
