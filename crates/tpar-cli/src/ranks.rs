//! Running a command as the ranks of a job (`tpar_harness::job`: this process as a rank, or
//! `--world-size` copies of this command started and waited for) and saying how it ended.
//!
//! Rank 0 prints the job's results on the standard output it shares with the launcher, and the
//! launcher prints an interrupted job's rows so far where the finished table would go. When
//! that output fails, the job ends as one program would: a closed pipe (`tpar bench | head -1`)
//! ends rank 0 and then the launcher by SIGPIPE, quietly; any other failure (`> /dev/full`) is
//! one line from rank 0, the launcher adding none of its own.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use tpar_harness::cuda_ranks::MakeGroup;
use tpar_harness::job::{self, JobEnd, RankCommand};
pub use tpar_harness::ranks::Rank;
use tpar_report::print_err;

use crate::sys::{die_of_sigpipe, SIGPIPE_STATUS};

/// The exit status of a rank whose standard output refused the results (it said why on one
/// line); its launcher then says nothing more.
const OUTPUT_FAILED_STATUS: i32 = 74;

/// Where an interrupted job prints the rows its rank 0 saved so far ([`Rank::save_partial`]):
/// where the finished table would have gone, so that a reader of a JSON or plot on standard
/// output (`--json -`, `--plot -`) never gets a text table in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartialRows {
    Stdout,
    Stderr,
}

impl PartialRows {
    /// The finished table's stream for these outputs (`tpar_report::table_on_stdout`).
    pub fn beside(json: Option<&str>, plot: Option<&str>) -> Self {
        if tpar_report::table_on_stdout(json, plot == Some("-")) {
            Self::Stdout
        } else {
            Self::Stderr
        }
    }
}

/// Runs `body` as every rank of a job of `world_size` ranks: in this process if it already is
/// a rank, otherwise by launching `world_size` copies of this command.
pub fn run_ranks(
    world_size: usize,
    timeout: Duration,
    partial_rows: PartialRows,
    body: impl FnOnce(Rank) -> Result<()>,
) -> Result<ExitCode> {
    let end = job::run_ranks(world_size, timeout, RankCommand::this_process, |rank| {
        on_output_failure(body(rank))
    })?;
    Ok(exit(end, partial_rows))
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
        |make, mode| on_output_failure(body(make, mode)),
    )?;
    // The CUDA ranks save no rows so far: an interrupted job says it has none.
    Ok(exit(end, PartialRows::Stdout))
}

/// A rank's body that ended on its standard output failing ends the rank here (its work and
/// its communicators are done: printing comes last): by SIGPIPE for a closed pipe, else with
/// one line and [`OUTPUT_FAILED_STATUS`]. Any other error is the body's, as one message with
/// each cause said once (the job prints it after `tpar[rank R]: error:`).
fn on_output_failure(result: Result<()>) -> Result<()> {
    let Err(e) = result else {
        return Ok(());
    };
    if crate::ending::closed_stdout(&e) {
        die_of_sigpipe();
    }
    if crate::ending::stdout_failed(&e)
        && std::env::var_os(tpar::rendezvous::ENV_RENDEZVOUS).is_some()
    {
        print_err(&crate::ending::error_line(&e));
        std::process::exit(OUTPUT_FAILED_STATUS);
    }
    if crate::args::is_usage(&e) {
        return Err(e);
    }
    Err(anyhow::anyhow!(tpar_harness::error_chain(e.as_ref())))
}

/// How a rank's exit reads in the launcher's list of failures (`RankExit::describe`).
fn ended_with(failure: &str, status: i32) -> bool {
    failure.ends_with(&format!("exited with status {status}"))
        || (status == SIGPIPE_STATUS
            && failure.ends_with(&format!("was killed by signal {}", libc::SIGPIPE)))
}

/// Says how the job ended (an interrupted job's rows so far where `partial_rows` says) and
/// its exit status.
fn exit(end: JobEnd, partial_rows: PartialRows) -> ExitCode {
    if let JobEnd::Failed { failures, .. } = &end {
        let all = |status| failures.iter().all(|f| ended_with(f, status));
        if all(SIGPIPE_STATUS) {
            die_of_sigpipe();
        }
        if all(OUTPUT_FAILED_STATUS) {
            return ExitCode::FAILURE;
        }
    }
    if let JobEnd::Interrupted { partial, .. } = &end {
        match partial {
            Some(text) if partial_rows == PartialRows::Stderr => print_err(text.trim_end()),
            Some(text) => {
                if let Err(e) = tpar_report::print_out(text.trim_end()) {
                    if e.is_closed_stdout() {
                        die_of_sigpipe();
                    }
                    print_err(&format!("tpar: cannot print the rows so far: {e}"));
                }
            }
            None => print_err("tpar: no results yet"),
        }
    }
    if let Some(line) = end.summary() {
        print_err(&line);
    }
    ExitCode::from(end.exit_status())
}

/// The world size to use: the environment's when this process is a rank, else the flag's,
/// else `default`.
pub fn world_size_or(flag: Option<usize>, default: usize) -> Result<usize> {
    tpar_harness::backend_choice::world_size_or(flag, default).map_err(crate::args::setup_error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_failures_are_told_apart_from_other_exits() {
        assert!(ended_with("rank 0 (pid 7) exited with status 74", 74));
        assert!(!ended_with("rank 0 (pid 7) exited with status 1", 74));
        assert!(ended_with("rank 0 (pid 7) was killed by signal 13", 141));
        assert!(ended_with("rank 0 (pid 7) exited with status 141", 141));
        assert!(!ended_with(
            "rank 0 (pid 7) was killed by signal 9 (SIGKILL)",
            141
        ));
    }
}
