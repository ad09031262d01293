//! FSDP2's shard layout: every parameter is cut along dimension 0 into
//! `world` chunks of `ceil(d0 / world)` rows (the last ones shorter or
//! empty), and process `r` owns chunk `r`. A unit's flat shard is the
//! concatenation of its parameters' chunks, each padded to the full chunk
//! size, so every process's flat shard has the same length and one
//! reduce-scatter or all-gather moves a whole unit.

use tch::{Device, Kind, Tensor};

/// One parameter's place in the layout, on this process.
pub struct ParamShard {
    /// The parameter's name (`blocks.0.qkv.weight`).
    pub name: String,
    /// The whole parameter (the model's own tensor; under FULL_SHARD an
    /// empty one between uses, see [`UnitShard::release`]).
    pub full: Tensor,
    /// The whole parameter's shape.
    pub shape: Vec<i64>,
    /// The rows this process owns: a view of `full`'s storage (rows
    /// `[start, start + rows)`), or storage of its own once
    /// [`UnitShard::own_shards`] ran; a leaf the optimizer updates in place.
    pub shard: Tensor,
    /// Rows of every chunk: `ceil(d0 / world)`.
    pub chunk_rows: i64,
    /// Elements per row (the product of the trailing dimensions).
    pub row_numel: i64,
    /// Rows of the parameter (1 for a 0-dimensional one).
    pub rows: i64,
    /// Where this parameter's padded chunk starts in its unit's flat shard.
    pub offset: i64,
    /// Where its padded gradient chunk starts in the unit's flat gradient
    /// shard; `None` for a frozen parameter (one that required no
    /// gradient when the unit was laid out), which is sharded and gathered
    /// like the others but never reduce-scattered nor stepped.
    pub grad_offset: Option<i64>,
}

impl ParamShard {
    /// Elements of one padded chunk.
    pub fn chunk_numel(&self) -> i64 {
        self.chunk_rows * self.row_numel
    }

    /// Rows owned by `rank` of `world`.
    pub fn rows_of(&self, rank: usize) -> i64 {
        let start = (rank as i64 * self.chunk_rows).min(self.rows);
        (start + self.chunk_rows).min(self.rows) - start
    }

    /// The parameter as `[rows, row_numel]`.
    fn rows_view(t: &Tensor, rows: i64, row_numel: i64) -> Tensor {
        t.reshape([rows, row_numel])
    }

    /// `t` (shaped like the whole parameter) padded with zero rows to
    /// `world` chunks, as `[world, chunk_numel]`.
    pub fn chunked(&self, t: &Tensor, world: usize) -> Tensor {
        let rows = Self::rows_view(t, self.rows, self.row_numel);
        let padded_rows = self.chunk_rows * world as i64;
        let padded = if padded_rows == self.rows {
            rows
        } else {
            rows.constant_pad_nd([0, 0, 0, padded_rows - self.rows])
        };
        padded.reshape([world as i64, self.chunk_numel()])
    }

    /// `t` shaped like this process's shard, padded to one chunk (1-d).
    pub fn padded_shard(&self, t: &Tensor) -> Tensor {
        let flat = t.reshape([-1]);
        let missing = self.chunk_numel() - flat.numel() as i64;
        if missing == 0 {
            flat
        } else {
            flat.constant_pad_nd([0, missing])
        }
    }

    /// The whole parameter's values from `[world, chunk_numel]` chunks.
    pub fn unchunked(&self, chunks: &Tensor) -> Tensor {
        let world = chunks.size()[0];
        chunks
            .reshape([world * self.chunk_rows, self.row_numel])
            .narrow(0, 0, self.rows)
            .reshape(self.shape.as_slice())
    }

    /// The shape of `rank`'s shard.
    pub fn shard_shape(&self, rank: usize) -> Vec<i64> {
        let mut shape = self.shape.clone();
        match shape.first_mut() {
            Some(d0) => *d0 = self.rows_of(rank),
            None => shape = vec![self.rows_of(rank)],
        }
        shape
    }

