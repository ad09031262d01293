//! The data loader: datasets (map-style and iterable), batching with a
//! seedable shuffle, sharding by process, `skip_first_batches`, and a state
//! that a checkpoint saves so a resumed run sees exactly the batches it
//! would have seen.

use super::sampler::{batches, epoch_order, shard_batches, Shard};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// A dataset with a length whose items are read by index (PyTorch's
/// map-style `Dataset`).
pub trait Dataset {
    /// One example.
    type Item;
    /// Number of examples.
    fn len(&self) -> usize;
    /// The example at `index` (`0..len()`).
    fn get(&self, index: usize) -> Self::Item;
    /// True when there are no examples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A vector of examples is a dataset (tensors are cloned shallowly: the
/// batch shares their storage until collated).
impl<T: CloneItem> Dataset for Vec<T> {
    type Item = T;
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    fn get(&self, index: usize) -> T {
        self[index].clone_item()
    }
}

/// Examples a `Vec` dataset hands out copies of.
pub trait CloneItem {
    /// A copy that may share storage.
    fn clone_item(&self) -> Self;
}

impl CloneItem for Tensor {
    fn clone_item(&self) -> Self {
        self.shallow_clone()
    }
}

impl<A: CloneItem, B: CloneItem> CloneItem for (A, B) {
    fn clone_item(&self) -> Self {
        (self.0.clone_item(), self.1.clone_item())
    }
}

impl CloneItem for Vec<Tensor> {
    fn clone_item(&self) -> Self {
        self.iter().map(Tensor::shallow_clone).collect()
    }
}

/// A dataset read as a stream (PyTorch's `IterableDataset`): a fresh
/// stream each epoch, possibly endless.
pub trait IterableDataset {
    /// One example.
    type Item;
    /// The examples of `epoch`, in order.
    fn stream(&self, epoch: u64) -> Box<dyn Iterator<Item = Self::Item> + '_>;
}

/// Turns the examples of a batch into one value (PyTorch's `collate_fn`).
pub trait Collate: Sized {
    /// Joins `items` (never empty) into a batch.
    fn collate(items: Vec<Self>) -> Self;
}

impl Collate for Tensor {
    /// Stacks along a new first dimension.
    fn collate(items: Vec<Self>) -> Self {
        Tensor::stack(&items, 0)
    }
}

impl<A: Collate, B: Collate> Collate for (A, B) {
    fn collate(items: Vec<Self>) -> Self {
        let (a, b) = items.into_iter().unzip();
        (A::collate(a), B::collate(b))
    }
}

impl Collate for Vec<Tensor> {
    /// Stacks position by position (every item has the same length).
    fn collate(items: Vec<Self>) -> Self {
        let width = items[0].len();
        let mut columns: Vec<Vec<Tensor>> = (0..width).map(|_| Vec::new()).collect();
        for item in items {
            for (column, t) in columns.iter_mut().zip(item) {
                column.push(t);
            }
        }
        columns.into_iter().map(Tensor::collate).collect()
    }
}

/// Where a loader stands: saved in checkpoints, restored on resume.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Epochs completed (the epoch now being read, counting from 0).
    pub epoch: u64,
    /// Batches this process has taken from the current epoch.
    pub batches_seen: usize,
    /// The shuffle seed (an epoch's order uses `seed + epoch`).
    pub seed: u64,
}

/// How batches are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderOptions {
    /// Examples per batch (per process unless the loader splits batches).
    pub batch_size: usize,
    /// Shuffle each epoch (map-style datasets).
    pub shuffle: bool,
    /// Drop the last batch when it is short.
    pub drop_last: bool,
    /// Seed of the shuffle.
    pub seed: u64,
}

/// Examples grouped into batches, epoch after epoch.
pub trait BatchSource {
    /// One example.
    type Item: Collate;
    /// The index-free batches of `epoch` for this process.
    fn batches(
        &self,
        options: &LoaderOptions,
        shard: Shard,
        epoch: u64,
    ) -> Box<dyn Iterator<Item = Vec<Self::Item>> + '_>;
    /// Batches per epoch for this process, when known.
    fn num_batches(&self, options: &LoaderOptions, shard: Shard) -> Option<usize>;
    /// Examples per epoch over all processes, when known.
    fn num_examples(&self) -> Option<usize> {
        None
    }
}

/// A map-style dataset as a batch source.
pub struct MapStyle<D>(pub D);

