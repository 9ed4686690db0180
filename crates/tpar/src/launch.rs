//! `tpar`'s own launcher: starts N copies of a program on this host as the ranks of one job,
//! each with its rank environment (see [`crate::rendezvous`]), waits for them, and cleans up
//! after them: the private rendezvous directory, and any shared-memory segment of the job that
//! a crashed rank left behind. Ranks die with the launcher (parent-death signal).

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::rendezvous::{ensure_private_dir, random_token, RankEnv, ENV_JOB_TOKEN};

/// How one rank ended.
#[derive(Clone, Debug)]
pub struct RankExit {
    pub rank: usize,
    pub pid: u32,
    pub status: ExitStatus,
    /// The launcher killed it because it outlived a failed peer by more than the grace period.
    pub killed_by_launcher: bool,
}

impl RankExit {
    pub fn describe(&self) -> String {
        let what = if let Some(code) = self.status.code() {
            format!("exited with status {code}")
        } else if let Some(sig) = self.status.signal() {
            format!("was killed by signal {sig}{}", signal_name(sig))
        } else {
            "ended".to_owned()
        };
        let why = if self.killed_by_launcher {
            " (by the launcher: it kept running after a peer failed)"
        } else {
            ""
        };
        format!("rank {} (pid {}) {what}{why}", self.rank, self.pid)
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => " (SIGKILL)",
        libc::SIGSEGV => " (SIGSEGV)",
        libc::SIGABRT => " (SIGABRT)",
        libc::SIGTERM => " (SIGTERM)",
        libc::SIGINT => " (SIGINT)",
        libc::SIGBUS => " (SIGBUS)",
        _ => "",
    }
}

/// The result of a launch: every rank's exit, in rank order.
#[derive(Clone, Debug)]
pub struct LaunchOutcome {
    pub ranks: Vec<RankExit>,
}

impl LaunchOutcome {
    pub fn success(&self) -> bool {
        self.ranks.iter().all(|r| r.status.success())
    }

    /// One line per failed rank.
    pub fn failures(&self) -> Vec<String> {
        self.ranks
            .iter()
            .filter(|r| !r.status.success())
            .map(RankExit::describe)
            .collect()
    }
}

/// One job's launch: its token and private rendezvous directory, removed on drop together with
/// any shared-memory segment of the job still in /dev/shm.
pub struct Launcher {
    world_size: usize,
    token: String,
    dir: PathBuf,
}

