//! The `hearth` binary: the command line over the `hearth` library. Each
//! subcommand has its own file under `cli/`; `report/` draws `hearth
//! report`'s pages.

mod cli;
mod report;

fn main() {
    let code = cli::main();
    cli::exit(code)
}