impl<D: Dataset> BatchSource for MapStyle<D>
where
    D::Item: Collate,
{
    type Item = D::Item;
    fn batches(
        &self,
        o: &LoaderOptions,
        shard: Shard,
        epoch: u64,
    ) -> Box<dyn Iterator<Item = Vec<D::Item>> + '_> {
        let order = epoch_order(self.0.len(), o.shuffle, o.seed, epoch);
        let all = batches(&order, o.batch_size, o.drop_last);
        let mine = shard_batches(&all, o.batch_size, o.drop_last, shard);
        Box::new(
            mine.into_iter()
                .map(move |b| b.into_iter().map(|i| self.0.get(i)).collect()),
        )
    }
    fn num_examples(&self) -> Option<usize> {
        Some(self.0.len())
    }
    fn num_batches(&self, o: &LoaderOptions, shard: Shard) -> Option<usize> {
        let order: Vec<usize> = (0..self.0.len()).collect();
        let all = batches(&order, o.batch_size, o.drop_last);
        Some(shard_batches(&all, o.batch_size, o.drop_last, shard).len())
    }
}

/// An iterable dataset as a batch source: each process takes its slice of
/// every `batch_size × num_processes` examples (of every `batch_size` when
/// batches are split), as Accelerate's `IterableDatasetShard`; a short tail
/// is dropped with `drop_last`, else (with several processes) completed
/// from the epoch's first examples.
pub struct Stream<I>(pub I);

impl<I: IterableDataset> BatchSource for Stream<I>
where
    I::Item: Collate + CloneItem,
{
    type Item = I::Item;
    fn batches(
        &self,
        o: &LoaderOptions,
        shard: Shard,
        epoch: u64,
    ) -> Box<dyn Iterator<Item = Vec<I::Item>> + '_> {
        let n = shard.num_processes.max(1);
        let (chunk, per) = if shard.split_batches {
            (o.batch_size, o.batch_size / n)
        } else {
            (o.batch_size * n, o.batch_size)
        };
        let mut stream = self.0.stream(epoch);
        let mut first: Vec<I::Item> = Vec::new();
        let (drop_last, index) = (o.drop_last, shard.process_index);
        Box::new(std::iter::from_fn(move || {
            let mut buf: Vec<I::Item> = stream.by_ref().take(chunk).collect();
            if buf.is_empty() {
                return None;
            }
            if first.is_empty() {
                first = buf.iter().map(CloneItem::clone_item).collect();
            }
            if buf.len() < chunk {
                if drop_last {
                    return None;
                }
                if n == 1 {
                    // A world of one is not sharded: the tail stays short.
                    return Some(buf);
                }
                let mut i = 0;
                while buf.len() < chunk {
                    buf.push(first[i % first.len()].clone_item());
                    i += 1;
                }
            }
            Some(buf.drain(per * index..per * (index + 1)).collect())
        }))
    }
    fn num_batches(&self, _: &LoaderOptions, _: Shard) -> Option<usize> {
        None
    }
}

/// Batches from a [`BatchSource`], with state. Iterating reads the current
/// epoch from where the state says (skipping what was seen before a resume
/// and what [`skip_first_batches`](Self::skip_first_batches) asked); a
/// fully read epoch moves the state to the next one.
pub struct DataLoader<S> {
    source: S,
    options: LoaderOptions,
    shard: Shard,
    state: Arc<Mutex<LoaderState>>,
    skip_once: Arc<Mutex<usize>>,
}

impl<D: Dataset> DataLoader<MapStyle<D>>
where
    D::Item: Collate,
{
    /// A loader over a map-style dataset: batches of `batch_size`, in order,
    /// last batch kept, seed 0 (see the setters).
    pub fn new(dataset: D, batch_size: usize) -> Self {
        Self::from_source(MapStyle(dataset), batch_size)
    }
}

impl<I: IterableDataset> DataLoader<Stream<I>>
where
    I::Item: Collate + CloneItem,
{
    /// A loader over an iterable dataset.
    pub fn iterable(dataset: I, batch_size: usize) -> Self {
        Self::from_source(Stream(dataset), batch_size)
    }
}

impl<S: BatchSource> DataLoader<S> {
    fn from_source(source: S, batch_size: usize) -> Self {
        assert!(batch_size > 0, "a batch holds at least one example");
        Self {
            source,
            options: LoaderOptions {
                batch_size,
                shuffle: false,
                drop_last: false,
                seed: 0,
            },
            shard: Shard::default(),
            state: Arc::default(),
            skip_once: Arc::default(),
        }
    }

