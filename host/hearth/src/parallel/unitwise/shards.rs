//! Unit-wise execution's shard units: which ones each model unit needs,
//! gathering them (or finishing a prefetched gather), prefetching,
//! releasing or freeing them, and reduce-scattering their gradients.

use super::execution::{under, Uses};
use super::full_shard::Ahead;
use super::{FullShard, Prefetch, Unitwise, UnitwiseError};
use crate::models::Model;
use crate::parallel::sharded::{self, UnitShard};
use tch::Kind;

impl Unitwise {
    pub(super) fn compute_uses(&self, model: &dyn Model) {
        if self.uses.borrow().is_some() {
            return;
        }
        let units = self.full_shard.as_ref().map_or(&[][..], |f| &f.units[..]);
        let mut first = vec![None; units.len()];
        let mut last = vec![None; units.len()];
        let per_unit = model
            .units()
            .iter()
            .enumerate()
            .map(|(k, unit)| {
                let modules = unit.modules();
                let needed: Vec<usize> = units
                    .iter()
                    .enumerate()
                    .filter(|(_, u)| u.params.iter().any(|p| under(&p.name, &modules)))
                    .map(|(i, _)| i)
                    .collect();
                for &i in &needed {
                    first[i].get_or_insert(k);
                    last[i] = Some(k);
                }
                needed
            })
            .collect();
        *self.uses.borrow_mut() = Some(Uses {
            per_unit,
            first,
            last,
        });
    }

    /// The kind shard unit `unit` is gathered in: `exact`ly (the shards'
    /// own kind, for saving and loading), else for use.
    fn gather_kind(fs: &FullShard, unit: &UnitShard, exact: bool) -> Kind {
        match fs.policy {
            Some(policy) if !exact => policy.param_dtype.kind(),
            _ => unit.shard_kind(),
        }
    }

