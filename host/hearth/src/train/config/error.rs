//! Config errors: each names the file, and the key where there is one.

use std::path::PathBuf;

/// Why a config file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("failed to read config {path}")]
    Read {
        /// The config file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Not valid TOML, an unknown key, or a value of the wrong type (the
    /// message names the key, the line and the column).
    #[error("invalid config {path}: {message}")]
    Parse {
        /// The config file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A value that parses but cannot be used.
    #[error("invalid config {path}: key `{key}` {message}")]
    Invalid {
        /// The config file.
        path: PathBuf,
        /// The dotted key (`optimizer.lr`).
        key: String,
        /// What is wrong and what to do.
        message: String,
    },
}
