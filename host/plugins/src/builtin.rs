//! The built-in plugins, embedded in the library by the build script
//! (`build/embed.rs`): a program that links hearth has them wherever it
//! runs, with no plugin folder beside it.

use super::{Manifest, PluginError};
use std::path::{Path, PathBuf};

include!(concat!(env!("OUT_DIR"), "/builtin.rs"));

/// The pseudo-folder an embedded built-in's messages name.
pub(crate) fn pseudo_dir(name: &str) -> PathBuf {
    Path::new("<built-in>").join(name)
}

/// Every embedded built-in's manifest, in name order.
pub(crate) fn manifests() -> Vec<Manifest> {
    BUILT_IN
        .iter()
        .map(|(text, component)| {
            let mut manifest = Manifest::parse(text, Path::new("<built-in>"))
                .unwrap_or_else(|e| panic!("an embedded built-in's manifest is invalid: {e}"));
            manifest.dir = pseudo_dir(&manifest.name);
            manifest.embedded = Some(component);
            manifest
        })
        .collect()
}

/// True when this build embeds built-ins (`HEARTH_EMBED_PLUGINS=0` or a
/// build without the plugins' sources embeds none).
pub(crate) fn any() -> bool {
    !BUILT_IN.is_empty()
}

/// The error for a plugin that takes an embedded built-in's name from a
/// folder the user did not name.
pub(crate) fn shadowed(name: &str, dir: PathBuf) -> PluginError {
    PluginError::ShadowsBuiltIn {
        name: name.into(),
        dir,
    }
}
