//! `hearth plugins list | inspect NAME | check PATH | schedule NAME |
//! lock CONFIG`, and the author's `new | build | install | pack | wit` (in
//! `authoring/`).

use super::authoring;
use super::Failure;
use clap::{Args, Subcommand};
use hearth::train::TrainConfig;
use hearth_plugins::{check_plugin, load_scheduler, Manifest, PluginKind, Registry, SearchPath};
use std::path::{Path, PathBuf};

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
    /// List installed plugins: name, version, kind, WIT world, where found,
    /// and the sha256 of each component (what a pin names).
    List,
    /// Pin the plugins CONFIG uses: write the sha256 of each one's component
    /// into hearth.lock beside it; `hearth run` then refuses any other.
    Lock {
        /// The run config.
        config: PathBuf,
    },
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
    /// Print the rates a scheduler plugin gives, one step per line (`step lr…`).
    Schedule(ScheduleArgs),
    /// Write a new plugin project: manifest, implementation and a test.
    New {
        /// What it customises: tracker, scheduler, checkpoint-hook or wrap-policy.
        #[arg(value_parser = plugin_kind)]
        kind: PluginKind,
        /// Its name (in configs: `[[trackers]] name = "…"`).
        name: String,
        /// The language.
        #[arg(long, value_enum, default_value = "rust")]
        lang: authoring::Lang,
        /// The project's folder (default: ./NAME).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Build the project in DIR for wasm32-wasip2 and lay out its plugin
    /// folder (target/hearth-plugin/NAME: plugin.toml and the component).
    Build {
        /// The project (default: .).
        #[arg(default_value = ".")]
        dir: PathBuf,
    },
    /// Check a built plugin (a folder, a project after `build`, or a .tar.gz
    /// from `pack`) and copy it into the plugin folder hearth searches.
    Install {
        /// What to install.
        path: PathBuf,
        /// Where (default: HEARTH_PLUGIN_PATH's first folder, else
        /// $XDG_DATA_HOME/hearth/plugins or ~/.local/share/hearth/plugins).
        #[arg(long, value_name = "DIR")]
        to: Option<PathBuf>,
    },
    /// Write a built plugin as NAME-VERSION.tar.gz to share; prints its sha256.
    Pack {
        /// The plugin folder or project (default: .).
        #[arg(default_value = ".")]
        path: PathBuf,
        /// The archive to write.
        #[arg(short, long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Print the WIT package this hearth speaks (what a plugin is built against).
    Wit,
}

/// Arguments of `hearth plugins schedule`.
#[derive(Debug, Args)]
struct ScheduleArgs {
    /// The scheduler plugin's name.
    name: String,
    /// Base rate of a parameter group (repeat for more groups).
    #[arg(long, default_value = "0.001")]
    lr: Vec<f64>,
    /// Steps to print (and the run's total steps the schedule is told).
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// The schedule's options, a JSON object (as the config's `[scheduler]` table).
    #[arg(long, default_value = "{}")]
    options: String,
    /// Comma-separated metrics, the i-th observed before step i+1 (reduce-on-plateau).
    #[arg(long, value_delimiter = ',')]
    observe: Vec<f64>,
    /// At this step, save the schedule's state, load it into a fresh instance and go on with that.
    #[arg(long, value_name = "STEP")]
    reload_at: Option<u64>,
}

/// A kind as manifests spell it.
fn plugin_kind(text: &str) -> Result<PluginKind, String> {
    let kinds = [
        PluginKind::Tracker,
        PluginKind::Scheduler,
        PluginKind::CheckpointHook,
        PluginKind::WrapPolicy,
    ];
    kinds
        .into_iter()
        .find(|k| k.as_str() == text)
        .ok_or_else(|| {
            let names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
            format!("one of {}", names.join(", "))
        })
}

fn schedule(registry: &Registry, args: &ScheduleArgs) -> Result<(), Failure> {
    let manifest = &registry
        .find(&args.name)
        .map_err(Failure::bad_input)?
        .manifest;
    let load = || {
        load_scheduler(manifest, &args.options, &args.lr, Some(args.steps))
            .map_err(Failure::bad_input)
    };
    let mut schedule = load()?;
    for step in 0..args.steps {
        if step > 0 {
            if let Some(metric) = args.observe.get(step as usize - 1) {
                schedule.observe(*metric).map_err(Failure::failed)?;
            }
        }
        if args.reload_at == Some(step) {
            let state = schedule.save().map_err(Failure::failed)?;
            schedule = load()?;
            schedule.load(&state).map_err(Failure::failed)?;
        }
        let lrs = schedule.lrs(step).map_err(Failure::failed)?;
        let lrs: Vec<String> = lrs.iter().map(|lr| format!("{lr:e}")).collect();
        println!("{step} {}", lrs.join(" "));
    }
    Ok(())
}

/// `hearth plugins lock CONFIG`: the sha256 of each plugin the config
/// uses, found as `hearth run CONFIG` finds it, into hearth.lock beside it
/// (pins of plugins it does not use are kept: the lock serves every config
/// in the folder).
fn lock(args: &PluginsArgs, config_path: &Path) -> Result<(), Failure> {
    let config = TrainConfig::from_file(config_path).map_err(Failure::bad_input)?;
    let project = config_path.parent().unwrap_or(Path::new("."));
    let reg = Registry::discover(&SearchPath::standard(&args.plugin_dirs, Some(project)))
        .map_err(Failure::bad_input)?;
    let mut lock = config.lock.clone();
    for name in config.used_plugins().map_err(Failure::bad_input)? {
        let found = reg.find(&name).map_err(Failure::bad_input)?;
        let sha256 = found
            .manifest
            .component_sha256()
            .map_err(Failure::bad_input)?;
        let what = match lock.plugins.insert(name.clone(), sha256.clone()) {
            None => "pinned".to_string(),
            Some(old) if old == sha256 => "unchanged".to_string(),
            Some(old) => format!("re-pinned (was {old})"),
        };
        println!("{name:<24} {sha256}  {what}");
        if let Some(pin) = config.table_pin(&name).filter(|p| *p != sha256) {
            println!("  note: the config itself pins {name} to {pin}: edit its sha256 key");
        }
    }
    let path = lock.write_for(config_path).map_err(Failure::failed)?;
    println!("wrote {}", path.display());
    Ok(())
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
    let component = m.component.display();
    out += &match m.is_embedded() {
        true => format!("  component:   {component}, embedded in hearth\n"),
        false => format!("  component:   {}\n", m.component_path().display()),
    };
    let fs = match (m.kind, m.permissions.logging_dir) {
        (hearth_plugins::PluginKind::Tracker, true) => "its logging folder, read-write, at /logs",
        (hearth_plugins::PluginKind::CheckpointHook, _) => {
            "the checkpoint folder at /checkpoint (read-write while saving, read-only while loading)"
        }
        _ => "none",
    };
    let asked = |items: &[String], what: &str| match items.is_empty() {
        true => "none".to_string(),
        false => format!(
            "asks for {} (a run grants them in [plugin-permissions.{}] {what})",
            items.join(", "),
            m.name
        ),
    };
    let network = asked(&m.permissions.network, "network");
    let env = asked(&m.permissions.env, "env");
    out += &format!("  permissions: files: {fs}; network: {network}; environment: {env}\n");
    let l = &m.limits;
    out += &format!(
        "  limits:      memory {} MiB, {} ms per call, folder {} MiB and {} files, output {} lines \
         and {} bytes per call and {} lines per run",
        l.memory_mb,
        l.call_timeout_ms,
        l.disk_mb,
        l.files,
        l.log_lines_per_call,
        l.log_bytes_per_call,
        l.log_lines_per_run
    );
    if !m.permissions.network.is_empty() {
        out += &format!(
            "; network {} bytes out and {} in per request, {} ms per request, {} requests a \
             minute, {} at once",
            l.request_bytes,
            l.response_bytes,
            l.request_timeout_ms,
            l.requests_per_minute,
            l.concurrent_requests
        );
    }
    if m.options.is_empty() {
        out += "\n  options:     none declared (what the config gives is passed unchecked)";
    }
    for (i, (key, spec)) in m.options.iter().enumerate() {
        let default = spec
            .default
            .as_ref()
            .map(|d| format!(", default {d}"))
            .unwrap_or_default();
        let label = if i == 0 { "options:" } else { "" };
        out += &format!("\n  {label:<12} {key} ({}{default})", spec.ty);
        if !spec.description.is_empty() {
            out += &format!(": {}", spec.description);
        }
    }
    if !m.presets.is_empty() {
        let presets: Vec<String> = m
            .presets
            .iter()
            .map(|(k, v)| format!("{k} = {v}"))
            .collect();
        out += &format!("\n  presets:     {}", presets.join(", "));
    }
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
            } else {
                let mut t =
                    super::table(&["name", "version", "kind", "world", "found in", "sha256"]);
                for f in reg.plugins() {
                    let m = &f.manifest;
                    let sha256 = m.component_sha256().unwrap_or_else(|e| format!("({e})"));
                    t.add_row(vec![
                        m.name.clone(),
                        m.version.to_string(),
                        m.kind.to_string(),
                        m.world.clone(),
                        format!("{} ({})", m.dir.display(), f.source),
                        sha256,
                    ]);
                }
                println!("{t}");
            }
            for b in reg.broken() {
                println!(
                    "not loadable: `{}` ({}): {}",
                    b.name,
                    b.path.display(),
                    b.message
                );
            }
        }
        PluginsCommand::Lock { config } => lock(&args, config)?,
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
        PluginsCommand::Schedule(schedule_args) => schedule(&registry(&args)?, schedule_args)?,
        PluginsCommand::New {
            kind,
            name,
            lang,
            dir,
        } => {
            let dir = dir.clone().unwrap_or_else(|| PathBuf::from(name));
            authoring::new_project(*kind, name, *lang, &dir).map_err(Failure::bad_input)?;
            println!(
                "wrote a {kind} plugin project in {}: `hearth plugins build {}` builds it",
                dir.display(),
                dir.display()
            );
        }
        PluginsCommand::Build { dir } => {
            let built = authoring::build(dir).map_err(Failure::failed)?;
            println!(
                "built {} (`hearth plugins install {}` installs it)",
                built.display(),
                dir.display()
            );
        }
        PluginsCommand::Install { path, to } => {
            let to = match to {
                Some(to) => to.clone(),
                None => authoring::user_plugin_dir().map_err(Failure::bad_input)?,
            };
            let installed = authoring::install(path, &to).map_err(Failure::bad_input)?;
            println!("installed {}", installed.display());
        }
        PluginsCommand::Pack { path, out } => {
            let (archive, sha256) =
                authoring::pack(path, out.as_deref()).map_err(Failure::bad_input)?;
            println!("{sha256}  {}", archive.display());
        }
        PluginsCommand::Wit => print!("{}", authoring::WIT),
    }
    Ok(())
}
