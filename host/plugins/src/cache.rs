//! Compiled components on disk, keyed by the component's SHA-256 and the
//! engine's compatibility hash, so a Python or JS plugin compiles once (≈7 s)
//! and later loads in milliseconds.
//!
//! An entry is `sha256(payload) ‖ payload`, written atomically; an entry
//! that is truncated, corrupt or from another engine is a miss and is
//! rewritten, never a crash. The folder is `$HEARTH_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/hearth/components`, else `~/.cache/hearth/components`.
//!
//! Trust: an entry is native code the host runs, so the cache is trusted
//! like the `hearth` binary itself. The checksum catches damage, not an
//! attacker; what keeps others out is ownership: the folder is created
//! private (0700), and an entry is used only if it and its folder belong to
//! this user and nobody else can write them.

use super::PluginError;
use hearth_ops::durable::write_atomically;
use sha2::{Digest, Sha256};
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use wasmtime::component::Component;
use wasmtime::Engine;

/// The compile cache.
pub struct ComponentCache {
    dir: PathBuf,
    engine_hash: u64,
}

impl ComponentCache {
    /// The folder from the environment, if one can be named.
    pub fn default_location() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("HEARTH_CACHE_DIR") {
            return Some(PathBuf::from(dir));
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("hearth").join("components"))
    }

    /// A cache in `dir` for components compiled by `engine`.
    pub fn new(dir: PathBuf, engine: &Engine) -> Self {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut hasher);
        Self {
            dir,
            engine_hash: hasher.finish(),
        }
    }

    /// The entry file for a component's bytes.
    pub fn entry_path(&self, component: &[u8]) -> PathBuf {
        let digest = Sha256::digest(component);
        self.dir.join(format!(
            "{}-{:016x}.cwasm",
            hex::encode(digest),
            self.engine_hash
        ))
    }

    /// Loads the compiled component for `bytes`, or compiles it with
    /// `compile` and stores the result.
    pub fn get_or_compile(
        &self,
        engine: &Engine,
        bytes: &[u8],
        compile: impl FnOnce() -> Result<Component, PluginError>,
    ) -> Result<Component, PluginError> {
        let path = self.entry_path(bytes);
        if let Some(component) = self.load(engine, &path) {
            return Ok(component);
        }
        let component = compile()?;
        if let Err(e) = self.store(&path, &component) {
            tracing::debug!("could not write plugin cache entry {}: {e}", path.display());
        }
        Ok(component)
    }

    fn load(&self, engine: &Engine, path: &Path) -> Option<Component> {
        if !path.exists() {
            return None;
        }
        if let Err(why) = private(&self.dir).and_then(|()| private(path)) {
            tracing::warn!("not using plugin cache entry {}: {why}", path.display());
            return None;
        }
        let data = std::fs::read(path).ok()?;
        if data.len() < 32 || Sha256::digest(&data[32..]).as_slice() != &data[..32] {
            tracing::warn!(
                "plugin cache entry {} is corrupt; recompiling",
                path.display()
            );
            return None;
        }
        // SAFETY: the entry is in a folder only this user can write (checked
        // above), and its checksum matches, so it is what `Component::serialize`
        // of an engine with this compatibility hash (in the file name) wrote.
        match unsafe { Component::deserialize(engine, &data[32..]) } {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(
                    "plugin cache entry {} is unusable ({e}); recompiling",
                    path.display()
                );
                None
            }
        }
    }

    fn store(&self, path: &Path, component: &Component) -> std::io::Result<()> {
        let payload = component.serialize().map_err(std::io::Error::other)?;
        create_private_dir(&self.dir)?;
        write_atomically(path, |f| {
            f.write_all(&Sha256::digest(&payload))?;
            f.write_all(&payload)
        })
    }
}

/// Creates `dir` (and missing parents) readable and writable by this user only.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
    }
    #[cfg(not(unix))]
    std::fs::create_dir_all(dir)
}

