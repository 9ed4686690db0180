//! Waiting for a peer's line with a deadline. Spins briefly (the fast case: the peer is running
//! on another core), then yields (ranks may outnumber cores, and the peer needs ours), then
//! sleeps in short steps. While waiting it checks that the awaited peer still exists, so a
//! killed rank is reported at once instead of at the deadline.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::protocol::line::{word_if_tagged, Tag};
use crate::sys::{liveness, Liveness};

const SPINS: u32 = 256;
const YIELDS: u32 = 4096;
const SLEEP: Duration = Duration::from_micros(50);
const LIVENESS_EVERY: Duration = Duration::from_millis(50);

/// What a rank is waiting for, for error messages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Phase {
    pub step: &'static str,
    pub seq: u32,
    pub chunk: u32,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of allreduce call #{}, chunk {}",
            self.step, self.seq, self.chunk
        )
    }
}

/// Asked while a wait is slow: true stops the wait with [`Error::Interrupted`] (Ctrl-C
/// reaching a Python caller, for one).
pub type InterruptCheck = dyn Fn() -> bool + Send + Sync;

/// The deadline and the peers' process ids (where this rank can see them).
pub(crate) struct Watch<'a> {
    pub timeout: Duration,
    pub peer_pids: &'a [Option<u32>],
    pub interrupted: Option<&'a InterruptCheck>,
}

impl Watch<'_> {
    /// The payload word of `line` once it carries `tag`.
    #[inline]
    pub fn word(&self, line: &AtomicU64, tag: Tag, peer: usize, phase: Phase) -> Result<u32> {
        match word_if_tagged(line.load(Ordering::Acquire), tag) {
            Some(word) => Ok(word),
            None => self.slow(line, tag, peer, phase),
        }
    }

    #[cold]
    fn slow(&self, line: &AtomicU64, tag: Tag, peer: usize, phase: Phase) -> Result<u32> {
        let start = Instant::now();
        let mut last_check = start;
        let mut tries: u32 = 0;
        loop {
            if let Some(word) = word_if_tagged(line.load(Ordering::Acquire), tag) {
                return Ok(word);
            }
            tries = tries.saturating_add(1);
            if tries < SPINS {
                std::hint::spin_loop();
                continue;
            } else if tries < YIELDS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(SLEEP);
            }
            if tries % 16 == 0 || tries >= YIELDS {
                let now = now_after(start);
                let waited = now - start;
                if waited >= self.timeout {
                    return Err(Error::PeerTimeout {
                        peer,
                        phase: phase.to_string(),
                        waited,
                    });
                }
                if now - last_check >= LIVENESS_EVERY {
                    last_check = now;
                    if let Some(err) = self.gone_peers(peer, phase) {
                        return Err(err);
                    }
                    if self.interrupted.is_some_and(|stop| stop()) {
                        return Err(Error::Interrupted {
                            peer,
                            phase: phase.to_string(),
                        });
                    }
                }
            }
        }
    }
}

impl Watch<'_> {
    /// When the awaited `peer`'s process is gone: one error naming it first and every other
    /// peer found gone at the same check. `None` while the awaited peer lives, even if others
    /// have exited: a peer that finished the job's last call exits while a slower rank may still
    /// wait, legitimately, for a live third rank's data of that call. (When a rank is killed,
    /// the ranks waiting on it fail first and exit, so a rank waiting on one of those still
    /// stops promptly, naming all of them.)
    fn gone_peers(&self, peer: usize, phase: Phase) -> Option<Error> {
        let awaited_pid = (*self.peer_pids.get(peer)?)?;
        if liveness(awaited_pid) != Liveness::Gone {
            return None;
        }
        let rest: Vec<(usize, u32)> = self
            .peer_pids
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != peer)
            .filter_map(|(r, pid)| pid.map(|p| (r, p)))
            .filter(|&(_, pid)| liveness(pid) == Liveness::Gone)
            .collect();
        let (first, pid) = (peer, awaited_pid);
        let also = rest
            .iter()
            .map(|(r, p)| format!("; rank {r} (pid {p}) has exited too"))
            .collect();
        Some(Error::PeerGone {
            peer: first,
            pid,
            phase: phase.to_string(),
            also,
        })
    }
}

