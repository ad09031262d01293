//! The `hearth` binary: all logic lives in the library's `cli` module.

fn main() -> std::process::ExitCode {
    hearth::cli::main()
}
