//! `hearth plugins check`: everything load does, without a run.

use super::inspect::{check_is_component, check_world, report};
use super::{load_tracker, ComponentReport, Manifest, PluginEngine, PluginError, PluginKind};

/// Compiles the plugin, checks its world and version and, for kinds the
/// host can already run, instantiates it in its sandbox (with a throwaway
/// logging folder). Returns what the component exports and imports.
pub fn check_plugin(manifest: &Manifest) -> Result<ComponentReport, PluginError> {
    let path = manifest.component_path();
    let bytes = std::fs::read(&path).map_err(|source| PluginError::Io {
        path: path.clone(),
        source,
    })?;
    check_is_component(&manifest.name, &path, &bytes)?;
    let engine = PluginEngine::global();
    let component = engine.compile(&manifest.name, &path, &bytes)?;
    let found = report(engine.engine(), &component);
    check_world(&manifest.name, &path, manifest.kind, &found)?;
    if manifest.kind == PluginKind::Tracker {
        let scratch = std::env::temp_dir().join(format!(
            "hearth-check-{}-{}",
            manifest.name,
            std::process::id()
        ));
        let result = load_tracker(manifest, &scratch).map(drop);
        let _ = std::fs::remove_dir_all(&scratch);
        result?;
    }
    Ok(found)
}
