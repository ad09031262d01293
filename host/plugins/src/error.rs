//! Plugin errors: each names the plugin or its file and says what to do.

use std::path::PathBuf;

/// Why a plugin could not be found, loaded or called.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// No plugin of that name in the search path.
    #[error("no plugin named `{name}` in {searched}; install it into one of those folders or pass --plugin-dir")]
    NotFound {
        /// The name asked for.
        name: String,
        /// The folders searched, for the message.
        searched: String,
    },
    /// Two plugin folders declare the same name.
    #[error("two plugins are named `{name}`: {first} and {second}; rename one (plugin names must be unique, so no plugin can stand in for another)")]
    Duplicate {
        /// The name.
        name: String,
        /// One folder.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// A plugin in a folder the user did not name (`HEARTH_PLUGIN_PATH`,
    /// the project's or the user's folder) has a built-in's name.
    #[error("the plugin in {dir} is named `{name}`, like a plugin built into hearth; rename it, or name its folder with --plugin-dir (a `PluginSource::Flag` folder of the `SearchPath` in Rust) to use it instead of the built-in")]
    ShadowsBuiltIn {
        /// The name.
        name: String,
        /// The plugin's folder.
        dir: PathBuf,
    },
    /// A file could not be read.
    #[error("failed to read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `plugin.toml` is invalid.
    #[error("invalid plugin manifest {path}: {message}")]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The component is refused before it runs.
    #[error("plugin `{name}` ({path}) refused: {reason}")]
    Refused {
        /// The plugin.
        name: String,
        /// Its component file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// An option the run config gives a plugin is not one it declares, or
    /// has the wrong type.
    #[error("plugin `{name}`: option `{key}` {message}")]
    Option {
        /// The plugin.
        name: String,
        /// The option's key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// Instantiation or a call failed.
    #[error("plugin `{name}`: {message}")]
    Runtime {
        /// The plugin.
        name: String,
        /// What happened.
        message: String,
    },
}
