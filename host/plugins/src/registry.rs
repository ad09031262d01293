//! Finding plugins. The search path, in order: folders given with
//! `--plugin-dir`, the folders in `HEARTH_PLUGIN_PATH` (`:`-separated), the
//! project's `plugins/` (beside the run's config), the user's plugin folder
//! (where `hearth plugins install` puts plugins:
//! `$XDG_DATA_HOME/hearth/plugins`, else `~/.local/share/hearth/plugins`),
//! and the built-in set: embedded in the library (`builtin.rs`), or the
//! folder `$HEARTH_BUILTIN_PLUGINS` names instead.
//!
//! Each folder holds plugin folders (or is one). Names are unique across the
//! whole path: a duplicate is an error, so no plugin can pose as another.
//! The one exception is deliberate: a plugin in a folder the user names
//! (`--plugin-dir`, [`PluginSource::Flag`]) replaces the embedded built-in
//! of its name, and a log line says so.

use super::{builtin, Manifest, PluginError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where a search folder came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginSource {
    /// `--plugin-dir`.
    Flag,
    /// `HEARTH_PLUGIN_PATH`.
    Env,
    /// The project's `plugins/` folder.
    Project,
    /// The user's plugin folder (`hearth plugins install`).
    User,
    /// The plugins shipped with hearth.
    BuiltIn,
}

impl std::fmt::Display for PluginSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Flag => "--plugin-dir",
            Self::Env => "HEARTH_PLUGIN_PATH",
            Self::Project => "project",
            Self::User => "user",
            Self::BuiltIn => "built-in",
        })
    }
}

/// The folders searched for plugins, and whether the built-ins embedded in
/// the library come last.
#[derive(Debug, Clone, Default)]
pub struct SearchPath {
    dirs: Vec<(PluginSource, PathBuf)>,
    embedded: bool,
}

impl SearchPath {
    /// The standard path: `flag_dirs`, `HEARTH_PLUGIN_PATH`,
    /// `project/plugins`, the user's folder, built-ins.
    pub fn standard(flag_dirs: &[PathBuf], project: Option<&Path>) -> Self {
        let mut dirs: Vec<(PluginSource, PathBuf)> = flag_dirs
            .iter()
            .map(|d| (PluginSource::Flag, d.clone()))
            .collect();
        if let Some(path) = std::env::var_os("HEARTH_PLUGIN_PATH") {
            dirs.extend(
                std::env::split_paths(&path)
                    .filter(|p| !p.as_os_str().is_empty())
                    .map(|p| (PluginSource::Env, p)),
            );
        }
        if let Some(project) = project {
            dirs.push((PluginSource::Project, project.join("plugins")));
        }
        if let Some(user) = Self::user_dir() {
            dirs.push((PluginSource::User, user));
        }
        let builtin = Self::builtin_dir();
        let embedded = builtin.is_none();
        dirs.extend(builtin.map(|dir| (PluginSource::BuiltIn, dir)));
        Self { dirs, embedded }
    }

    /// Exactly these folders.
    pub fn only(dirs: impl IntoIterator<Item = (PluginSource, PathBuf)>) -> Self {
        Self {
            dirs: dirs.into_iter().collect(),
            embedded: false,
        }
    }

    /// These folders, then the built-ins embedded in the library.
    pub fn with_built_ins(mut self) -> Self {
        self.embedded = true;
        self
    }

    /// The user's plugin folder: `$XDG_DATA_HOME/hearth/plugins`, else
    /// `$HOME/.local/share/hearth/plugins` (none without either).
    pub fn user_dir() -> Option<PathBuf> {
        let data = std::env::var_os("XDG_DATA_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/share")))?;
        Some(data.join("hearth").join("plugins"))
    }

    /// The folder `$HEARTH_BUILTIN_PLUGINS` names, which stands in for the
    /// built-ins embedded in the library (to try plugins just built).
    pub fn builtin_dir() -> Option<PathBuf> {
        std::env::var_os("HEARTH_BUILTIN_PLUGINS")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    }

    /// The folders, in order.
    pub fn dirs(&self) -> &[(PluginSource, PathBuf)] {
        &self.dirs
    }

    fn describe(&self) -> String {
        let list: Vec<String> = self
            .dirs
            .iter()
            .map(|(s, d)| format!("{} ({s})", d.display()))
            .chain(self.embedded.then(|| match builtin::any() {
                true => "the built-ins".to_string(),
                false => "no built-ins (this hearth was built without them: HEARTH_EMBED_PLUGINS=0 or no plugin sources; set HEARTH_BUILTIN_PLUGINS to a folder of them)".to_string(),
            }))
            .collect();
        if list.is_empty() {
            "no folders".into()
        } else {
            list.join(", ")
        }
    }
}