    /// The rows of the whole parameter `rank`'s shard holds; `None` for a
    /// 0-dimensional parameter (whose one element every checkpoint holds
    /// whole).
    pub fn held_rows(&self, rank: usize) -> Option<crate::checkpoint::HeldRows> {
        (!self.shape.is_empty()).then(|| crate::checkpoint::HeldRows {
            start: (rank as i64 * self.chunk_rows).min(self.rows),
            count: self.rows_of(rank),
            whole: self.shape.clone(),
        })
    }

    /// This process's rows of `t` (shaped like the whole parameter).
    pub fn own_rows(&self, t: &Tensor, rank: usize) -> Tensor {
        let start = (rank as i64 * self.chunk_rows).min(self.rows);
        Self::rows_view(t, self.rows, self.row_numel)
            .narrow(0, start, self.rows_of(rank))
            .reshape(self.shard_shape(rank).as_slice())
    }
}

/// The parameters of one unit, laid out for sharding.
pub struct UnitShard {
    /// The unit's module path (`""` for the root).
    pub path: String,
    /// Its parameters, in the order of its flat shard.
    pub params: Vec<ParamShard>,
    /// Length of every process's flat shard of this unit.
    pub shard_numel: i64,
    /// Length of every process's flat gradient shard: the trainable
    /// parameters' padded chunks.
    pub grad_numel: i64,
}

impl UnitShard {
    /// Another handle to the same unit (its tensors shared, not copied).
    pub fn shallow_clone(&self) -> Self {
        Self {
            path: self.path.clone(),
            params: self
                .params
                .iter()
                .map(|p| ParamShard {
                    name: p.name.clone(),
                    full: p.full.shallow_clone(),
                    shape: p.shape.clone(),
                    shard: p.shard.shallow_clone(),
                    ..*p
                })
                .collect(),
            shard_numel: self.shard_numel,
            grad_numel: self.grad_numel,
        }
    }

    /// Lays out `params` (name and tensor) for process `rank` of `world`;
    /// those that require no gradient now stay out of the gradient layout.
    pub fn new(path: String, params: Vec<(String, Tensor)>, rank: usize, world: usize) -> Self {
        let (mut offset, mut grad_offset) = (0, 0);
        let params = params
            .into_iter()
            .map(|(name, full)| {
                let size = full.size();
                let rows = size.first().copied().unwrap_or(1);
                let row_numel = size.iter().skip(1).product::<i64>();
                let chunk_rows = (rows + world as i64 - 1) / world as i64;
                let start = (rank as i64 * chunk_rows).min(rows);
                let own = (start + chunk_rows).min(rows) - start;
                let shard = tch::no_grad(|| {
                    full.detach()
                        .reshape([rows, row_numel])
                        .narrow(0, start, own)
                });
                let trainable = full.requires_grad();
                let mut p = ParamShard {
                    name,
                    full,
                    shape: size,
                    shard,
                    chunk_rows,
                    row_numel,
                    rows,
                    offset,
                    grad_offset: trainable.then_some(grad_offset),
                };
                p.shard = p.shard.view(p.shard_shape(rank).as_slice());
                offset += p.chunk_numel();
                if trainable {
                    grad_offset += p.chunk_numel();
                }
                p
            })
            .collect();
        Self {
            path,
            params,
            shard_numel: offset,
            grad_numel: grad_offset,
        }
    }

