//! `PreparedDataLoader`: a data loader sharded for this process that tells
//! the gradient state when its epoch ends and puts batches on the device;
//! with `dispatch_batches`, the main process reads and every process gets
//! its slice (Accelerate's `DataLoaderDispatcher`).

use super::{GradientState, TensorTree, TreeShape};
use crate::data::{BatchSource, Batches, DataLoader, LoaderState};
use hearth_comm::{DistError, ProcessGroup};
use tch::{Device, Kind, Tensor};

/// A data loader prepared by the accelerator (Accelerate's
/// `DataLoaderShard`): it reads this process's share of each epoch, moves
/// each batch to the device, and marks the last batch of an epoch so that
/// accumulation syncs there.
pub struct PreparedDataLoader<S> {
    inner: DataLoader<S>,
    state: GradientState,
    /// Where batches go (`None`: nowhere, `device_placement` off), and
    /// whether without waiting.
    device: Option<Device>,
    non_blocking: bool,
    /// With `dispatch_batches` in a world of several processes: the
    /// channel the main process sends batches through.
    dispatch: Option<Box<dyn ProcessGroup>>,
}

impl<S: BatchSource> PreparedDataLoader<S>
where
    S::Item: TensorTree,
{
    pub(super) fn new(
        inner: DataLoader<S>,
        state: GradientState,
        device: Option<Device>,
        non_blocking: bool,
        dispatch: Option<Box<dyn ProcessGroup>>,
    ) -> Self {
        Self {
            inner,
            state,
            device,
            non_blocking,
            dispatch,
        }
    }

    /// The device batches are put on; `None` with `device_placement` off.
    pub fn device(&self) -> Option<Device> {
        self.device
    }

    /// Reads the current epoch (see [`DataLoader::iter`]). A dispatching
    /// loader reads it on the main process only, and every process must
    /// iterate it at the same point: each batch is a collective.
    ///
    /// # Panics
    /// When dispatching a batch fails (a process stopped or hangs past the
    /// timeout); iterate [`try_iter`](Self::try_iter) to handle that.
    pub fn iter(&self) -> PreparedBatches<'_, S> {
        self.state.set_end_of_dataloader(false);
        let source = match &self.dispatch {
            Some(group) => {
                self.state.set_remainder(None);
                Source::Dispatched(Dispatcher {
                    group: group.as_ref(),
                    batches: (group.process_index() == 0).then(|| self.inner.iter()),
                    per_step: if self.inner.shard().split_batches {
                        1
                    } else {
                        group.num_processes()
                    },
                    drop_last: self.inner.options().drop_last,
                    ahead: None,
                    first: None,
                    done: false,
                })
            }
            None => {
                self.state.set_remainder(self.inner.remainder());
                let mut shard = self.inner.shard();
                if let Some(even) = self.state.even_batches_override() {
                    shard.even_batches = even;
                }
                Source::Local(self.inner.iter_as(shard))
            }
        };
        PreparedBatches {
            source,
            state: self.state.clone(),
            device: self.device,
            non_blocking: self.non_blocking,
        }
    }

    /// [`iter`](Self::iter) whose items are `Err` when dispatching a batch
    /// fails (a process stopped, or hangs past the timeout); the epoch
    /// ends after the error.
    pub fn try_iter(&self) -> TryPreparedBatches<'_, S> {
        TryPreparedBatches(self.iter())
    }

    /// True when the main process reads the batches and sends every
    /// process its slice (`dispatch_batches`).
    pub fn dispatches(&self) -> bool {
        self.dispatch.is_some()
    }

    /// The wrapped loader (its options, shard and length).
    pub fn inner(&self) -> &DataLoader<S> {
        &self.inner
    }

    /// Where the loader stands, for checkpoints.
    pub fn state(&self) -> LoaderState {
        self.inner.state()
    }

    /// Continues from a saved state.
    pub fn load_state(&self, state: LoaderState) {
        self.inner.load_state(state)
    }

    /// Skips `n` batches at the start of the next epoch read only.
    pub fn skip_first_batches(&self, n: usize) {
        self.inner.skip_first_batches(n)
    }

    /// Gives the wrapped loader back.
    pub fn into_inner(self) -> DataLoader<S> {
        self.inner
    }
}