/// A plugin found on the search path.
#[derive(Debug, Clone)]
pub struct Found {
    /// Its manifest.
    pub manifest: Manifest,
    /// Which search folder it came from.
    pub source: PluginSource,
}

/// A plugin folder whose `plugin.toml` was refused. It does not stop a run
/// that does not use it (a warning names it); a run that asks for it by
/// name gets the manifest's error.
#[derive(Debug, Clone)]
pub struct Broken {
    /// The name it goes by: its `name` key if that much reads, else its
    /// folder's name.
    pub name: String,
    /// Its `plugin.toml`.
    pub path: PathBuf,
    /// What is wrong with it.
    pub message: String,
}

impl Broken {
    fn new(dir: &Path, error: PluginError) -> Self {
        let path = dir.join("plugin.toml");
        let message = match error {
            PluginError::Manifest { message, .. } => message,
            other => other.to_string(),
        };
        let named = std::fs::read_to_string(&path)
            .ok()
            .and_then(|text| text.parse::<toml::Table>().ok())
            .and_then(|t| t.get("name")?.as_str().map(str::to_string));
        let folder = || {
            dir.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        };
        Self {
            name: named.unwrap_or_else(folder),
            path,
            message,
        }
    }

    /// The manifest's error, as reading it gave it.
    pub fn error(&self) -> PluginError {
        PluginError::Manifest {
            path: self.path.clone(),
            message: self.message.clone(),
        }
    }
}

/// All plugins on a search path.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    plugins: Vec<Found>,
    broken: Vec<Broken>,
    searched: String,
}

impl Registry {
    /// Reads every manifest on the path. A `--plugin-dir` that does not
    /// exist is an error; other missing folders are skipped. A manifest
    /// that does not read is set aside with a warning ([`Registry::broken`]).
    pub fn discover(path: &SearchPath) -> Result<Self, PluginError> {
        let mut plugins: Vec<Found> = Vec::new();
        let mut broken: Vec<Broken> = Vec::new();
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        for (source, dir) in path.dirs() {
            if !dir.is_dir() {
                if *source == PluginSource::Flag {
                    return Err(PluginError::Io {
                        path: dir.clone(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            "--plugin-dir is not a folder",
                        ),
                    });
                }
                continue;
            }
            for plugin_dir in plugin_folders(dir)? {
                let manifest = match Manifest::read(&plugin_dir) {
                    Ok(manifest) => manifest,
                    Err(e) => {
                        tracing::warn!(
                            "skipping plugin folder {}: {e}; a run that uses it stops with this error",
                            plugin_dir.display()
                        );
                        broken.push(Broken::new(&plugin_dir, e));
                        continue;
                    }
                };
                if let Some(first) = seen.get(&manifest.name) {
                    return Err(PluginError::Duplicate {
                        name: manifest.name,
                        first: first.clone(),
                        second: plugin_dir,
                    });
                }
                seen.insert(manifest.name.clone(), plugin_dir);
                plugins.push(Found {
                    manifest,
                    source: *source,
                });
            }
        }
        if path.embedded {
            for manifest in builtin::manifests() {
                match plugins.iter().find(|f| f.manifest.name == manifest.name) {
                    None => plugins.push(Found {
                        manifest,
                        source: PluginSource::BuiltIn,
                    }),
                    Some(found) if found.source == PluginSource::Flag => tracing::info!(
                        "plugin `{}` from {} replaces the built-in of that name",
                        manifest.name,
                        found.manifest.dir.display()
                    ),
                    Some(found) => {
                        return Err(builtin::shadowed(
                            &manifest.name,
                            found.manifest.dir.clone(),
                        ))
                    }
                }
            }
        }
        Ok(Self {
            plugins,
            broken,
            searched: path.describe(),
        })
    }

    /// The plugin folders whose manifests were refused, in search order.
    pub fn broken(&self) -> &[Broken] {
        &self.broken
    }

    /// Every plugin, in search order.
    pub fn plugins(&self) -> &[Found] {
        &self.plugins
    }

    /// The plugin called `name`; for one whose manifest was refused, that
    /// error.
    pub fn find(&self, name: &str) -> Result<&Found, PluginError> {
        if let Some(found) = self.plugins.iter().find(|f| f.manifest.name == name) {
            return Ok(found);
        }
        if let Some(broken) = self.broken.iter().find(|b| b.name == name) {
            return Err(broken.error());
        }
        Err(PluginError::NotFound {
            name: name.into(),
            searched: self.searched.clone(),
        })
    }
}