/// Whether `path` belongs to this user and only this user can write it.
fn private(path: &Path) -> Result<(), String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
        if meta.mode() & 0o022 != 0 {
            return Err(format!(
                "{} is writable by others (mode {:o})",
                path.display(),
                meta.mode() & 0o777
            ));
        }
        // /proc/self belongs to this process's effective user.
        if let Ok(me) = std::fs::metadata("/proc/self") {
            if meta.uid() != me.uid() {
                return Err(format!(
                    "{} belongs to another user (uid {})",
                    path.display(),
                    meta.uid()
                ));
            }
        }
    }
    let _ = path;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const WAT: &str = r#"(component (core module (func (export "f"))))"#;

    /// A folder (not yet there) for a cache to create, in a temporary
    /// folder removed when `tmp` is dropped.
    fn scratch(tmp: &tempfile::TempDir) -> PathBuf {
        tmp.path().join("cache")
    }

    /// Loads the test component through `cache`, counting compilations.
    fn load(
        cache: &ComponentCache,
        engine: &Engine,
        compiled: &Cell<u32>,
    ) -> Result<(), PluginError> {
        cache
            .get_or_compile(engine, WAT.as_bytes(), || {
                compiled.set(compiled.get() + 1);
                // The text format needs wasmtime's `wat` feature, which the
                // binary does not build: the `wat` crate turns it to binary.
                let wasm = wat::parse_str(WAT).unwrap();
                Ok(Component::new(engine, wasm).unwrap())
            })
            .map(drop)
    }

    #[test]
    fn a_hit_skips_compiling_and_a_corrupt_or_truncated_entry_is_a_miss() {
        let engine = Engine::default();
        let tmp = tempfile::tempdir().unwrap();
        let dir = scratch(&tmp);
        let cache = ComponentCache::new(dir.clone(), &engine);
        let compiled = Cell::new(0);
        let get = || load(&cache, &engine, &compiled);
        get().unwrap();
        get().unwrap();
        assert_eq!(
            compiled.get(),
            1,
            "the second load must come from the cache"
        );

        let entry = cache.entry_path(WAT.as_bytes());
        let mut bytes = std::fs::read(&entry).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&entry, &bytes).unwrap();
        get().unwrap();
        assert_eq!(compiled.get(), 2, "a corrupt entry is recompiled");
        get().unwrap();
        assert_eq!(compiled.get(), 2, "and rewritten");

        std::fs::write(&entry, &bytes[..10]).unwrap();
        get().unwrap();
        assert_eq!(compiled.get(), 3, "a truncated entry is recompiled");
    }

    #[cfg(unix)]
    #[test]
    fn an_entry_others_can_write_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let engine = Engine::default();
        let tmp = tempfile::tempdir().unwrap();
        let dir = scratch(&tmp);
        let cache = ComponentCache::new(dir.clone(), &engine);
        let compiled = Cell::new(0);
        let get = || load(&cache, &engine, &compiled);
        get().unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "the cache folder is created private");
        let entry = cache.entry_path(WAT.as_bytes());
        std::fs::set_permissions(&entry, std::fs::Permissions::from_mode(0o666)).unwrap();
        get().unwrap();
        assert_eq!(compiled.get(), 2, "a world-writable entry is not trusted");
    }

    #[test]
    fn entries_are_keyed_by_content_and_engine() {
        let engine = Engine::default();
        let tmp = tempfile::tempdir().unwrap();
        let cache = ComponentCache::new(scratch(&tmp), &engine);
        assert_ne!(cache.entry_path(b"a"), cache.entry_path(b"b"));
        let other = Engine::new(wasmtime::Config::new().epoch_interruption(true)).unwrap();
        assert_ne!(
            cache.entry_path(b"a"),
            ComponentCache::new(scratch(&tmp), &other).entry_path(b"a")
        );
    }
}
