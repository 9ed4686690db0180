//! `tpar`'s own launcher: starts N copies of a program on this host as the ranks of one job,
//! each with its rank environment (see [`crate::rendezvous`]), waits for them, and cleans up
//! after them: the private rendezvous directory, and any shared-memory segment of the job that
//! a crashed rank left behind. Ranks die with the launcher (parent-death signal, armed in the
//! child before exec). SIGINT, SIGTERM and SIGHUP stop the ranks and clean up before the
//! launcher exits; what a SIGKILL of the launcher leaves behind (its directory, segments of
//! ranks killed mid-setup) is swept by the next launch of this user, by pid liveness.

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

/// The result of a launch: every rank's exit, in rank order (only the ranks that were started
/// when a stop signal cut the launch short).
#[derive(Clone, Debug)]
pub struct LaunchOutcome {
    pub ranks: Vec<RankExit>,
    /// The signal (SIGINT, SIGTERM, SIGHUP) that stopped the job, if one did.
    pub interrupted: Option<i32>,
}

impl LaunchOutcome {
    pub fn success(&self) -> bool {
        self.interrupted.is_none() && self.ranks.iter().all(|r| r.status.success())
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
    swept: Vec<String>,
    cleaned: bool,
}

/// The file in a launcher's directory that lets a later launch sweep the job if this launcher
/// is killed outright: the job's token names its segments in /dev/shm.
const LAUNCHER_RECORD: &str = "launcher.json";

#[derive(serde::Serialize, serde::Deserialize)]
struct LauncherRecord {
    pid: u32,
    token: String,
}

/// What [`Launcher::cleanup`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleanup {
    pub dir_removed: bool,
    pub segments_removed: usize,
}

impl Launcher {
    /// Prepares a job of `world_size` ranks. The token is random unless `TPAR_JOB_TOKEN` is set.
    /// From here on SIGINT, SIGTERM and SIGHUP are caught (see [`Launcher::run`]), and the
    /// leftovers of this user's dead launches are swept first (see [`Launcher::swept`]).
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
        // Caught before anything exists that a signal could leave behind.
        crate::sys::catch_stop_signals();
        let swept = sweep_dead_jobs(&std::env::temp_dir());
        let dir = std::env::temp_dir().join(format!("tpar-{}-{}", &token[..8], std::process::id()));
        ensure_private_dir(&dir)?;
        let record = LauncherRecord {
            pid: std::process::id(),
            token: token.clone(),
        };
        let launcher = Launcher {
            world_size,
            token,
            dir,
            swept,
            cleaned: false,
        };
        let text = serde_json::to_vec(&record).expect("a record serialises");
        crate::sys::write_file_atomically(
            &launcher.dir.join(LAUNCHER_RECORD),
            &text,
            "cannot write the launcher record",
        )?;
        Ok(launcher)
    }

    /// One line per leftover of a dead launch that [`Launcher::new`] removed.
    pub fn swept(&self) -> &[String] {
        &self.swept
    }

    /// Removes the rendezvous directory and every segment of the job left in /dev/shm (also done
    /// on drop); says what it removed.
    pub fn cleanup(&mut self) -> Cleanup {
        self.cleaned = true;
        let dir_removed = std::fs::remove_dir_all(&self.dir).is_ok();
        Cleanup {
            dir_removed,
            segments_removed: remove_job_segments(&self.token),
        }
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
            if crate::sys::stop_signal().is_some() {
                break;
            }
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

        let started = children.len();
        let mut exits: Vec<Option<RankExit>> = vec![None; started];
        let mut kill_after: Option<Instant> = None;
        let mut interrupted = None;
        while exits.iter().any(Option::is_none) {
            if interrupted.is_none() {
                if let Some(sig) = crate::sys::stop_signal() {
                    // Ask first (a rank killed by SIGTERM still dies at once: it has the
                    // default action), then kill whatever is left after a short grace.
                    interrupted = Some(sig);
                    for (rank, child) in &children {
                        if exits[*rank].is_none() {
                            crate::sys::send_term(child.id());
                        }
                    }
                    kill_after = Some(Instant::now() + STOP_GRACE);
                }
            }
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
        let interrupted = interrupted.or_else(crate::sys::stop_signal);
        Ok(LaunchOutcome {
            ranks: exits.into_iter().flatten().collect(),
            interrupted,
        })
    }
}

/// How long ranks asked to stop by a signal get before SIGKILL.
const STOP_GRACE: Duration = Duration::from_millis(500);

impl Drop for Launcher {
    fn drop(&mut self) {
        if !self.cleaned {
            self.cleanup();
        }
    }
}

