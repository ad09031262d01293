//! `find_executable_batch_size`: retry a function with smaller batches
//! until it fits in memory.

/// True when a libtorch error message says memory ran out (the statements
/// Accelerate's `should_reduce_batch_size` looks for).
pub fn is_out_of_memory(message: &str) -> bool {
    const STATEMENTS: [&str; 5] = [
        " out of memory.",
        "MPS backend out of memory",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
        "DefaultCPUAllocator: can't allocate memory",
        "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
    ];
    STATEMENTS.iter().any(|s| message.contains(s))
}

/// Why no batch size worked.
#[derive(Debug, thiserror::Error)]
pub enum BatchSizeError<E> {
    /// Every size down to 1 ran out of memory (Accelerate's message).
    #[error("No executable batch size found, reached zero.")]
    ReachedZero,
    /// The function failed for another reason (not retried).
    #[error(transparent)]
    Failed(E),
}

/// Calls `f(batch_size)` from `starting_batch_size`; when it fails with an
/// out-of-memory error (per [`is_out_of_memory`] on the error's text), frees
/// cached device memory and tries again with `batch_size × 0.9` (rounded
/// down). That is what Accelerate 1.x's code does (`int(batch_size *
/// 0.9)`), although its docstring still says the size is halved: hearth
/// follows the code, whose sizes a user sees. Other errors are returned at
/// once; reaching zero is [`BatchSizeError::ReachedZero`], with
/// Accelerate's message.
pub fn find_executable_batch_size<T, E: std::fmt::Display>(
    starting_batch_size: usize,
    mut f: impl FnMut(usize) -> Result<T, E>,
) -> Result<T, BatchSizeError<E>> {
    let mut batch_size = starting_batch_size;
    loop {
        if batch_size == 0 {
            return Err(BatchSizeError::ReachedZero);
        }
        match f(batch_size) {
            Ok(value) => return Ok(value),
            Err(e) if is_out_of_memory(&e.to_string()) => {
                let _ = hearth_ops::empty_device_cache();
                batch_size = (batch_size as f64 * 0.9) as usize;
            }
            Err(e) => return Err(BatchSizeError::Failed(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shrinks_by_a_tenth_on_out_of_memory_until_it_fits() {
        let mut tried = Vec::new();
        let got = find_executable_batch_size(128, |bs| {
            tried.push(bs);
            if bs > 100 {
                Err("CUDA out of memory. Tried to allocate 2.00 GiB".to_string())
            } else {
                Ok(bs)
            }
        });
        assert_eq!(got.unwrap(), 92);
        assert_eq!(tried, vec![128, 115, 103, 92]);
    }

    /// An out-of-memory error in unit-wise backward (FULL_SHARD or
    /// activation checkpointing recomputing a unit) is retried as well.
    #[test]
    fn an_out_of_memory_error_recomputing_a_unit_is_seen() {
        let oom = tch::TchError::Torch(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes".into(),
        );
        let e = crate::parallel::BackwardError::from(crate::parallel::UnitwiseError::Torch {
            unit: 2,
            error: oom,
        });
        assert!(is_out_of_memory(&e.to_string()), "{e}");
    }

    #[test]
    fn other_errors_propagate_and_zero_is_an_error() {
        let other = find_executable_batch_size(8, |_| Err::<(), _>("shape mismatch".to_string()));
        assert!(matches!(other, Err(BatchSizeError::Failed(m)) if m == "shape mismatch"));
        let never = find_executable_batch_size(3, |_| {
            Err::<(), _>("DefaultCPUAllocator: can't allocate memory: you tried".to_string())
        });
        assert!(matches!(never, Err(BatchSizeError::ReachedZero)));
        // Accelerate's RuntimeError text.
        assert_eq!(
            never.unwrap_err().to_string(),
            "No executable batch size found, reached zero."
        );
    }
}
