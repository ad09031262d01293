//! Where a module can go (a GPU, the CPU, the disk), how much each device
//! may hold (`max_memory`), and the sizes people write (`"20GiB"`), read as
//! Accelerate's `get_max_memory` and `convert_file_size_to_int` read them.

use super::{BigModelError, Notes};
use indexmap::IndexMap;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A place in a device map: a GPU by index, the CPU, or the disk.
///
/// Serialised as Accelerate writes device maps: GPUs as integers,
/// `"cpu"` and `"disk"` as strings. Ordered as `get_max_memory` orders
/// devices: GPUs by index, then the CPU, then the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MapDevice {
    /// CUDA device `i`.
    Gpu(usize),
    /// Host memory.
    Cpu,
    /// The offload folder.
    Disk,
}

impl MapDevice {
    /// The libtorch device tensors placed here live on (`None` for the disk).
    pub fn torch_device(self) -> Option<tch::Device> {
        match self {
            Self::Gpu(i) => Some(tch::Device::Cuda(i)),
            Self::Cpu => Some(tch::Device::Cpu),
            Self::Disk => None,
        }
    }

    /// True for a GPU.
    pub fn is_gpu(self) -> bool {
        matches!(self, Self::Gpu(_))
    }
}

impl fmt::Display for MapDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu(i) => write!(f, "{i}"),
            Self::Cpu => f.write_str("cpu"),
            Self::Disk => f.write_str("disk"),
        }
    }
}

impl std::str::FromStr for MapDevice {
    type Err = BigModelError;

    /// `0`, `1`, … (GPUs, also `cuda:0`), `cpu` or `disk`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let t = text.trim();
        let index = t.strip_prefix("cuda:").unwrap_or(t);
        if let Ok(i) = index.parse::<usize>() {
            return Ok(Self::Gpu(i));
        }
        match t {
            "cpu" => Ok(Self::Cpu),
            "disk" => Ok(Self::Disk),
            _ => Err(BigModelError::UnknownDevice { name: text.into() }),
        }
    }
}

impl Serialize for MapDevice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Gpu(i) => s.serialize_u64(*i as u64),
            Self::Cpu => s.serialize_str("cpu"),
            Self::Disk => s.serialize_str("disk"),
        }
    }
}

impl<'de> Deserialize<'de> for MapDevice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Index(usize),
            Name(String),
        }
        match Raw::deserialize(d)? {
            Raw::Index(i) => Ok(Self::Gpu(i)),
            Raw::Name(n) => n.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// How many bytes each device may hold, in `get_max_memory`'s order (GPUs
/// by index, then `cpu`, then `disk`).
pub type MaxMemory = IndexMap<MapDevice, u64>;

/// Reads a size as Accelerate's `convert_file_size_to_int` does: `GiB`,
/// `MiB`, `KiB` are powers of 2, `GB`, `MB`, `KB` powers of 10 (any case;
/// a lowercase final `b`, as in `"8Gb"`, means bits), a bare number is
/// bytes.
pub fn parse_memory_size(text: &str) -> Result<u64, BigModelError> {
    let bad = || BigModelError::BadSize { text: text.into() };
    let t = text.trim();
    if let Ok(bytes) = t.parse::<u64>() {
        return Ok(bytes);
    }
    let upper = t.to_ascii_uppercase();
    let (digits, factor, bits) = if let Some(p) = [("GIB", 30), ("MIB", 20), ("KIB", 10)]
        .iter()
        .find(|(suffix, _)| upper.ends_with(suffix))
    {
        (&t[..t.len() - 3], 2f64.powi(p.1), false)
    } else if let Some(p) = [("GB", 9), ("MB", 6), ("KB", 3)]
        .iter()
        .find(|(suffix, _)| upper.ends_with(suffix))
    {
        (&t[..t.len() - 2], 10f64.powi(p.1), t.ends_with('b'))
    } else {
        return Err(bad());
    };
    let number: f64 = digits.trim().parse().map_err(|_| bad())?;
    if !number.is_finite() || number < 0.0 {
        return Err(bad());
    }
    let bytes = (number * factor) as u64;
    Ok(if bits { bytes / 8 } else { bytes })
}

/// Parses `0=20GiB,1=20GiB,cpu=64GiB` (the `--max-memory` flag).
pub fn parse_max_memory(text: &str) -> Result<MaxMemory, BigModelError> {
    let mut memory = MaxMemory::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (device, size) = part
            .split_once('=')
            .ok_or_else(|| BigModelError::BadMaxMemory { part: part.into() })?;
        let device: MapDevice = device.parse()?;
        if memory.insert(device, parse_memory_size(size)?).is_some() {
            return Err(BigModelError::BadMaxMemory { part: part.into() });
        }
    }
    if memory.is_empty() {
        return Err(BigModelError::BadMaxMemory { part: text.into() });
    }
    Ok(memory)
}