/// One epoch of a prepared loader. Dropping it (a loop left early) clears
/// the end-of-epoch mark, so later micro-batches accumulate normally.
pub struct PreparedBatches<'a, S: BatchSource> {
    source: Source<'a, S>,
    state: GradientState,
    device: Option<Device>,
    non_blocking: bool,
}

enum Source<'a, S: BatchSource> {
    /// This process reads its own share.
    Local(Batches<'a, S>),
    /// The main process reads, every process gets its slice.
    Dispatched(Dispatcher<'a, S>),
}

impl<S: BatchSource> Iterator for PreparedBatches<'_, S>
where
    S::Item: TensorTree,
{
    type Item = S::Item;
    fn next(&mut self) -> Option<S::Item> {
        self.try_next().unwrap_or_else(|e| {
            panic!("dispatch_batches: {e} (iterate the loader's try_iter() to handle this)")
        })
    }
}

/// One epoch of a prepared loader whose batches are `Err` when
/// dispatching one fails ([`PreparedDataLoader::try_iter`]).
pub struct TryPreparedBatches<'a, S: BatchSource>(PreparedBatches<'a, S>);

impl<S: BatchSource> Iterator for TryPreparedBatches<'_, S>
where
    S::Item: TensorTree,
{
    type Item = Result<S::Item, DistError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.0.try_next().transpose()
    }
}

impl<S: BatchSource> PreparedBatches<'_, S>
where
    S::Item: TensorTree,
{
    /// The next batch, or why dispatching it failed (the epoch then ends).
    fn try_next(&mut self) -> Result<Option<S::Item>, DistError> {
        let next = match &mut self.source {
            Source::Local(batches) => batches.next().map(|batch| Slice {
                batch,
                last: batches.at_end(),
                real_rows: None,
            }),
            Source::Dispatched(d) => match d.next() {
                Ok(slice) => slice,
                Err(e) => {
                    d.done = true;
                    self.state.set_end_of_dataloader(false);
                    return Err(e);
                }
            },
        };
        Ok(match next {
            Some(slice) => {
                if let Some(rows) = slice.real_rows {
                    self.state.set_remainder(Some(rows));
                }
                self.state.set_end_of_dataloader(slice.last);
                Some(match self.device {
                    Some(device) => slice.batch.send_to_device(device, self.non_blocking, &[]),
                    None => slice.batch,
                })
            }
            None => {
                self.state.set_end_of_dataloader(false);
                None
            }
        })
    }
}

impl<S: BatchSource> Drop for PreparedBatches<'_, S> {
    fn drop(&mut self) {
        self.state.set_end_of_dataloader(false);
    }
}

/// What the main process announces before each dispatched batch.
#[derive(serde::Serialize, serde::Deserialize)]
struct Announcement {
    /// The batch; `None` when the epoch is over.
    batch: Option<AnnouncedBatch>,
    /// Whether it is the epoch's last.
    last: bool,
}

/// A batch's structure and each tensor's kind and size.
#[derive(serde::Serialize, serde::Deserialize)]
struct AnnouncedBatch {
    shape: TreeShape,
    tensors: Vec<(String, Vec<i64>)>,
}

/// One process's slice of a dispatched batch.
struct Slice<T> {
    batch: T,
    /// The epoch's last batch.
    last: bool,
    /// On the last batch: its real rows (the rest repeat the first batch).
    real_rows: Option<usize>,
}

/// Accelerate's `DataLoaderDispatcher`: the main process concatenates
/// `per_step` batches of its loader (one with `split_batches`), sends the
/// result to every process, and each keeps rows `rank·k..(rank+1)·k`. A
/// short last batch that does not divide by the number of processes is
/// completed with the first rows of the epoch's first batch (unless
/// `drop_last`), and `gather_for_metrics` keeps only its real rows.
struct Dispatcher<'a, S: BatchSource> {
    group: &'a dyn ProcessGroup,
    /// The loader, on the main process only.
    batches: Option<Batches<'a, S>>,
    per_step: usize,
    drop_last: bool,
    /// The main process's next batch, read one ahead to know the last.
    ahead: Option<Option<S::Item>>,
    /// The first rows of the epoch's first batch.
    first: Option<S::Item>,
    done: bool,
}

