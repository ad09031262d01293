//! `hearth plugins list | inspect NAME | check PATH`.

use super::Failure;
use crate::plugins::{check_plugin, Manifest, Registry, SearchPath};
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// Arguments of `hearth plugins`.
#[derive(Debug, Args)]
pub(super) struct PluginsArgs {
    #[command(subcommand)]
    command: PluginsCommand,
    /// Also look for plugins here (before HEARTH_PLUGIN_PATH and the built-ins).
    #[arg(long = "plugin-dir", value_name = "DIR", global = true)]
    plugin_dirs: Vec<PathBuf>,
    /// Also look in the project's plugins/ folder beside this run config, as `hearth run` does.
    #[arg(long, value_name = "CONFIG", global = true)]
    config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum PluginsCommand {
    /// List installed plugins: name, version, kind, WIT world, where found.
    List,
    /// Show one plugin's manifest, permissions and limits, and whether it loads.
    Inspect {
        /// The plugin's name.
        name: String,
    },
    /// Check the plugin in a folder (its plugin.toml and component) loads in this host.
    Check {
        /// The plugin's folder.
        path: PathBuf,
    },
}

fn registry(args: &PluginsArgs) -> Result<Registry, Failure> {
    let project = args
        .config
        .as_deref()
        .map(|c| c.parent().unwrap_or(std::path::Path::new(".")));
    Registry::discover(&SearchPath::standard(&args.plugin_dirs, project))
        .map_err(Failure::bad_input)
}

fn describe(m: &Manifest) -> String {
    let mut out = format!("{} {} ({})\n", m.name, m.version, m.kind);
    if !m.description.is_empty() {
        out += &format!("  {}\n", m.description);
    }
    out += &format!("  world:       {}\n", m.world);
    out += &format!("  component:   {}\n", m.component_path().display());
    let fs = match (m.kind, m.permissions.logging_dir) {
        (crate::plugins::PluginKind::Tracker, true) => "its logging folder, read-write, at /logs",
        _ => "none",
    };
    out += &format!("  permissions: files: {fs}; network: none; environment: none\n");
    out += &format!(
        "  limits:      memory {} MiB, {} ms per call",
        m.limits.memory_mb, m.limits.call_timeout_ms
    );
    out
}

fn verdict(m: &Manifest) -> Result<String, Failure> {
    let report = check_plugin(m).map_err(Failure::bad_input)?;
    let exports: Vec<String> = report
        .exports
        .iter()
        .map(|(i, v)| format!("hearth:plugin/{i}@{v}"))
        .collect();
    Ok(format!(
        "  loads:       yes (exports {}; imports {})",
        exports.join(", "),
        report.imports.len()
    ))
}

pub(super) fn execute(args: PluginsArgs) -> Result<(), Failure> {
    match &args.command {
        PluginsCommand::List => {
            let reg = registry(&args)?;
            if reg.plugins().is_empty() {
                println!("no plugins found");
            }
            println!(
                "{:<16} {:<9} {:<16} {:<40} FOUND IN",
                "NAME", "VERSION", "KIND", "WORLD"
            );
            for f in reg.plugins() {
                let m = &f.manifest;
                println!(
                    "{:<16} {:<9} {:<16} {:<40} {} ({})",
                    m.name,
                    m.version,
                    m.kind.to_string(),
                    m.world,
                    m.dir.display(),
                    f.source
                );
            }
        }
        PluginsCommand::Inspect { name } => {
            let reg = registry(&args)?;
            let found = reg.find(name).map_err(Failure::bad_input)?;
            println!("{}", describe(&found.manifest));
            println!("  found in:    {}", found.source);
            println!("{}", verdict(&found.manifest)?);
        }
        PluginsCommand::Check { path } => {
            let manifest = Manifest::read(path).map_err(Failure::bad_input)?;
            println!("{}", describe(&manifest));
            println!("{}", verdict(&manifest)?);
        }
    }
    Ok(())
}
