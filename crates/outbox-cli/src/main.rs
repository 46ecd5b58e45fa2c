//! `outbox`: the command-line face of the transactional outbox.
//!
//! `main` only parses, sets up logging, runs a command and maps its error to
//! an exit code: 0 success (including a drain after SIGINT/SIGTERM), 1 a
//! runtime failure, 2 a usage or configuration error.

mod cli;
mod commands;
mod exit;
mod logging;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    // The demo prints its own story; relay info lines would interleave with it.
    let default_filter = match cli.command {
        cli::Command::Demo(_) | cli::Command::Bench(_) => "warn",
        // lapin warns with the whole message, payload included, for each
        // unroutable one; the row's last_error already says so.
        _ => "info,tokio_postgres=warn,lapin=error",
    };
    logging::init(cli.global.log_format, default_filter);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => return exit::report(&anyhow::Error::new(e).context("starting the tokio runtime")),
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => exit::report(&e),
    }
}