impl Launcher {
    /// Prepares a job of `world_size` ranks. The token is random unless `TPAR_JOB_TOKEN` is set.
    pub fn new(world_size: usize) -> Result<Launcher> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "world size must be at least 1".into(),
            ));
        }
        let token = match std::env::var(ENV_JOB_TOKEN) {
            Ok(t) => {
                crate::rendezvous::check_token(&t)?;
                t
            }
            Err(_) => random_token()?,
        };
        let dir = std::env::temp_dir().join(format!("tpar-{}-{}", &token[..8], std::process::id()));
        ensure_private_dir(&dir)?;
        Ok(Launcher {
            world_size,
            token,
            dir,
        })
    }

    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn rendezvous_dir(&self) -> &Path {
        &self.dir
    }

    fn rank_env(&self, rank: usize) -> RankEnv {
        RankEnv {
            rank,
            world_size: self.world_size,
            local_rank: rank,
            local_world_size: self.world_size,
            dir: self.dir.clone(),
            token: self.token.clone(),
        }
    }

    /// Runs `program args` as every rank and waits for all of them. When a rank fails, the
    /// others get `grace` to notice and exit (they do, within their own deadline); any still
    /// running after that is killed.
    pub fn run(&self, program: &Path, args: &[OsString], grace: Duration) -> Result<LaunchOutcome> {
        let mut children: Vec<(usize, Child)> = Vec::with_capacity(self.world_size);
        for rank in 0..self.world_size {
            let mut cmd = Command::new(program);
            cmd.args(args).stdin(Stdio::null());
            for (key, value) in self.rank_env(rank).to_vars() {
                cmd.env(key, value);
            }
            crate::sys::kill_child_with_parent(&mut cmd);
            match cmd.spawn() {
                Ok(child) => children.push((rank, child)),
                Err(e) => {
                    for (_, child) in &mut children {
                        let _ = child.kill();
                        let _ = child.wait();
                    }
                    return Err(Error::Launch(format!(
                        "cannot start rank {rank} ({}): {e}",
                        program.display()
                    )));
                }
            }
        }

        let mut exits: Vec<Option<RankExit>> = vec![None; self.world_size];
        let mut kill_after: Option<Instant> = None;
        while exits.iter().any(Option::is_none) {
            for (rank, child) in &mut children {
                if exits[*rank].is_some() {
                    continue;
                }
                let status = child
                    .try_wait()
                    .map_err(|e| Error::Launch(format!("cannot wait for rank {rank}: {e}")))?;
                if let Some(status) = status {
                    if !status.success() && kill_after.is_none() {
                        kill_after = Some(Instant::now() + grace);
                    }
                    exits[*rank] = Some(RankExit {
                        rank: *rank,
                        pid: child.id(),
                        status,
                        killed_by_launcher: false,
                    });
                }
            }
            if kill_after.is_some_and(|t| Instant::now() >= t) {
                for (rank, child) in &mut children {
                    if exits[*rank].is_none() {
                        crate::sys::send_kill(child.id());
                        let status = child.wait().map_err(|e| {
                            Error::Launch(format!("cannot wait for rank {rank}: {e}"))
                        })?;
                        exits[*rank] = Some(RankExit {
                            rank: *rank,
                            pid: child.id(),
                            status,
                            killed_by_launcher: true,
                        });
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(LaunchOutcome {
            ranks: exits
                .into_iter()
                .map(|e| e.expect("every rank exited"))
                .collect(),
        })
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        remove_job_segments(&self.token);
    }
}

/// Sends SIGKILL to `pid` (a rank of this job; also how fault tests kill a rank mid-run).
pub fn send_sigkill(pid: u32) {
    crate::sys::send_kill(pid);
}

/// Unlinks every shared-memory segment of the job with `token` (left by a rank that died
/// between creating its segment and the moment all peers had mapped it).
pub fn remove_job_segments(token: &str) -> usize {
    let prefix = crate::backend::cpu::segment_prefix(token);
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_rank_with_its_environment() {
        let launcher = Launcher::new(3).unwrap();
        let out = launcher
            .run(
                Path::new("sh"),
                &["-c".into(), "test \"$RANK\" -lt \"$WORLD_SIZE\" && test -d \"$TPAR_RENDEZVOUS\" && test -n \"$TPAR_JOB_TOKEN\" && exit $RANK".into()],
                Duration::from_secs(5),
            )
            .unwrap();
        let codes: Vec<_> = out.ranks.iter().map(|r| r.status.code()).collect();
        assert_eq!(codes, vec![Some(0), Some(1), Some(2)]);
        assert!(!out.success());
        assert_eq!(out.failures().len(), 2);
        let dir = launcher.rendezvous_dir().to_owned();
        drop(launcher);
        assert!(!dir.exists());
    }

    #[test]
    fn a_rank_outliving_a_failed_peer_is_killed_after_grace() {
        let launcher = Launcher::new(2).unwrap();
        let start = Instant::now();
        let out = launcher
            .run(
                Path::new("sh"),
                &[
                    "-c".into(),
                    "if [ $RANK = 0 ]; then exit 3; else sleep 30; fi".into(),
                ],
                Duration::from_millis(300),
            )
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(10));
        assert_eq!(out.ranks[0].status.code(), Some(3));
        assert!(out.ranks[1].killed_by_launcher);
        assert!(
            out.ranks[1].describe().contains("SIGKILL"),
            "{}",
            out.ranks[1].describe()
        );
    }

    #[test]
    fn leftover_segments_of_the_job_are_removed() {
        let token = random_token().unwrap();
        let name = format!("/{}leftover", crate::backend::cpu::segment_prefix(&token));
        let seg = crate::sys::SharedSegment::create(&name, 4096).unwrap();
        std::mem::forget(seg); // as if its rank was killed before unlinking
        assert_eq!(remove_job_segments(&token), 1);
        assert!(!Path::new(&format!("/dev/shm{name}")).exists());
    }
}