/// Removes what dead launches of this user left in `tmp` (their rendezvous directories) and in
/// /dev/shm (their segments, found by the token in the launcher's record). A launch is dead
/// when the pid in its directory's name is gone; anything not ours, or not named like a
/// launcher's directory, is left alone. One line per job removed.
pub fn sweep_dead_jobs(tmp: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return Vec::new();
    };
    let uid = crate::sys::effective_uid();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = launcher_dir_pid(&name) else {
            continue;
        };
        let path = entry.path();
        let ours_and_a_dir = crate::sys::owner_uid(&path) == Some(uid)
            && std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        if !ours_and_a_dir
            || pid == std::process::id()
            || crate::sys::liveness(pid) == crate::sys::Liveness::Alive
        {
            continue;
        }
        let segments = std::fs::read(path.join(LAUNCHER_RECORD))
            .ok()
            .and_then(|bytes| serde_json::from_slice::<LauncherRecord>(&bytes).ok())
            .filter(|r| r.pid == pid && crate::rendezvous::check_token(&r.token).is_ok())
            .map_or(0, |r| remove_job_segments(&r.token));
        if std::fs::remove_dir_all(&path).is_ok() || segments > 0 {
            removed.push(format!(
                "{} and {segments} shared-memory segment(s) of dead launcher pid {pid}",
                path.display()
            ));
        }
    }
    removed
}

/// The pid in a launcher directory's name, `tpar-<8 token characters>-<pid>`.
fn launcher_dir_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("tpar-")?;
    let (tag, pid) = rest.rsplit_once('-')?;
    if tag.len() != 8
        || !tag
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return None;
    }
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    pid.parse().ok()
}

/// Sends SIGKILL to `pid` (a rank of this job; also how fault tests kill a rank mid-run).
pub fn send_sigkill(pid: u32) {
    crate::sys::send_kill(pid);
}

/// Unlinks every shared-memory segment of the job with `token` (left by a rank that died
/// between creating its segment and the moment all peers had mapped it).
pub fn remove_job_segments(token: &str) -> usize {
    let prefix = crate::rendezvous::segment_prefix(token);
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
    fn dead_launches_are_swept_and_live_ones_kept() {
        let tmp = std::env::temp_dir().join(format!("sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        // A pid that is surely gone: a child that exited and was reaped.
        let mut child = Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let dead = child.id();
        let token = random_token().unwrap();
        let dead_dir = tmp.join(format!("tpar-{}-{dead}", &token[..8]));
        ensure_private_dir(&dead_dir).unwrap();
        let record = serde_json::to_vec(&LauncherRecord {
            pid: dead,
            token: token.clone(),
        })
        .unwrap();
        std::fs::write(dead_dir.join(LAUNCHER_RECORD), record).unwrap();
        let name = format!("/{}g0-r0", crate::rendezvous::segment_prefix(&token));
        std::mem::forget(crate::sys::SharedSegment::create(&name, 4096).unwrap());
        let live_dir = tmp.join(format!("tpar-abcdefgh-{}", std::process::id()));
        ensure_private_dir(&live_dir).unwrap();
        let other = tmp.join("tpar-not-a-launcher");
        ensure_private_dir(&other).unwrap();

        let removed = sweep_dead_jobs(&tmp);
        assert_eq!(removed.len(), 1, "{removed:?}");
        assert!(
            removed[0].contains("1 shared-memory segment"),
            "{removed:?}"
        );
        assert!(!dead_dir.exists());
        assert!(!Path::new(&format!("/dev/shm{name}")).exists());
        assert!(live_dir.exists() && other.exists());
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn launcher_directories_are_recognised_by_name() {
        assert_eq!(launcher_dir_pid("tpar-0123abcd-4242"), Some(4242));
        assert_eq!(launcher_dir_pid("tpar-test-sel-77"), Some(77));
        assert_eq!(launcher_dir_pid("tpar-py-engine-0d9ugt8a"), None);
        assert_eq!(launcher_dir_pid("tpar-0123abcd-"), None);
        assert_eq!(launcher_dir_pid("other-0123abcd-12"), None);
    }

    #[test]
    fn leftover_segments_of_the_job_are_removed() {
        let token = random_token().unwrap();
        let name = format!("/{}leftover", crate::rendezvous::segment_prefix(&token));
        let seg = crate::sys::SharedSegment::create(&name, 4096).unwrap();
        std::mem::forget(seg); // as if its rank was killed before unlinking
        assert_eq!(remove_job_segments(&token), 1);
        assert!(!Path::new(&format!("/dev/shm{name}")).exists());
    }
}