    /// The parameters that train (reduce-scattered and stepped), in the
    /// order of the flat gradient shard.
    pub fn trainable(&self) -> impl Iterator<Item = &ParamShard> + '_ {
        self.params.iter().filter(|p| p.grad_offset.is_some())
    }

    /// True when some parameter of the unit trains: a unit of frozen
    /// parameters alone is gathered for use but never reduce-scattered.
    pub fn trains(&self) -> bool {
        self.trainable().next().is_some()
    }

    /// The gradients of the trainable whole parameters (zeros where one
    /// has none) as the input of a reduce-scatter: `[world × (grad_numel +
    /// trainable)]`, chunk `r` holding what process `r` keeps (FSDP2's
    /// `chunk_cat`) followed by one flag per trainable parameter, 1 where
    /// this process has its gradient (every chunk carries them, so every
    /// process learns which parameters some process had a gradient for).
    /// Frozen parameters are not on the wire.
    pub fn pack_gradients(&self, world: usize, kind: Kind) -> Tensor {
        let trainable: Vec<&ParamShard> = self.trainable().collect();
        let grads: Vec<Tensor> = trainable.iter().map(|p| p.full.grad()).collect();
        let device = self.params[0].full.device();
        let had: Vec<f32> = grads
            .iter()
            .map(|g| if g.defined() { 1.0 } else { 0.0 })
            .collect();
        // All present (always so inside backward): no copy from the host.
        let flags = if had.iter().all(|&h| h == 1.0) {
            Tensor::ones([1, had.len() as i64], (kind, device))
        } else {
            Tensor::from_slice(&had)
                .to_device(device)
                .to_kind(kind)
                .view([1, -1])
        };
        let mut parts: Vec<Tensor> = trainable
            .iter()
            .zip(grads)
            .map(|(p, g)| {
                let g = if g.defined() {
                    g
                } else {
                    Tensor::zeros(p.shape.as_slice(), (kind, device))
                };
                p.chunked(&g.to_kind(kind), world)
            })
            .collect();
        parts.push(flags.expand([world as i64, -1], false));
        Tensor::cat(&parts, 1).reshape([-1])
    }

    /// Which trainable parameters some process had a gradient for, from
    /// this process's part of a reduce-scatter of [`pack_gradients`](Self::pack_gradients).
    pub fn had_gradients(&self, reduced: &Tensor) -> Vec<bool> {
        let n = self.trainable().count() as i64;
        let flags = reduced
            .narrow(0, self.grad_numel, n)
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu);
        Vec::<f32>::try_from(&flags)
            .expect("flags convert to f32")
            .into_iter()
            .map(|f| f > 0.0)
            .collect()
    }

    /// This process's padded shards of the whole parameters, as one flat
    /// tensor on the whole parameters' device (the input of an all-gather;
    /// offloaded shards are copied over).
    pub fn pack_shards(&self) -> Tensor {
        if self.offloaded() {
            // Each pinned shard copied straight to its place on the GPU,
            // queued without waiting (the host goes on launching work). The
            // shards change only in the optimizer step, which the blocking
            // copies of the gradients out of the GPU come before.
            let (kind, device) = (self.params[0].shard.kind(), self.params[0].full.device());
            let flat = Tensor::zeros([self.shard_numel], (kind, device));
            for p in &self.params {
                let n = p.shard.numel() as i64;
                hearth_ops::copy_non_blocking(&flat.narrow(0, p.offset, n), &p.shard.reshape([-1]))
                    .expect("a copy between a live shard and its place");
            }
            return flat;
        }
        let parts: Vec<Tensor> = self
            .params
            .iter()
            .map(|p| p.padded_shard(&p.shard))
            .collect();
        Tensor::cat(&parts, 0)
    }

    /// Writes `gathered` (`[world, shard_numel]`, every process's flat
    /// shard) into the whole parameters.
    pub fn unpack_gathered(&self, gathered: &Tensor) {
        tch::no_grad(|| {
            for p in &self.params {
                let chunks = gathered.narrow(1, p.offset, p.chunk_numel());
                p.full.detach().copy_(&p.unchunked(&chunks));
            }
        })
    }

    /// Gives every shard storage of its own on `device` (where the model
    /// trains), so that the whole parameters can be released (FULL_SHARD).
    /// With `offload` the shards stay in host memory instead (FSDP's
    /// `cpu_offload`), pinned when `device` is a GPU so that gathers copy
    /// them over asynchronously at full speed.
    pub fn own_shards(&mut self, device: Device, offload: bool) {
        for p in &mut self.params {
            let shard = p.shard.detach();
            p.shard = tch::no_grad(|| match device {
                Device::Cuda(_) if offload => hearth_ops::to_pinned_host(&shard)
                    .expect("pinned host memory with a GPU present"),
                _ if shard.device() == device => shard.copy(),
                _ => shard.to_device(device),
            });
        }
    }

    /// True when the shards live in host memory while the whole
    /// parameters are on a GPU (cpu-offload).
    pub fn offloaded(&self) -> bool {
        self.params
            .first()
            .is_some_and(|p| p.shard.device() != p.full.device())
    }

    /// True while the whole parameters hold their values.
    pub fn is_gathered(&self) -> bool {
        self.params.iter().all(|p| {
            let whole = p.shape.iter().product::<i64>();
            p.full.numel() as i64 == whole && (whole == 0 || hearth_ops::storage_bytes(&p.full) > 0)
        })
    }

    /// Bytes of the whole parameters as they are now (gathered for use:
    /// in a mixed-precision policy's kind).
    pub fn whole_bytes(&self) -> u64 {
        self.params
            .iter()
            .map(|p| (p.full.numel() * p.full.kind().elt_size_in_bytes()) as u64)
            .sum()
    }

    /// True while [`free`](Self::free) left the whole parameters without
    /// memory (between a unit's forward and its backward).
    pub fn is_freed(&self) -> bool {
        self.params.iter().any(|p| {
            let whole = p.shape.iter().product::<i64>();
            whole > 0 && p.full.numel() as i64 == whole && hearth_ops::storage_bytes(&p.full) == 0
        })
    }

    /// Frees the memory of the whole parameters but keeps their storage,
    /// which autograd's views of them share (FSDP's `_free_storage`): the
    /// graph of the unit's forward pass outlives it, and the next
    /// [`gather`](Self::gather) gives that storage its values back.
    pub fn free(&self) {
        for p in &self.params {
            if p.full.numel() > 0 {
                hearth_ops::free_storage(&p.full).expect("a whole parameter has storage");
            }
        }
    }

    /// Frees the whole parameters and their gradients: each becomes an
    /// empty tensor of its kind on its device (the model's handles stay
    /// valid and see the values again after [`gather`](Self::gather)).
    pub fn release(&self) {
        self.release_on(None)
    }

    /// [`release`](Self::release), the empty tensors put on `device` when
    /// given (a model sharded before it was placed on its device).
    pub fn release_on(&self, device: Option<Device>) {
        let mut full: Vec<Tensor> = self.params.iter().map(|p| p.full.shallow_clone()).collect();
        hearth_ops::clear_grads(&full).expect("dropping gradients cannot fail");
        tch::no_grad(|| {
            for f in &mut full {
                let empty = Tensor::empty([0], (f.kind(), device.unwrap_or(f.device())));
                f.set_data(&empty);
            }
        });
    }

    /// True while the whole parameters hold their values in `kind`.
    pub fn is_gathered_in(&self, kind: Kind) -> bool {
        self.is_gathered() && self.params[0].full.kind() == kind
    }

    /// The kind of the shards (float32 under a mixed-precision policy).
    pub fn shard_kind(&self) -> Kind {
        self.params[0].shard.kind()
    }

    /// Rebuilds the whole parameters from every process's shards, in
    /// `kind` (the shards are cast before the all-gather, as FSDP2 does):
    /// one all-gather of the unit, then a copy out per parameter. Returns
    /// the bytes this process sent.
    pub fn gather(
        &self,
        group: &dyn hearth_comm::ProcessGroup,
        kind: Kind,
    ) -> Result<u64, hearth_comm::DistError> {
        let (pending, bytes) = self.gather_start(group, kind)?;
        self.gather_finish(pending.wait()?);
        Ok(bytes)
    }

    /// Starts [`gather`](Self::gather)'s all-gather (a prefetch): returns
    /// it and the bytes this process sends; [`gather_finish`](Self::gather_finish)
    /// takes its result.
    pub fn gather_start<'g>(
        &self,
        group: &'g dyn hearth_comm::ProcessGroup,
        kind: Kind,
    ) -> Result<(hearth_comm::Pending<'g>, u64), hearth_comm::DistError> {
        let _span =
            crate::profiling::span_named(|| format!("hearth::fsdp_all_gather {}", self.path));
        let flat = tch::no_grad(|| self.pack_shards().to_kind(kind));
        let bytes = (flat.numel() * flat.kind().elt_size_in_bytes()) as u64;
        Ok((group.all_gather_into_start(&flat)?, bytes))
    }

    /// Makes the whole parameters the all-gathered shards `gathered`
    /// (`[world, shard_numel]`), each in a storage of its own (so that
    /// [`free`](Self::free) frees one parameter's memory, and views of it
    /// keep to it); a parameter `free` left without memory gets it back in
    /// the storage it had.
    pub fn gather_finish(&self, gathered: Tensor) {
        let _span = crate::profiling::span("hearth::fsdp_unshard");
        tch::no_grad(|| {
            for p in &self.params {
                let chunks = gathered.narrow(1, p.offset, p.chunk_numel());
                let mut value = p.unchunked(&chunks).contiguous();
                let bytes = value.numel() * value.kind().elt_size_in_bytes();
                if hearth_ops::storage_bytes(&value) != bytes {
                    // A view of the gathered buffer (one process, or one
                    // parameter without padding): a storage of its own.
                    value = value.copy();
                }
                let freed = p.full.numel() > 0
                    && p.full.kind() == value.kind()
                    && hearth_ops::storage_bytes(&p.full) == 0;
                match freed {
                    true => hearth_ops::take_storage(&p.full, value)
                        .expect("a freed parameter takes values of its own size and kind"),
                    false => p.full.shallow_clone().set_data(&value),
                }
            }
        });
    }

    /// Copies this process's rows of the whole parameters into its shards
    /// (after the whole parameters were written, by a load).
    pub fn write_back(&self, rank: usize) {
        tch::no_grad(|| {
            for p in &self.params {
                p.shard.detach().copy_(&p.own_rows(&p.full, rank));
            }
        });
    }

    /// The views of this process's gradient shard (`flat`, one unit's
    /// reduce-scatter output) shaped as each trainable parameter's shard.
    pub fn gradient_shards<'a>(
        &'a self,
        flat: &'a Tensor,
    ) -> impl Iterator<Item = (&'a ParamShard, Tensor)> + 'a {
        self.params.iter().filter_map(move |p| {
            let n = p.shard.numel() as i64;
            let g = flat
                .narrow(0, p.grad_offset?, n)
                .view(p.shard.size().as_slice());
            Some((p, g))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(shape: &[i64]) -> Tensor {
        let n: i64 = shape.iter().product::<i64>().max(1);
        Tensor::arange(n, (Kind::Float, Device::Cpu)).reshape(shape)
    }

    #[test]
    fn chunks_are_ceil_rows_and_the_last_ranks_hold_fewer_or_none() {
        // 5 rows over 4 processes: chunks of 2 rows, rank 2 holds 1, rank 3 none.
        let rows: Vec<i64> = (0..4)
            .map(|r| {
                let u = UnitShard::new("".into(), vec![("w".into(), param(&[5, 3]))], r, 4);
                assert_eq!(u.shard_numel, 6);
                u.params[0].shard.size()[0]
            })
            .collect();
        assert_eq!(rows, [2, 2, 1, 0]);
    }

    #[test]
    fn shards_are_views_of_the_parameter_rows() {
        let w = param(&[5, 3]);
        let u = UnitShard::new("".into(), vec![("w".into(), w.shallow_clone())], 1, 2);
        let shard = &u.params[0].shard;
        assert_eq!(shard.size(), [2, 3]);
        assert_eq!(
            Vec::<f32>::try_from(shard.reshape([-1])).unwrap(),
            [9.0, 10.0, 11.0, 12.0, 13.0, 14.0]
        );
        let _ = tch::no_grad(|| shard.detach().fill_(-1.0));
        assert_eq!(
            w.double_value(&[3, 0]),
            -1.0,
            "the shard writes into the parameter"
        );
    }

    #[test]
    fn gathering_every_shard_rebuilds_every_parameter() {
        let world = 3;
        let make = || {
            vec![
                ("a".into(), param(&[5, 2])),
                ("b".into(), param(&[4])),
                ("c".into(), param(&[])),
            ]
        };
        let want: Vec<Tensor> = make().into_iter().map(|(_, t)| t).collect();
        let units: Vec<UnitShard> = (0..world)
            .map(|r| UnitShard::new("u".into(), make(), r, world))
            .collect();
        let flats: Vec<Tensor> = units.iter().map(UnitShard::pack_shards).collect();
        let gathered = Tensor::stack(&flats, 0);
        // Overwrite rank 0's parameters, then rebuild them from the shards.
        for p in &units[0].params {
            let _ = tch::no_grad(|| p.full.detach().zero_());
        }
        units[0].unpack_gathered(&gathered);
        for (p, w) in units[0].params.iter().zip(&want) {
            assert!(p.full.equal(w), "{}", p.name);
        }
    }

    #[test]
    fn the_packed_gradients_of_rank_r_are_its_rows() {
        let world = 2;
        let w = param(&[3, 2]).set_requires_grad(true);
        (&w * 2.0).sum(Kind::Float).backward();
        let u = UnitShard::new("".into(), vec![("w".into(), w.shallow_clone())], 1, world);
        let packed = u
            .pack_gradients(world, Kind::Float)
            .reshape([world as i64, -1]);
        // Rank 1 owns row 2 and a padding row, then the flag: a gradient.
        assert_eq!(
            Vec::<f32>::try_from(packed.get(1)).unwrap(),
            [2.0, 2.0, 0.0, 0.0, 1.0]
        );
        assert_eq!(u.had_gradients(&packed.get(1)), [true]);
        let (_, g) = u.gradient_shards(&packed.get(1)).next().unwrap();
        assert_eq!(g.size(), [1, 2]);
    }

    #[test]
    fn a_frozen_parameter_is_sharded_but_not_on_the_gradient_wire() {
        let world = 2;
        let frozen = param(&[4, 2]);
        let w = param(&[3, 2]).set_requires_grad(true);
        (&w * 2.0 + frozen.sum(Kind::Float))
            .sum(Kind::Float)
            .backward();
        let params = vec![("frozen".into(), frozen), ("w".into(), w.shallow_clone())];
        let u = UnitShard::new("".into(), params, 0, world);
        assert_eq!((u.shard_numel, u.grad_numel), (4 + 4, 4));
        assert_eq!(u.params[0].grad_offset, None);
        assert!(u.trains());
        // Rank 0's chunk: w's rows 0 and 1, then w's flag; nothing of `frozen`.
        let packed = u
            .pack_gradients(world, Kind::Float)
            .reshape([world as i64, -1]);
        assert_eq!(
            Vec::<f32>::try_from(packed.get(0)).unwrap(),
            [2.0, 2.0, 2.0, 2.0, 1.0]
        );
        let rank0 = packed.get(0);
        let names: Vec<&str> = u
            .gradient_shards(&rank0)
            .map(|(p, _)| p.name.as_str())
            .collect();
        assert_eq!(names, ["w"]);
        let only_frozen = UnitShard::new("".into(), vec![("f".into(), param(&[2]))], 0, world);
        assert!(!only_frozen.trains());
    }
}
