//! The host buffers an asynchronous save copies the state into, kept from
//! one save to the next (what torch.distributed.checkpoint's async staging
//! does with `cache_staged_state_dict`).
//!
//! A fresh copy of the state each save pays for new memory every time:
//! page faults on any machine, and on a VM that hands free memory back to
//! its host (free page reporting) a host fault per page as well — on the
//! 2-core development VM, first-touching memory ran at 0.46–0.60 GB/s
//! against 8–10 GB/s for memory already in use, so the copy of a 3 GB
//! state blocked training ~1 s and pushed the writer's page cache onto
//! cold pages too. Reusing the buffers makes every save after the first
//! copy into memory already in use. The price is one copy of the state
//! held between saves, freed by `end_training`.
//!
//! A GPU's tensors are staged in page-locked (pinned) host memory, which
//! the GPU copies into by DMA at full speed, and every copy after the first
//! save's is queued without waiting (`non_blocking`); the session waits for
//! the device once, when it ends, before the writer thread reads anything
//! (torch.distributed.checkpoint's async staging pins its cache the same
//! way). A copy into ordinary memory goes through a small pinned bounce
//! buffer, chunk by chunk, with a wait per chunk.

use std::sync::Mutex;
use tch::{Device, Tensor};

/// The buffers of the last asynchronous save, in the order it copied.
#[derive(Default)]
pub(crate) struct SnapshotBuffers {
    buffers: Mutex<Vec<Buffer>>,
}

/// One host buffer, and whether it is pinned (made for a GPU's tensor).
struct Buffer {
    tensor: Tensor,
    pinned: bool,
}

impl SnapshotBuffers {
    /// Starts the copies of one save. Only call it once the previous save
    /// has been written: its buffers are overwritten.
    pub(crate) fn session(&self) -> Session<'_> {
        Session {
            buffers: self.buffers.lock().unwrap_or_else(|p| p.into_inner()),
            next: 0,
            queued_on: Vec::new(),
        }
    }

    /// Frees the buffers.
    pub(crate) fn clear(&self) {
        self.buffers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Bytes held between saves.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        let buffers = self.buffers.lock().unwrap_or_else(|p| p.into_inner());
        buffers
            .iter()
            .map(|b| (b.tensor.numel() * b.tensor.kind().elt_size_in_bytes()) as u64)
            .sum()
    }
}

/// The copies of one save.
pub(crate) struct Session<'a> {
    buffers: std::sync::MutexGuard<'a, Vec<Buffer>>,
    next: usize,
    /// The GPUs with copies queued but not waited for.
    queued_on: Vec<i64>,
}

impl Session<'_> {
    /// A contiguous CPU copy of `t`, in the buffer the previous save used
    /// at this position when it has the same shape and kind (and, for a
    /// GPU's tensor, is pinned). A GPU's copy may still be in flight until
    /// the session ends.
    pub(crate) fn copy(&mut self, t: &Tensor) -> Tensor {
        let source = t.detach();
        let at = self.next;
        self.next += 1;
        let gpu = match source.device() {
            Device::Cuda(index) => Some(index as i64),
            _ => None,
        };
        let reusable = self.buffers.get(at).filter(|b| {
            b.tensor.size() == source.size()
                && b.tensor.kind() == source.kind()
                && (gpu.is_none() || b.pinned)
        });
        if let Some(buffer) = reusable {
            let buffer = buffer.tensor.shallow_clone();
            match gpu {
                Some(index) => {
                    hearth_ops::copy_non_blocking(&buffer, &source).unwrap_or_else(|e| {
                        panic!("copying a GPU tensor to pinned host memory: {e}")
                    });
                    if !self.queued_on.contains(&index) {
                        self.queued_on.push(index);
                    }
                }
                None => {
                    buffer.shallow_clone().copy_(&source);
                }
            }
            return buffer;
        }
        let fresh = match gpu {
            // The first save of a GPU's tensor: a pinned copy, made at once.
            Some(_) => hearth_ops::to_pinned_host(&source)
                .unwrap_or_else(|e| panic!("copying a GPU tensor to pinned host memory: {e}")),
            None => {
                let fresh = Tensor::empty(source.size(), (source.kind(), Device::Cpu));
                advise_huge_pages(&fresh);
                fresh.shallow_clone().copy_(&source);
                fresh
            }
        };
        let kept = Buffer {
            tensor: fresh.shallow_clone(),
            pinned: gpu.is_some(),
        };
        if at < self.buffers.len() {
            self.buffers[at] = kept;
        } else {
            self.buffers.push(kept);
        }
        fresh
    }
}

