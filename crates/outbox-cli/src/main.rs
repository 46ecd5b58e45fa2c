//! `outbox`: the command-line face of the transactional outbox.
//!
//! `main` only parses, sets up logging, runs a command and maps its error to
//! an exit code: 0 success (including a drain after SIGINT/SIGTERM), 1 a
//! runtime failure, 2 a usage or configuration error.

mod cli;
mod commands;
mod config;
mod endpoint;
mod exit;
mod logging;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};

fn main() -> ExitCode {
    let cli = cli::Cli::try_parse().unwrap_or_else(|e| exit::usage(e, &cli::Cli::command()));
    // lapin warns with the whole message, payload included, for each
    // unroutable one; the row's last_error already says so.
    let default_filter = "info,tokio_postgres=warn,lapin=error";
    let log_format = cli.global.log_format;
    logging::init(log_format, default_filter);
    // The relay is one flow of awaits over three sockets: on one thread it
    // pays no cross-thread wake-ups (futex calls) per round trip, which
    // measured about half its CPU time at batch size 1. The short commands
    // keep the pool.
    let mut builder = match cli.command {
        cli::Command::Relay(_) => {
            return_large_allocations();
            tokio::runtime::Builder::new_current_thread()
        }
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            let e = anyhow::Error::new(e).context("starting the tokio runtime");
            return exit::report(&e, log_format);
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => exit::report(&e, log_format),
    }
}

/// Makes glibc's malloc hand every block of 1 MiB or more back to the
/// system when it is freed. By default the threshold adapts: once a large
/// block is freed, blocks up to its size come from the heap instead, where
/// freed memory stays resident and a growing buffer is copied rather than
/// remapped. Measured with a backlog of 30 MB events through the HTTP sink
/// (debug build): peak RSS 150 MB by default, 85 MB with this. A relay
/// makes a handful of such blocks per large event and none for small ones.
#[allow(unsafe_code)]
fn return_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a tunable of the allocator, which is
    // thread-safe; no pointer is passed.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}
