//! `outbox-lab`: the lab, the bench, the soak and the demo, in a binary of
//! their own so the production binary `outbox` links neither them nor the
//! testkit. The relays they drive are children of `outbox` (`OUTBOX_BIN`,
//! else the `outbox` beside this binary).
//!
//! `main` only parses, sets up logging, runs a command and maps its error to
//! an exit code: 0 success (every verdict and check holds), 1 a runtime
//! failure or a check that found a problem, 2 a usage or configuration
//! error (see `exit.rs`).

mod cli;
mod exit;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let log_format = cli.global.log_format;
    cli::init_logging(log_format, cli.command.default_log_filter());
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            let e = anyhow::Error::new(e).context("starting the tokio runtime");
            return exit::report(&e, log_format);
        }
    };
    match runtime.block_on(cli.run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => exit::report(&e, log_format),
    }
}
