//! Running a body as the ranks of a job. A process that needs ranks either *is* a rank (its
//! environment names a rendezvous: it was started by a launcher such as `tpar` itself or
//! torchrun) and runs the body once, or it starts `world_size` copies of a program as ranks,
//! waits for them and returns how each one ended ([`JobEnd`]); the caller says it.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use super::cuda_ranks::CudaRanks;
use super::cuda_ranks::MakeGroup;
use super::ranks::{say, Rank, PARTIAL_FILE};
use super::{HarnessError, Result};
use tpar::config::Config;
use tpar::launch::Launcher;
use tpar::{RankEnv, Rendezvous};

/// The program a launching process starts once per rank, with its arguments.
pub struct RankCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

impl RankCommand {
    /// This program again with the same arguments: each copy finds itself a rank.
    pub fn this_process() -> Result<RankCommand> {
        let program = std::env::current_exe().map_err(|e| {
            HarnessError::Failed(format!(
                "cannot find the tpar executable to start ranks: {e}"
            ))
        })?;
        Ok(RankCommand {
            program,
            args: std::env::args_os().skip(1).collect(),
        })
    }
}

/// How a job ended, seen from the process that ran it (a rank, or the launcher).
#[derive(Debug, PartialEq)]
pub enum JobEnd {
    /// Every rank's body succeeded.
    Success,
    /// This process was a rank and its body failed; the error was said on stderr.
    RankFailed,
    /// The launcher stopped the ranks on a signal.
    Interrupted {
        signal: i32,
        /// Rank 0's table so far ([`Rank::save_partial`]), if it saved one.
        partial: Option<String>,
        ranks_stopped: usize,
        world_size: usize,
        dir_removed: bool,
        segments_removed: usize,
    },
    /// Some ranks failed: one line per failed rank, saying how it ended.
    Failed {
        failures: Vec<String>,
        world_size: usize,
    },
}

impl JobEnd {
    /// The exit status the job's command should end with: 0, 1, or 128 + the signal.
    pub fn exit_status(&self) -> u8 {
        match self {
            JobEnd::Success => 0,
            JobEnd::RankFailed | JobEnd::Failed { .. } => 1,
            JobEnd::Interrupted { signal, .. } => (128 + signal).clamp(0, 255) as u8,
        }
    }

    /// The line that says how a failed or interrupted job ended (none for the others).
    pub fn summary(&self) -> Option<String> {
        match self {
            JobEnd::Success | JobEnd::RankFailed => None,
            JobEnd::Interrupted {
                signal,
                ranks_stopped,
                world_size,
                dir_removed,
                segments_removed,
                ..
            } => Some(format!(
                "tpar: interrupted by {}: stopped {ranks_stopped} of {world_size} rank(s), removed the rendezvous directory{} and {segments_removed} shared-memory segment(s)",
                signal_name(*signal),
                if *dir_removed { "" } else { " (already gone)" },
            )),
            JobEnd::Failed {
                failures,
                world_size,
            } => Some(format!(
                "tpar: {} of {world_size} rank(s) failed: {}",
                failures.len(),
                failures.join("; ")
            )),
        }
    }
}

/// Runs `body` as every rank of a job of `world_size` ranks: in this process if it already is
/// a rank (a failure is said on stderr as `tpar[rank R]: error: ...`), otherwise by starting
/// `command` once per rank. `timeout` is the ranks' peer deadline: survivors notice a failed
/// peer within it, so the launcher gives them that and a margin before stopping them.
pub fn run_ranks<E: std::fmt::Display>(
    world_size: usize,
    timeout: Duration,
    command: impl FnOnce() -> Result<RankCommand>,
    body: impl FnOnce(Rank) -> std::result::Result<(), E>,
) -> Result<JobEnd> {
    let Some(env) = RankEnv::from_env()? else {
        return launch(world_size, timeout, command);
    };
    if env.world_size != world_size {
        super::bail!(
            "this rank's WORLD_SIZE is {} but --world-size is {world_size}; pass the same number (or leave --world-size out under an outside launcher)",
            env.world_size
        );
    }
    let rank = env.rank;
    let rendezvous = Rendezvous::join(env)?;
    match body(Rank { rendezvous }) {
        Ok(()) => Ok(JobEnd::Success),
        Err(e) => {
            say(rank, &format!("error: {e:#}"));
            Ok(JobEnd::RankFailed)
        }
    }
}

