//! Running a command as the ranks of a job. A `tpar` command that needs ranks either *is* a
//! rank (its environment names a rendezvous: it was started by `tpar` itself or by an outside
//! launcher such as torchrun) or it starts `--world-size` copies of itself as ranks, waits for
//! them and reports how each one ended.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tpar::harness::ranks::PARTIAL_FILE;
pub use tpar::harness::ranks::{say, Rank};
use tpar::launch::Launcher;
use tpar::{RankEnv, Rendezvous};

/// Runs `body` as every rank of a job of `world_size` ranks: in this process if it already is
/// a rank, otherwise by launching `world_size` copies of this command.
pub fn run_ranks(
    world_size: usize,
    timeout: Duration,
    body: impl FnOnce(Rank) -> Result<()>,
) -> Result<ExitCode> {
    match RankEnv::from_env()? {
        Some(env) => {
            if env.world_size != world_size {
                bail!(
                    "this rank's WORLD_SIZE is {} but --world-size is {world_size}; pass the same number (or leave --world-size out under an outside launcher)",
                    env.world_size
                );
            }
            let rank = env.rank;
            let rendezvous = Rendezvous::join(env)?;
            match body(Rank { rendezvous }) {
                Ok(()) => Ok(ExitCode::SUCCESS),
                Err(e) => {
                    say(rank, &format!("error: {e:#}"));
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        None => launch(world_size, timeout),
    }
}

fn launch(world_size: usize, timeout: Duration) -> Result<ExitCode> {
    let mut launcher = Launcher::new(world_size)?;
    for line in launcher.swept() {
        eprintln!("tpar: removed leftovers of a dead job: {line}");
    }
    let program =
        std::env::current_exe().context("cannot find the tpar executable to start ranks")?;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    // Survivors notice a failed peer within their deadline; give them that and a margin.
    let outcome = launcher.run(&program, &args, timeout + Duration::from_secs(5))?;
    if let Some(sig) = outcome.interrupted {
        let partial = std::fs::read_to_string(launcher.rendezvous_dir().join(PARTIAL_FILE));
        let cleanup = launcher.cleanup();
        match partial {
            Ok(text) if !text.trim().is_empty() => {
                println!("{}", text.trim_end());
                let _ = std::io::Write::flush(&mut std::io::stdout());
            }
            _ => eprintln!("tpar: no results yet"),
        }
        eprintln!(
            "tpar: interrupted by {}: stopped {} of {world_size} rank(s), removed the rendezvous directory{} and {} shared-memory segment(s)",
            signal_name(sig),
            outcome.ranks.len(),
            if cleanup.dir_removed { "" } else { " (already gone)" },
            cleanup.segments_removed
        );
        return Ok(ExitCode::from((128 + sig).clamp(0, 255) as u8));
    }
    if outcome.success() {
        return Ok(ExitCode::SUCCESS);
    }
    let failures = outcome.failures();
    eprintln!(
        "tpar: {} of {world_size} rank(s) failed: {}",
        failures.len(),
        failures.join("; ")
    );
    Ok(ExitCode::FAILURE)
}

fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        other => format!("signal {other}"),
    }
}

/// The world size to use: the environment's when this process is a rank, else the flag's,
/// else `default`.
pub fn world_size_or(flag: Option<usize>, default: usize) -> Result<usize> {
    tpar::harness::backend_choice::world_size_or(flag, default).map_err(crate::args::setup_error)
}
