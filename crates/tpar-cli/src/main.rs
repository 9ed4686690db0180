//! The `tpar` command: benchmark and check tpar's allreduce on this machine.
//!
//! Commands that need ranks start them (`--world-size N` processes of this same binary on this
//! host), or run as one rank when an outside launcher set the rank environment (see
//! `tpar help bench` and the README).
//!
//! This crate is argument parsing and per-command glue: what a command measures or checks is
//! `tpar_harness` (and `tpar::verify`), which Python calls too, and its tables, JSON and plots
//! are printed by `tpar_report`.

mod args;
mod bench;
mod cuda_commands;
mod debug_rank;
mod doctor;
mod ending;
mod plan;
mod progress;
mod provenance;
mod ranks;
mod selftest;
mod step;
mod sys;
mod tune;

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

const ABOUT: &str = "Low-latency allreduce for tensor-parallel inference on one host.";

const AFTER_HELP: &str = "\
Ranks: `tpar bench` and `tpar selftest` start --world-size copies of themselves on this host and
gather them through a private rendezvous directory. To run under your own launcher instead, set
for every process TPAR_RENDEZVOUS (a directory, created 0700), TPAR_JOB_TOKEN (the same secret
for all ranks, e.g. `openssl rand -hex 16`), RANK and WORLD_SIZE (torchrun sets the last two).

Examples:
  tpar bench                                  # default sweep, default backend
  tpar bench --backend cpu -n 4 --sizes 4K,256K --json -
  tpar selftest --backend cpu -n 8
  tpar selftest --backend cuda -n 8            # 8 ranks on the GPU(s) of this host
  tpar bench --backend cuda -n 2 --json out.json
  tpar doctor                                  # this machine: links, checks, what runs at each size
  tpar doctor --topology crates/tpar/fixtures/topologies/8x-rtx-pro-6000-pcie-2switch.json
  tpar plan memory --config crates/tpar-harness/fixtures/models/deepseek-v3.json -n 8 --gpu-gb 96
  tpar plan spec-decode --config crates/tpar-harness/fixtures/models/deepseek-v3.json -n 8 --tokens 3 --acceptance 2 --latency-us 200";

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
    /// What tpar sees on this machine (or a described one) and what it will run, and why.
    Doctor(doctor::DoctorArgs),
    /// Measure every algorithm and NCCL here and write the fastest per size for the dispatcher.
    Tune(tune::TuneArgs),
    /// Plan before launching: KV-cache memory, and whether speculative decoding pays.
    #[command(subcommand)]
    Plan(plan::PlanCommand),
    /// Scripted calls with injected faults, for tests.
    #[command(hide = true)]
    DebugRank(debug_rank::DebugRankArgs),
}

fn main() -> ExitCode {
    // Before any CUDA call: the same set-up as Python's (NVRTC found where it is installed,
    // CUDA_DEVICE_MAX_CONNECTIONS for many ranks on one GPU).
    tpar::environment::prepare([]);
    // RUST_LOG=tpar=debug shows every dispatch decision with its reason.
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(e),
    };
    let result = match cli.command {
        Command::Bench(args) => bench::run(args),
        Command::Selftest(args) => selftest::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Tune(args) => tune::run(args),
        Command::Plan(command) => plan::run(command),
        Command::DebugRank(args) => debug_rank::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => ending::failed(&e),
    }
}

/// Help and version go to stdout with status 0; a usage error is one line on stderr, status 2
/// (clap's own rendering adds a usage block and a tip over several lines).
fn clap_exit(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::from(ending::USAGE_EXIT)
        }
        _ => {
            let words: Vec<String> = std::env::args().skip(1).collect();
            tpar_report::print_err(&format!(
                "tpar: error: {} (see `{} --help`)",
                usage_error_line(&e.render().to_string()),
                command_path(&words)
            ));
            ExitCode::from(ending::USAGE_EXIT)
        }
    }
}

/// Clap's error as one line: its message with what it lists under it (the arguments missing,
/// the possible values, a "did you mean"), without the usage block and the pointer to --help
/// (the caller names the subcommand's help instead).
fn usage_error_line(rendered: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    for line in rendered.lines().map(str::trim) {
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        if line.is_empty() {
            continue;
        }
        let line = line.strip_prefix("error: ").unwrap_or(line);
        parts.push(match line.strip_prefix("tip: ") {
            Some(tip) => format!("({tip})"),
            None => line.to_owned(),
        });
    }
    if parts.is_empty() {
        "invalid arguments".to_owned()
    } else {
        parts.join(" ")
    }
}

/// `tpar bench step` for `["bench", "step", "--tokens", ...]`: the subcommands named before the
/// first word that is not one, for pointing at the help that lists their flags.
fn command_path(words: &[String]) -> String {
    let mut command = Cli::command();
    let mut path = vec!["tpar".to_owned()];
    for word in words {
        let Some(sub) = command.find_subcommand(word).cloned() else {
            break;
        };
        path.push(word.clone());
        command = sub;
    }
    path.join(" ")
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// Every flag of every visible subcommand, as "command --flag", that has no help text.
    fn flags_without_help(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let id = arg.get_id().as_str();
            if arg.is_hide_set() || id == "help" || id == "version" {
                continue;
            }
            if arg
                .get_help()
                .is_none_or(|h| h.to_string().trim().is_empty())
            {
                out.push(format!("{path} --{}", arg.get_long().unwrap_or(id)));
            }
        }
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            flags_without_help(sub, &format!("{path} {}", sub.get_name()), out);
        }
    }

    #[test]
    fn every_flag_has_help() {
        let mut missing = Vec::new();
        flags_without_help(&super::Cli::command(), "tpar", &mut missing);
        assert_eq!(missing, Vec::<String>::new());
    }

    #[test]
    fn the_world_size_is_n_everywhere() {
        let cli = super::Cli::command();
        let mut found = Vec::new();
        fn walk(cmd: &clap::Command, path: &str, found: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                if arg.get_long() == Some("world-size") {
                    assert_eq!(arg.get_short(), Some('n'), "{path}");
                    found.push(path.to_owned());
                }
                assert_ne!(
                    arg.get_long(),
                    Some("tp"),
                    "{path}: --tp is an alias of -n now"
                );
            }
            for sub in cmd.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), found);
            }
        }
        walk(&cli, "tpar", &mut found);
        for command in [
            "bench",
            "bench step",
            "selftest",
            "doctor",
            "tune",
            "plan memory",
            "plan spec-decode",
        ] {
            assert!(
                found.contains(&format!("tpar {command}")),
                "{command}: {found:?}"
            );
        }
    }
}
