//! The `tpar` command: benchmark and check tpar's allreduce on this machine.
//!
//! Commands that need ranks start them (`--world-size N` processes of this same binary on this
//! host), or run as one rank when an outside launcher set the rank environment (see
//! `tpar help bench` and the README).

mod args;
mod backend_choice;
mod bench;
mod debug_rank;
mod known;
mod ranks;
mod report;
mod selftest;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

const ABOUT: &str = "Low-latency allreduce for tensor-parallel inference on one host.";

const AFTER_HELP: &str = "\
Ranks: `tpar bench` and `tpar selftest` start --world-size copies of themselves on this host and
gather them through a private rendezvous directory. To run under your own launcher instead, set
for every process TPAR_RENDEZVOUS (a directory, created 0700), TPAR_JOB_TOKEN (the same secret
for all ranks, e.g. `openssl rand -hex 16`), RANK and WORLD_SIZE (torchrun sets the last two).

Examples:
  tpar bench                                  # default sweep, default backend
  tpar bench --backend cpu -n 4 --sizes 4K,256K --json -
  tpar selftest --backend cpu -n 8";

#[derive(Parser, Debug)]
#[command(name = "tpar", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("TPAR_GIT_COMMIT"), ")"), about = ABOUT, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Time each algorithm over a sweep of message sizes; every timed call is verified.
    Bench(bench::BenchArgs),
    /// Check every algorithm, dtype, size and placement bitwise, plus a peer-timeout case.
    Selftest(selftest::SelftestArgs),
    /// Scripted calls with injected faults, for tests.
    #[command(hide = true)]
    DebugRank(debug_rank::DebugRankArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench::run(args),
        Command::Selftest(args) => selftest::run(args),
        Command::DebugRank(args) => debug_rank::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tpar: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