    /// Shuffles each epoch with the order `torch.randperm` gives for a
    /// generator seeded with `seed + epoch`.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.options.shuffle = true;
        self.options.seed = seed;
        self.state.lock().unwrap().seed = seed;
        self
    }

    /// Drops the last batch of an epoch when it is short.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.options.drop_last = drop_last;
        self
    }

    /// Reads only this process's share of every epoch (set by the
    /// accelerator's `prepare`, which checks what this asserts: with
    /// `split_batches` the batch size divides by the number of processes).
    pub fn sharded(mut self, shard: Shard) -> Self {
        if shard.split_batches && shard.num_processes > 1 {
            assert!(
                self.options.batch_size % shard.num_processes == 0,
                "split_batches: batch size {} does not divide by {} processes",
                self.options.batch_size,
                shard.num_processes
            );
        }
        self.shard = shard;
        self
    }

    /// How batches are formed.
    pub fn options(&self) -> LoaderOptions {
        self.options
    }

    /// How the epoch is shared between processes.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Batches per epoch for this process (map-style datasets).
    pub fn len(&self) -> Option<usize> {
        self.source.num_batches(&self.options, self.shard)
    }

    /// Real examples in the epoch's last global batch (Accelerate's
    /// `remainder`): the rest were repeated from the start of the epoch to
    /// fill every process's batch, and `gather_for_metrics` drops them.
    /// `None` with `drop_last` or when the number of examples is unknown;
    /// `Some(0)` when the last global batch is full.
    pub fn remainder(&self) -> Option<usize> {
        if self.options.drop_last {
            return None;
        }
        let total_batch = if self.shard.split_batches {
            self.options.batch_size
        } else {
            self.options.batch_size * self.shard.num_processes.max(1)
        };
        Some(self.source.num_examples()? % total_batch)
    }

    /// True when an epoch holds no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == Some(0)
    }

    /// A handle to this loader's state that outlives borrows of the loader
    /// (the accelerator keeps one to save and restore it).
    pub fn handle(&self) -> LoaderHandle {
        LoaderHandle {
            state: self.state.clone(),
            skip_once: self.skip_once.clone(),
        }
    }

    /// Where the loader stands.
    pub fn state(&self) -> LoaderState {
        *self.state.lock().unwrap()
    }

    /// Continues from `state` (from [`state`](Self::state) of an earlier run):
    /// the next iteration reads the rest of that epoch, in that seed's order.
    pub fn load_state(&self, state: LoaderState) {
        self.handle().load_state(state)
    }

    /// Skips `n` more batches at the start of the next iteration only (for
    /// resuming mid-epoch, Accelerate's `skip_first_batches`).
    pub fn skip_first_batches(&self, n: usize) {
        *self.skip_once.lock().unwrap() += n;
    }

    /// Reads the current epoch: from its start, less what
    /// [`load_state`](Self::load_state) or
    /// [`skip_first_batches`](Self::skip_first_batches) asked to skip. An
    /// iteration left early reads the same epoch again next time (as
    /// Accelerate does); handing out an epoch's last batch moves the state
    /// to the next epoch. The iterator knows, after each batch, whether it
    /// was the epoch's last ([`Batches::at_end`]): it reads one batch ahead.
    pub fn iter(&self) -> Batches<'_, S> {
        self.iter_as(self.shard)
    }

    /// [`iter`](Self::iter) shared between processes as `shard` says, for
    /// this epoch only (`join_uneven_inputs` overriding `even_batches`).
    pub(crate) fn iter_as(&self, shard: Shard) -> Batches<'_, S> {
        let skip = std::mem::take(&mut *self.skip_once.lock().unwrap());
        let state = {
            let mut state = self.state.lock().unwrap();
            state.batches_seen = skip;
            *state
        };
        let options = LoaderOptions {
            seed: state.seed,
            ..self.options
        };
        let mut inner = self.source.batches(&options, shard, state.epoch);
        for _ in 0..skip {
            if inner.next().is_none() {
                break;
            }
        }
        let ahead = inner.next().map(S::Item::collate);
        Batches {
            at_end: ahead.is_none(),
            inner,
            ahead,
            state: &self.state,
            yielded: false,
        }
    }
}

