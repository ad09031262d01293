//! `hearth plugins install PATH` and `hearth plugins pack [DIR]`.
//!
//! Both take a built plugin folder (a `plugin.toml` and its component), a
//! project whose `hearth plugins build` laid one out, or (install) a
//! `.tar.gz` that `pack` made. `pack` writes the folder as a reproducible
//! archive (fixed order, times, owners and modes), so its sha256 names the
//! plugin's bytes: the same build packs to the same hash.

use anyhow::{bail, Context};
use hearth_plugins::{check_plugin, Manifest, SearchPath};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Where `install` puts plugins when not told: the first folder of
/// `HEARTH_PLUGIN_PATH`, else the user's plugin folder (which `hearth run`
/// searches).
pub(in super::super) fn user_plugin_dir() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("HEARTH_PLUGIN_PATH") {
        if let Some(first) = std::env::split_paths(&path).find(|p| !p.as_os_str().is_empty()) {
            return Ok(first);
        }
    }
    SearchPath::user_dir()
        .context("neither HEARTH_PLUGIN_PATH, XDG_DATA_HOME nor HOME is set: pass --to DIR")
}

/// The plugin folder `path` stands for: itself when it holds a built
/// plugin (its manifest's component is there), else the folder its
/// `hearth plugins build` laid out.
fn plugin_folder(path: &Path) -> anyhow::Result<PathBuf> {
    let manifest = Manifest::read(path)?;
    if manifest.component_path().exists() {
        return Ok(path.to_path_buf());
    }
    let built = super::built_dir(path, &manifest.name);
    if built.join("plugin.toml").exists() {
        return Ok(built);
    }
    bail!(
        "{} holds no built plugin ({} is missing): run `hearth plugins build {}` first",
        path.display(),
        manifest.component_path().display(),
        path.display()
    )
}

/// Checks the plugin at `path` (a folder, a project or a `.tar.gz`) loads
/// in this host, then copies its manifest and component into `to/<name>/`,
/// replacing an older copy only once the new one is whole. Returns the
/// installed folder.
pub(in super::super) fn install(path: &Path, to: &Path) -> anyhow::Result<PathBuf> {
    let unpacked = tempfile::tempdir().context("making a scratch folder")?;
    let source = if path.is_file() {
        unpack(path, unpacked.path())?
    } else {
        plugin_folder(path)?
    };
    let manifest = Manifest::read(&source)?;
    check_plugin(&manifest)?;
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    let dest = to.join(&manifest.name);
    let staging = to.join(format!(".{}.installing", manifest.name));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging)?;
    for file in [PathBuf::from("plugin.toml"), manifest.component.clone()] {
        let target = staging.join(&file);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::copy(source.join(&file), &target)
            .with_context(|| format!("copying {} into {}", file.display(), staging.display()))?;
    }
    if dest.exists() {
        let old = to.join(format!(".{}.replaced", manifest.name));
        let _ = std::fs::remove_dir_all(&old);
        std::fs::rename(&dest, &old)?;
        std::fs::rename(&staging, &dest)?;
        std::fs::remove_dir_all(&old)?;
    } else {
        std::fs::rename(&staging, &dest)?;
    }
    Ok(dest)
}

/// The plugin folder inside the archive `file`, unpacked into `into`.
fn unpack(file: &Path, into: &Path) -> anyhow::Result<PathBuf> {
    let open = std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(open));
    // tar's unpack refuses entries that would land outside `into`.
    archive.unpack(into).with_context(|| {
        format!(
            "{} is not a plugin archive made by `hearth plugins pack`",
            file.display()
        )
    })?;
    let mut folders = std::fs::read_dir(into)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir());
    match (folders.next(), folders.next()) {
        (Some(one), None) => Ok(one),
        _ => bail!(
            "{} should hold one plugin folder (as `hearth plugins pack` makes it)",
            file.display()
        ),
    }
}

/// Writes the plugin at `path` as `<name>-<version>.tar.gz` in `out_dir`
/// (or as `out`); returns the archive and its sha256.
pub(in super::super) fn pack(path: &Path, out: Option<&Path>) -> anyhow::Result<(PathBuf, String)> {
    let folder = plugin_folder(path)?;
    let manifest = Manifest::read(&folder)?;
    check_plugin(&manifest)?;
    let archive = match out {
        Some(o) => o.to_path_buf(),
        None => PathBuf::from(format!("{}-{}.tar.gz", manifest.name, manifest.version)),
    };
    let file = std::fs::File::create(&archive)
        .with_context(|| format!("creating {}", archive.display()))?;
    let gz = flate2::GzBuilder::new()
        .mtime(0)
        .write(file, flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    let mut files = vec![PathBuf::from("plugin.toml"), manifest.component.clone()];
    files.sort();
    for name in files {
        let bytes = std::fs::read(folder.join(&name))
            .with_context(|| format!("reading {}", name.display()))?;
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        header.set_cksum();
        tar.append_data(
            &mut header,
            Path::new(&manifest.name).join(&name),
            bytes.as_slice(),
        )?;
    }
    tar.into_inner()?.finish()?.sync_all()?;
    let digest = Sha256::digest(std::fs::read(&archive)?);
    Ok((archive, format!("{digest:x}")))
}