/// Runs `body` on the CUDA ranks of this job: every rank in this process, one stream each
/// (mode "threads"), or, with `processes` or under an outside launcher, this process's own rank
/// of a job of processes started as [`run_ranks`] does (mode "processes"). `body` gets a factory
/// for groups (it may build several) and the mode's name.
pub fn on_cuda_ranks<E: std::fmt::Display + From<HarnessError>>(
    processes: bool,
    world_size: usize,
    timeout: Duration,
    command: impl FnOnce() -> Result<RankCommand>,
    body: impl Fn(MakeGroup<'_>, &'static str) -> std::result::Result<(), E>,
) -> std::result::Result<JobEnd, E> {
    if processes || RankEnv::from_env().map_err(HarnessError::from)?.is_some() {
        Ok(run_ranks(world_size, timeout, command, |rank| {
            body(&|c| CudaRanks::process(&rank, c), "processes")
        })?)
    } else {
        body(&|c| CudaRanks::threads(world_size, c), "threads")?;
        Ok(JobEnd::Success)
    }
}

/// The CUDA settings of a harness run: the defaults, with the peer deadline of the command.
pub fn cuda_config(timeout: Duration) -> Config {
    Config {
        timeout,
        ..Default::default()
    }
}

fn launch(
    world_size: usize,
    timeout: Duration,
    command: impl FnOnce() -> Result<RankCommand>,
) -> Result<JobEnd> {
    let mut launcher = Launcher::new(world_size)?;
    for line in launcher.swept() {
        // Not eprintln!: a closed stderr must not panic the launcher.
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            format!("tpar: removed leftovers of a dead job: {line}\n").as_bytes(),
        );
    }
    let command = command()?;
    let outcome = launcher.run(
        &command.program,
        &command.args,
        timeout + Duration::from_secs(5),
    )?;
    if let Some(signal) = outcome.interrupted {
        let partial = std::fs::read_to_string(launcher.rendezvous_dir().join(PARTIAL_FILE))
            .ok()
            .filter(|text| !text.trim().is_empty());
        let cleanup = launcher.cleanup();
        return Ok(JobEnd::Interrupted {
            signal,
            partial,
            ranks_stopped: outcome.ranks.len(),
            world_size,
            dir_removed: cleanup.dir_removed,
            segments_removed: cleanup.segments_removed,
        });
    }
    if outcome.success() {
        return Ok(JobEnd::Success);
    }
    Ok(JobEnd::Failed {
        failures: outcome.failures(),
        world_size,
    })
}

fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        other => format!("signal {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interrupted_job_says_what_was_cleaned_and_exits_128_plus_the_signal() {
        let end = JobEnd::Interrupted {
            signal: libc::SIGINT,
            partial: None,
            ranks_stopped: 2,
            world_size: 4,
            dir_removed: false,
            segments_removed: 3,
        };
        assert_eq!(end.exit_status(), 130);
        assert_eq!(
            end.summary().unwrap(),
            "tpar: interrupted by SIGINT: stopped 2 of 4 rank(s), removed the rendezvous directory (already gone) and 3 shared-memory segment(s)"
        );
    }

    #[test]
    fn a_failed_job_lists_its_failed_ranks() {
        let end = JobEnd::Failed {
            failures: vec!["rank 1 exited with status 1".into()],
            world_size: 2,
        };
        assert_eq!(end.exit_status(), 1);
        assert_eq!(
            end.summary().unwrap(),
            "tpar: 1 of 2 rank(s) failed: rank 1 exited with status 1"
        );
        assert_eq!(JobEnd::Success.exit_status(), 0);
        assert_eq!(JobEnd::Success.summary(), None);
        assert_eq!(JobEnd::RankFailed.exit_status(), 1);
        assert_eq!(signal_name(9), "signal 9");
    }
}