/// A shared handle to a loader's state; see [`DataLoader::handle`].
#[derive(Debug, Clone)]
pub struct LoaderHandle {
    state: Arc<Mutex<LoaderState>>,
    skip_once: Arc<Mutex<usize>>,
}

impl LoaderHandle {
    /// Where the loader stands.
    pub fn state(&self) -> LoaderState {
        *self.state.lock().unwrap()
    }

    /// As [`DataLoader::load_state`].
    pub fn load_state(&self, state: LoaderState) {
        *self.state.lock().unwrap() = state;
        *self.skip_once.lock().unwrap() = state.batches_seen;
    }
}

/// One epoch of batches; see [`DataLoader::iter`].
pub struct Batches<'a, S: BatchSource> {
    inner: Box<dyn Iterator<Item = Vec<S::Item>> + 'a>,
    ahead: Option<S::Item>,
    state: &'a Mutex<LoaderState>,
    at_end: bool,
    yielded: bool,
}

impl<S: BatchSource> Batches<'_, S> {
    /// True once the batch last returned is the epoch's last.
    pub fn at_end(&self) -> bool {
        self.at_end
    }

    fn next_epoch(&self) {
        let mut state = self.state.lock().unwrap();
        state.epoch += 1;
        state.batches_seen = 0;
    }
}

impl<S: BatchSource> Iterator for Batches<'_, S> {
    type Item = S::Item;
    fn next(&mut self) -> Option<S::Item> {
        let Some(current) = self.ahead.take() else {
            if !self.yielded {
                // An epoch with nothing (left) to read is over too.
                self.yielded = true;
                self.next_epoch();
            }
            return None;
        };
        self.yielded = true;
        self.ahead = self.inner.next().map(S::Item::collate);
        self.at_end = self.ahead.is_none();
        if self.at_end {
            self.next_epoch();
        } else {
            self.state.lock().unwrap().batches_seen += 1;
        }
        Some(current)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct RangeStream(i64);
    impl IterableDataset for RangeStream {
        type Item = Tensor;
        fn stream(&self, _: u64) -> Box<dyn Iterator<Item = Tensor> + '_> {
            Box::new((0..self.0).map(Tensor::from))
        }
    }

    #[test]
    fn the_remainder_counts_the_real_examples_of_the_last_global_batch() {
        let ids = || (0..9).map(|i| Tensor::from(i as i64)).collect::<Vec<_>>();
        let shard = |split_batches| Shard {
            process_index: 0,
            num_processes: 2,
            split_batches,
            even_batches: true,
        };
        assert_eq!(
            DataLoader::new(ids(), 5).sharded(shard(false)).remainder(),
            Some(9)
        );
        assert_eq!(
            DataLoader::new(ids(), 4).sharded(shard(true)).remainder(),
            Some(1)
        );
        assert_eq!(DataLoader::new(ids(), 3).remainder(), Some(0));
        let dropped = DataLoader::new(ids(), 5).drop_last(true);
        assert_eq!(dropped.sharded(shard(false)).remainder(), None);
        let stream = DataLoader::iterable(RangeStream(9), 5);
        assert_eq!(
            stream.remainder(),
            None,
            "an iterable dataset's length is unknown"
        );
    }

    #[test]
    fn collate_stacks_tensors_pairs_and_lists_field_by_field() {
        let t = |v: &[f32]| Tensor::from_slice(v);
        let stacked = Tensor::collate(vec![t(&[1.0, 2.0]), t(&[3.0, 4.0])]);
        assert_eq!(stacked.size(), [2, 2]);
        let (a, b) =
            <(Tensor, Tensor)>::collate(vec![(t(&[1.0]), t(&[2.0])), (t(&[3.0]), t(&[4.0]))]);
        assert_eq!(
            Vec::<f32>::try_from(a.flatten(0, -1)).unwrap(),
            vec![1.0, 3.0]
        );
        assert_eq!(
            Vec::<f32>::try_from(b.flatten(0, -1)).unwrap(),
            vec![2.0, 4.0]
        );
        let cols = Vec::<Tensor>::collate(vec![
            vec![t(&[1.0]), t(&[5.0, 6.0])],
            vec![t(&[2.0]), t(&[7.0, 8.0])],
        ]);
        assert_eq!(cols[0].size(), [2, 1]);
        assert_eq!(
            Vec::<f32>::try_from(cols[1].flatten(0, -1)).unwrap(),
            vec![5.0, 6.0, 7.0, 8.0]
        );
    }
}
