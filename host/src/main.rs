//! The `hearth` binary: all logic lives in the library's `cli` module.

fn main() {
    let code = hearth::cli::main();
    hearth::cli::exit(code)
}