/// `dir` itself when it holds a `plugin.toml`, else its subfolders that do.
fn plugin_folders(dir: &Path) -> Result<Vec<PathBuf>, PluginError> {
    if dir.join("plugin.toml").is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let io = |source| PluginError::Io {
        path: dir.into(),
        source,
    };
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("plugin.toml").is_file())
        .collect();
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plugin(root: &Path, folder: &str, name: &str) {
        let dir = root.join(folder);
        std::fs::create_dir_all(&dir).unwrap();
        let text = format!(
            "name = \"{name}\"\nversion = \"1.0.0\"\nkind = \"tracker\"\nworld = \"hearth:plugin/tracker-plugin@0.3.0\"\ncomponent = \"x.wasm\"\n"
        );
        std::fs::write(dir.join("plugin.toml"), text).unwrap();
    }

    /// Two plugin folders in a temporary folder removed when `tmp` is dropped.
    fn two_folders(tmp: &tempfile::TempDir) -> (PathBuf, PathBuf) {
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        (a, b)
    }

    #[test]
    fn finds_plugins_in_order_and_names_the_missing_one() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = two_folders(&tmp);
        plugin(&a, "one", "one");
        plugin(&b, "two", "two");
        let reg = Registry::discover(&SearchPath::only([
            (PluginSource::Flag, a.clone()),
            (PluginSource::BuiltIn, b.clone()),
        ]))
        .unwrap();
        assert_eq!(reg.find("two").unwrap().source, PluginSource::BuiltIn);
        let err = reg.find("three").unwrap_err().to_string();
        assert!(
            err.contains("`three`") && err.contains(&a.display().to_string()),
            "{err}"
        );
    }

    #[test]
    fn a_duplicate_name_is_an_error_naming_both_folders() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = two_folders(&tmp);
        plugin(&a, "x", "same");
        plugin(&b, "y", "same");
        let err = Registry::discover(&SearchPath::only([
            (PluginSource::Flag, a),
            (PluginSource::BuiltIn, b),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`same`") && err.contains("/x") && err.contains("/y"),
            "{err}"
        );
    }

    #[test]
    fn a_broken_manifest_is_set_aside_and_named_only_when_asked_for() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = two_folders(&tmp);
        plugin(&a, "good", "good");
        std::fs::create_dir(b.join("bad")).unwrap();
        std::fs::write(
            b.join("bad/plugin.toml"),
            "name = \"bad\"\nkind = \"tracker\"\n",
        )
        .unwrap();
        let reg = Registry::discover(&SearchPath::only([
            (PluginSource::Flag, a),
            (PluginSource::BuiltIn, b.clone()),
        ]))
        .unwrap();
        assert!(reg.find("good").is_ok());
        assert_eq!(reg.broken().len(), 1);
        let err = reg.find("bad").unwrap_err().to_string();
        assert!(
            err.contains(&b.join("bad/plugin.toml").display().to_string())
                && err.contains("missing field"),
            "{err}"
        );
    }

    #[test]
    fn the_embedded_built_ins_come_last_and_a_named_folder_may_replace_one() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, _) = two_folders(&tmp);
        plugin(&a, "mine", "jsonl");
        let reg = Registry::discover(
            &SearchPath::only([(PluginSource::Flag, a.clone())]).with_built_ins(),
        )
        .unwrap();
        let jsonl = reg.find("jsonl").unwrap();
        assert_eq!(jsonl.source, PluginSource::Flag);
        assert!(!jsonl.manifest.is_embedded());
        let csv = reg.find("csv").unwrap();
        assert_eq!(csv.source, PluginSource::BuiltIn);
        assert!(csv.manifest.is_embedded());
        assert!(csv
            .manifest
            .component_bytes()
            .unwrap()
            .starts_with(b"\0asm"));
        for name in ["cosine", "tensorboard", "manifest-sha256", "size-based"] {
            assert!(reg.find(name).is_ok(), "{name} is built in");
        }
    }

    #[test]
    fn a_plugin_in_a_folder_the_user_did_not_name_may_not_take_a_built_ins_name() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, _) = two_folders(&tmp);
        plugin(&a, "mine", "cosine");
        for source in [PluginSource::Env, PluginSource::Project, PluginSource::User] {
            let path = SearchPath::only([(source, a.clone())]).with_built_ins();
            let err = Registry::discover(&path).unwrap_err().to_string();
            assert!(
                err.contains("`cosine`")
                    && err.contains(&a.join("mine").display().to_string())
                    && err.contains("--plugin-dir"),
                "{err}"
            );
        }
    }

    #[test]
    fn a_missing_plugin_dir_flag_is_an_error() {
        let path = SearchPath::only([(PluginSource::Flag, PathBuf::from("/no/such/dir"))]);
        assert!(Registry::discover(&path)
            .unwrap_err()
            .to_string()
            .contains("/no/such/dir"));
    }
}