/// Python's `repr` of `list(range(n))`.
fn range_repr(n: usize) -> String {
    let items: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    format!("[{}]", items.join(", "))
}

/// Accelerate's `get_max_memory`: the devices given, in order (GPUs by
/// index, then `cpu`, then `disk`), warning about GPUs this machine does
/// not have; with none given, the memory free now: the CPU's available
/// memory (GPUs are not asked: give their sizes).
pub fn get_max_memory(max_memory: Option<&MaxMemory>, notes: &mut Notes) -> MaxMemory {
    let Some(given) = max_memory else {
        let mut free = MaxMemory::new();
        free.insert(MapDevice::Cpu, available_host_memory());
        return free;
    };
    let gpus = hearth_ops::cuda::device_count();
    let mut ordered: Vec<(MapDevice, u64)> = given.iter().map(|(d, m)| (*d, *m)).collect();
    ordered.sort_by_key(|(d, _)| *d);
    for (device, _) in &ordered {
        if let MapDevice::Gpu(i) = device {
            if *i >= gpus {
                notes.warn(format!(
                    "Device {i} is not available, available devices are {}",
                    range_repr(gpus)
                ));
            }
        }
    }
    ordered.into_iter().collect()
}

/// `MemAvailable` of `/proc/meminfo` (what psutil reports as available).
fn available_host_memory() -> u64 {
    hearth_comm::environment::proc_field("/proc/meminfo", "MemAvailable")
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_accelerate_reads_them() {
        assert_eq!(parse_memory_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_memory_size("20GiB").unwrap(), 20 << 30);
        assert_eq!(parse_memory_size("5.5GB").unwrap(), 5_500_000_000);
        assert_eq!(parse_memory_size("8Gb").unwrap(), 1_000_000_000);
        assert_eq!(parse_memory_size("3kib").unwrap(), 3072);
        assert_eq!(parse_memory_size("1000").unwrap(), 1000);
        for bad in ["12GX", "GB", "-1GB", "1TB", "inf GB", ""] {
            let err = parse_memory_size(bad).unwrap_err().to_string();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn max_memory_lists_gpus_then_cpu_then_disk() {
        let m = parse_max_memory("cpu=2GB, disk=1GiB").unwrap();
        assert_eq!(
            m.keys().copied().collect::<Vec<_>>(),
            [MapDevice::Cpu, MapDevice::Disk]
        );
        let m = parse_max_memory("cpu=1KB,1=2KB,0=3KB").unwrap();
        let mut notes = Notes::default();
        let ordered = get_max_memory(Some(&m), &mut notes);
        assert_eq!(
            ordered.into_iter().collect::<Vec<_>>(),
            [
                (MapDevice::Gpu(0), 3000),
                (MapDevice::Gpu(1), 2000),
                (MapDevice::Cpu, 1000)
            ]
        );
        let err = parse_max_memory("tpu=1GB").unwrap_err().to_string();
        assert!(err.contains("`tpu`"), "{err}");
        assert!(parse_max_memory("cpu").is_err());
        assert!(parse_max_memory("cpu=1GB,cpu=2GB").is_err());
    }

    #[test]
    fn devices_serialise_as_accelerate_writes_them() {
        let devices = [MapDevice::Gpu(1), MapDevice::Cpu, MapDevice::Disk];
        let json = serde_json::to_string(&devices).unwrap();
        assert_eq!(json, r#"[1,"cpu","disk"]"#);
        let back: Vec<MapDevice> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, devices);
    }
}
