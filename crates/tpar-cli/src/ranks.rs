//! Running a command as the ranks of a job (`tpar_harness::job`: this process as a rank, or
//! `--world-size` copies of this command started and waited for) and saying how it ended.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use tpar_harness::cuda_ranks::MakeGroup;
use tpar_harness::job::{self, JobEnd, RankCommand};
pub use tpar_harness::ranks::Rank;

/// Runs `body` as every rank of a job of `world_size` ranks: in this process if it already is
/// a rank, otherwise by launching `world_size` copies of this command.
pub fn run_ranks(
    world_size: usize,
    timeout: Duration,
    body: impl FnOnce(Rank) -> Result<()>,
) -> Result<ExitCode> {
    let end = job::run_ranks(world_size, timeout, RankCommand::this_process, body)?;
    Ok(exit(end))
}

/// Runs `body` on the CUDA ranks of this job: all of them in this process, or (with
/// `--processes`, or under an outside launcher) this process's own, started by the launcher.
pub fn on_cuda_ranks(
    processes: bool,
    world_size: usize,
    timeout: Duration,
    body: impl Fn(MakeGroup<'_>, &'static str) -> Result<()>,
) -> Result<ExitCode> {
    let end = job::on_cuda_ranks(
        processes,
        world_size,
        timeout,
        RankCommand::this_process,
        body,
    )?;
    Ok(exit(end))
}

/// Says how the job ended (an interrupted job's partial table on stdout) and its exit status.
fn exit(end: JobEnd) -> ExitCode {
    if let JobEnd::Interrupted { partial, .. } = &end {
        match partial {
            Some(text) => {
                println!("{}", text.trim_end());
                let _ = std::io::Write::flush(&mut std::io::stdout());
            }
            None => eprintln!("tpar: no results yet"),
        }
    }
    if let Some(line) = end.summary() {
        eprintln!("{line}");
    }
    ExitCode::from(end.exit_status())
}

/// The world size to use: the environment's when this process is a rank, else the flag's,
/// else `default`.
pub fn world_size_or(flag: Option<usize>, default: usize) -> Result<usize> {
    tpar_harness::backend_choice::world_size_or(flag, default).map_err(crate::args::setup_error)
}