/// Asks the kernel to back the 2 MiB-aligned inside of `t`'s memory, not
/// yet touched, with transparent huge pages (where THP is `madvise`, the
/// default of many distributions, it is otherwise 4 KiB pages). The first
/// save's copy goes into fresh memory: one fault per 2 MiB instead of per
/// 4 KiB took first-touch copies on the development VM from 0.35–0.70 GB/s
/// to 0.85–1.14 GB/s (PyTorch's allocator does the same under
/// `THP_MEM_ALLOC_ENABLE`). Advisory: where it fails nothing changes.
fn advise_huge_pages(t: &Tensor) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = t.data_ptr() as usize;
        let end = start + t.numel() * t.kind().elt_size_in_bytes();
        let (from, to) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
        if to > from {
            // SAFETY: a range inside the tensor's own allocation; the advice
            // changes how its pages are backed, not their contents.
            unsafe {
                libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = t;
}

impl Drop for Session<'_> {
    /// Waits for the copies still queued on a GPU, so the buffers hold the
    /// state before anyone reads them; buffers past the last one this save
    /// used are freed (the state shrank).
    fn drop(&mut self) {
        for &index in &self.queued_on {
            tch::Cuda::synchronize(index);
        }
        let used = self.next;
        self.buffers.truncate(used);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn a_second_save_copies_into_the_first_ones_buffers() {
        let pool = SnapshotBuffers::default();
        let a = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
        let b = Tensor::ones([4], (Kind::Int64, Device::Cpu));
        let first = {
            let mut s = pool.session();
            (s.copy(&a), s.copy(&b))
        };
        assert!(first.0.equal(&a) && first.1.equal(&b));
        assert_ne!(first.0.data_ptr(), a.data_ptr(), "a copy, not a view");
        let _ = a.shallow_clone().fill_(7.0);
        let second = {
            let mut s = pool.session();
            (s.copy(&a), s.copy(&b))
        };
        assert_eq!(second.0.data_ptr(), first.0.data_ptr(), "buffer reused");
        assert!(second.0.equal(&a), "holds the new values");
        assert_eq!(pool.bytes(), 6 * 4 + 4 * 8);
        // Another shape at a position gets a new buffer; unused ones go.
        let c = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        {
            let mut s = pool.session();
            let copied = s.copy(&c);
            assert_ne!(copied.data_ptr(), first.0.data_ptr());
        }
        assert_eq!(pool.bytes(), 3 * 4);
        pool.clear();
        assert_eq!(pool.bytes(), 0);
    }

    /// The VmFlags of the mapping of this process that holds `addr`.
    #[cfg(target_os = "linux")]
    fn vm_flags_at(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.trim().to_string());
                }
            }
        }
        None
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_fresh_buffer_asks_for_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("this kernel has no transparent huge pages: nothing to check");
            return;
        }
        let pool = SnapshotBuffers::default();
        let big = Tensor::ones([3 << 20], (Kind::Float, Device::Cpu)); // 12 MiB
        let copy = pool.session().copy(&big);
        let inside = (copy.data_ptr() as usize).next_multiple_of(2 << 20);
        let flags = vm_flags_at(inside).expect("the buffer is mapped");
        assert!(flags.split(' ').any(|f| f == "hg"), "VmFlags: {flags}");
        assert!(copy.equal(&big));
    }
}