impl<S: BatchSource> Dispatcher<'_, S>
where
    S::Item: TensorTree,
{
    /// The main process's next global batch: `per_step` batches joined;
    /// fewer at the end unless `drop_last`.
    fn read(&mut self) -> Option<S::Item> {
        let batches = self.batches.as_mut()?;
        let parts: Vec<S::Item> = batches.by_ref().take(self.per_step).collect();
        if parts.is_empty() || (parts.len() < self.per_step && self.drop_last) {
            return None;
        }
        Some(S::Item::concatenate(parts))
    }

    /// This process's slice of the next batch.
    fn next(&mut self) -> Result<Option<Slice<S::Item>>, DistError> {
        if self.done {
            return Ok(None);
        }
        let main = self.batches.is_some();
        let (current, last) = if main {
            let current = match self.ahead.take() {
                Some(batch) => batch,
                None => self.read(),
            };
            let next = self.read();
            let last = next.is_none();
            self.ahead = Some(next);
            (current, last)
        } else {
            (None, false)
        };
        let announcement = Announcement {
            batch: current.as_ref().map(|b| AnnouncedBatch {
                shape: b.shape(),
                tensors: b
                    .tensors()
                    .iter()
                    .map(|t| (format!("{:?}", t.kind()), t.size()))
                    .collect(),
            }),
            last,
        };
        let bytes = serde_json::to_vec(&announcement).expect("an announcement serialises");
        let heard = self.group.broadcast_bytes(bytes, 0)?;
        let mismatch = |message: String| DistError::Mismatch {
            op: "dispatch_batches",
            rank: self.group.process_index(),
            message,
        };
        let heard: Announcement = serde_json::from_slice(&heard)
            .map_err(|e| mismatch(format!("the main process's announcement: {e}")))?;
        let Some(AnnouncedBatch {
            shape,
            tensors: leaves,
        }) = heard.batch
        else {
            self.done = true;
            return Ok(None);
        };
        // Every process receives the main process's tensors.
        let mine: Vec<Tensor> = match &current {
            Some(batch) => batch
                .tensors()
                .into_iter()
                .map(|t| t.to_device(Device::Cpu).contiguous())
                .collect(),
            None => leaves
                .iter()
                .map(|(kind, size)| {
                    let kind = parse_kind(kind)
                        .ok_or_else(|| mismatch(format!("unknown tensor kind {kind}")))?;
                    Ok(Tensor::empty(size.as_slice(), (kind, Device::Cpu)))
                })
                .collect::<Result<_, DistError>>()?,
        };
        let mut received = Vec::with_capacity(mine.len());
        for mut t in mine {
            self.group.broadcast(&mut t, 0)?;
            received.push(t);
        }
        let mut batch = S::Item::from_tensors(&shape, &mut received.into_iter())
            .ok_or_else(|| mismatch("the batch does not fit the announced structure".into()))?;
        let n = self.group.num_processes();
        if self.first.is_none() && !self.drop_last {
            self.first = Some(batch.slice_rows(0, n as i64));
        }
        let observed = batch
            .tensors()
            .iter()
            .find(|t| t.dim() > 0)
            .map_or(0, |t| t.size()[0] as usize);
        let mut each = observed / n;
        if heard.last && !self.drop_last && observed % n != 0 {
            if let Some(first) = &self.first {
                batch = S::Item::concatenate(vec![batch, first.slice_rows(0, n as i64)]);
                each += 1;
            }
        }
        let r = self.group.process_index();
        let slice = batch.slice_rows((r * each) as i64, ((r + 1) * each) as i64);
        if heard.last {
            self.done = true;
        }
        Ok(Some(Slice {
            batch: slice,
            last: heard.last,
            real_rows: heard.last.then_some(observed),
        }))
    }
}

/// The libtorch kind `format!("{kind:?}")` printed.
fn parse_kind(name: &str) -> Option<Kind> {
    use Kind::*;
    [
        Uint8, Int8, Int16, Int, Int64, Half, Float, Double, Bool, BFloat16,
    ]
    .into_iter()
    .find(|k| format!("{k:?}") == name)
}