fn now_after(start: Instant) -> Instant {
    Instant::now().max(start)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::line::pack;
    use std::sync::Arc;

    const PHASE: Phase = Phase {
        step: "test",
        seq: 1,
        chunk: 0,
    };

    #[test]
    fn returns_a_word_written_later_by_another_thread() {
        let line = Arc::new(AtomicU64::new(0));
        let tag = Tag::for_epoch(7);
        let writer = {
            let line = line.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                line.store(pack(tag, 99), Ordering::Release);
            })
        };
        let watch = Watch {
            timeout: Duration::from_secs(5),
            peer_pids: &[],
            interrupted: None,
        };
        assert_eq!(watch.word(&line, tag, 1, PHASE).unwrap(), 99);
        writer.join().unwrap();
    }

    #[test]
    fn an_interrupt_stops_the_wait_naming_the_peer() {
        let line = AtomicU64::new(0);
        let stop = || true;
        let watch = Watch {
            timeout: Duration::from_secs(30),
            peer_pids: &[],
            interrupted: Some(&stop),
        };
        let start = Instant::now();
        let err = watch.word(&line, Tag::for_epoch(1), 1, PHASE).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(1));
        assert!(matches!(err, Error::Interrupted { peer: 1, .. }), "{err}");
    }

    #[test]
    fn times_out_naming_the_peer_and_phase() {
        let line = AtomicU64::new(pack(Tag::for_epoch(6), 1)); // stale epoch
        let watch = Watch {
            timeout: Duration::from_millis(100),
            peer_pids: &[None, None, None],
            interrupted: None,
        };
        let start = Instant::now();
        let err = watch.word(&line, Tag::for_epoch(7), 2, PHASE).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(2));
        let msg = err.to_string();
        assert!(
            msg.contains("rank 2") && msg.contains("test of allreduce call #1"),
            "{msg}"
        );
    }

    #[test]
    fn reports_a_dead_peer_before_the_deadline() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let line = AtomicU64::new(0);
        let pids = [None, Some(pid)];
        let watch = Watch {
            timeout: Duration::from_secs(30),
            peer_pids: &pids,
            interrupted: None,
        };
        let start = Instant::now();
        let err = watch.word(&line, Tag::for_epoch(1), 1, PHASE).unwrap_err();
        assert!(matches!(err, Error::PeerGone { peer: 1, .. }), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn keeps_waiting_on_a_live_peer_while_others_have_exited() {
        // A rank that finished the last call may exit while this rank still waits, rightly,
        // for a live peer's data: that is not a failure (before, it failed at once naming the
        // exited rank), so only the deadline ends this wait.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let pids = [
            Some(std::process::id()),
            Some(child.id()),
            Some(std::process::id()),
        ];
        let watch = Watch {
            timeout: Duration::from_millis(600),
            peer_pids: &pids,
            interrupted: None,
        };
        let line = AtomicU64::new(0);
        let err = watch.word(&line, Tag::for_epoch(1), 2, PHASE).unwrap_err();
        assert!(matches!(err, Error::PeerTimeout { peer: 2, .. }), "{err}");
    }

    #[test]
    fn names_every_peer_found_gone_the_awaited_one_first() {
        let pids: Vec<Option<u32>> = (0..3)
            .map(|_| {
                let mut child = std::process::Command::new("true").spawn().unwrap();
                child.wait().unwrap();
                Some(child.id())
            })
            .collect();
        let alive = Some(std::process::id());
        let pids = [alive, pids[1], alive, pids[2]];
        let watch = Watch {
            timeout: Duration::from_secs(30),
            peer_pids: &pids,
            interrupted: None,
        };
        // Waiting on rank 3 (gone): it comes first, and rank 1 is named too.
        let line = AtomicU64::new(0);
        let msg = watch
            .word(&line, Tag::for_epoch(1), 3, PHASE)
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("rank 3 ") && msg.contains("rank 1 (pid"),
            "{msg}"
        );
    }
}