    /// Gathers the units `which` (see [`gather_kind`](Self::gather_kind)),
    /// finishing those whose all-gather is in `ahead` (prefetched).
    pub(super) fn gather_as<'g>(
        &'g self,
        which: &[usize],
        exact: bool,
        ahead: &mut Ahead<'g>,
    ) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        for &i in which {
            let unit = &fs.units[i];
            let dist = |source| UnitwiseError::Dist {
                op: "all-gather",
                unit: unit.path.clone(),
                source,
            };
            let bytes = match ahead.iter().position(|(j, _)| *j == i) {
                Some(at) => {
                    let (_, pending) = ahead.remove(at);
                    unit.gather_finish(pending.wait().map_err(dist)?);
                    0 // counted when it started
                }
                None if unit.is_gathered_in(Self::gather_kind(fs, unit, exact)) => continue,
                None => unit
                    .gather(fs.group.as_ref(), Self::gather_kind(fs, unit, exact))
                    .map_err(dist)?,
            };
            let whole: Vec<&UnitShard> = fs.units.iter().filter(|u| u.is_gathered()).collect();
            let held_bytes = whole.iter().map(|u| u.whole_bytes()).sum::<u64>();
            self.count(|s| {
                s.gathers += 1;
                s.gather_bytes += bytes;
                if whole.len() as u64 >= s.most_gathered {
                    s.most_gathered = whole.len() as u64;
                    s.most_gathered_bytes = s.most_gathered_bytes.max(held_bytes);
                }
            });
        }
        Ok(())
    }

    /// Starts the all-gathers, for use, of the units `which` that are
    /// neither gathered nor started yet (a prefetch), into `ahead`.
    pub(super) fn prefetch<'g>(
        &'g self,
        which: &[usize],
        ahead: &mut Ahead<'g>,
    ) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        for &i in which {
            let unit = &fs.units[i];
            let kind = Self::gather_kind(fs, unit, false);
            if unit.is_gathered_in(kind) || ahead.iter().any(|(j, _)| *j == i) {
                continue;
            }
            let (pending, bytes) =
                unit.gather_start(fs.group.as_ref(), kind)
                    .map_err(|source| UnitwiseError::Dist {
                        op: "all-gather",
                        unit: unit.path.clone(),
                        source,
                    })?;
            ahead.push((i, pending));
            self.count(|s| {
                s.prefetched += 1;
                s.gather_bytes += bytes;
            });
        }
        Ok(())
    }

    /// The forward and backward prefetch settings (none without FULL_SHARD).
    pub(super) fn prefetching(&self) -> Prefetch {
        self.full_shard
            .as_ref()
            .map_or(Prefetch::default(), |f| f.prefetch)
    }

    /// Gathers every shard unit whole (FSDP's `summon_full_params`): for
    /// saving, loading and unwrapping. Nothing without FULL_SHARD.
    pub fn gather_all(&self) -> Result<(), UnitwiseError> {
        let n = self.full_shard.as_ref().map_or(0, |f| f.units.len());
        self.gather_as(&(0..n).collect::<Vec<_>>(), true, &mut Vec::new())
    }

    /// Runs `f` on each shard unit in turn, its whole parameters gathered
    /// for it and released after it (unless held before): at most one
    /// unit more than before is whole at any time. Nothing without
    /// FULL_SHARD.
    pub fn each_unit_whole(&self, mut f: impl FnMut(&UnitShard)) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        for (i, unit) in fs.units.iter().enumerate() {
            let held = self.gather_unit(i)?;
            f(unit);
            if !held {
                unit.release();
            }
        }
        Ok(())
    }

    /// Gathers shard unit `i` whole, in its shards' own kind (for saving
    /// and loading), unless it is whole already: whether it was.
    pub fn gather_unit(&self, i: usize) -> Result<bool, UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(true);
        };
        let unit = &fs.units[i];
        let held = unit.is_gathered_in(unit.shard_kind());
        self.gather_as(&[i], true, &mut Vec::new())?;
        Ok(held)
    }

    /// Forgets the most units held whole so far (summoning them all at
    /// `prepare` is not training's peak).
    pub fn reset_most_gathered(&self) {
        self.count(|s| {
            s.most_gathered = 0;
            s.most_gathered_bytes = 0;
        });
    }

    /// Releases every shard unit, after copying this process's rows of
    /// the whole parameters into its shards when `write_back` (they were
    /// loaded while gathered).
    pub fn release_all(&self, write_back: bool) {
        let Some(fs) = &self.full_shard else {
            return;
        };
        let rank = fs.group.process_index();
        for unit in &fs.units {
            if unit.is_gathered() {
                if write_back {
                    unit.write_back(rank);
                }
                unit.release();
            }
        }
    }

    /// Releases the shard units needed by model unit `k` whose use ends
    /// there (`ends[i] == Some(k)`); only frees their memory when `kept`,
    /// the graph of their forward pass being kept for backward.
    pub(super) fn release_after(&self, uses: &Uses, k: usize, ends: &[Option<usize>], kept: bool) {
        let Some(fs) = &self.full_shard else {
            return;
        };
        for &i in &uses.per_unit[k] {
            if ends[i] == Some(k) {
                match kept {
                    true => fs.units[i].free(),
                    false => fs.units[i].release(),
                }
            }
        }
    }

    /// Reduce-scatters the gradients of the shard units model unit `k`
    /// was the first to use, and releases them.
    pub(super) fn reduce_and_release(&self, uses: &Uses, k: usize) -> Result<(), UnitwiseError> {
        let Some(fs) = &self.full_shard else {
            return Ok(());
        };
        let group = fs.group.as_ref();
        for &i in &uses.per_unit[k] {
            if uses.first[i] != Some(k) {
                continue;
            }
            let unit = &fs.units[i];
            let dist = |source| UnitwiseError::Dist {
                op: "gradient reduce-scatter",
                unit: unit.path.clone(),
                source,
            };
            let reduce = fs.policy.map(|p| p.reduce_dtype.kind());
            let started = {
                let _span = crate::profiling::span_named(|| {
                    format!("hearth::fsdp_reduce_scatter {}", unit.path)
                });
                sharded::start(group, unit, reduce).map_err(dist)?
            };
            let Some((pending, _, bytes)) = started else {
                // Frozen parameters alone: nothing to reduce.
                unit.release();
                continue;
            };
            let reduced = {
                let _span = crate::profiling::span("hearth::fsdp_reduce_scatter_wait");
                pending.wait().map_err(dist)?
            };
            {
                let _span = crate::profiling::span("hearth::fsdp_gradient_shards");
                sharded::write_gradient_shard(group, unit, &reduced).map_err(dist)?;
                unit.release();
            }
            self.count(|s| {
                s.reduce_scatters += 1;
                s.bytes += bytes;
            });
        }
        Ok(())
    }
}
