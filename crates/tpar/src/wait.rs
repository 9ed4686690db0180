//! Waiting for a peer's flag with a deadline. Spins briefly (the fast case: the peer runs on
//! another core and is about to write), then yields (ranks may outnumber cores, and the peer
//! needs ours), then sleeps in short, growing steps. While waiting it checks that the awaited peer still
//! exists, so a rank whose process is gone is reported at once instead of at the deadline, and
//! it lets the caller look for other reasons to stop (a peer that called with other arguments).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sys::{liveness, Liveness};

/// How long to spin before yielding when the awaited peer runs on another core: it is busy
/// with its part of the round (tens of microseconds for a large one), and a yield on a loaded
/// machine can hand this core to another process for a whole time slice.
pub(crate) const SPIN_ALONE: Duration = Duration::from_micros(50);
/// ... and when the peer last ran on this very core, or ranks outnumber cores: then every
/// microsecond spun is one the peer cannot run. (Spinning 20 us whatever the peer's core made
/// a 4 KiB two-shot take 43 us instead of 2 on a machine at load 4 on 2 cores: two waits spun
/// out in full while the peer waited for the core.)
pub(crate) const SPIN_SHARED: Duration = Duration::from_nanos(500);
/// Yield for this long before sleeping.
const YIELD_FOR: Duration = Duration::from_millis(2);
/// The first sleep; each next one doubles, up to [`SLEEP_MAX`]: a wait that reached the sleeps
/// is already long, and many of them at once (a job of many ranks waiting out a silent peer)
/// must not keep the cores busy waking up.
const SLEEP: Duration = Duration::from_micros(50);
const SLEEP_MAX: Duration = Duration::from_micros(500);
const LIVENESS_EVERY: Duration = Duration::from_millis(50);
/// Spins between two looks at the clock and at the caller's check.
const SPINS_PER_CHECK: u32 = 16;

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

/// The deadline, the peers' process ids (where this rank can see them) and how long to spin.
pub(crate) struct Watch<'a> {
    pub timeout: Duration,
    pub peer_pids: &'a [Option<u32>],
    pub interrupted: Option<&'a InterruptCheck>,
    /// Spinning before the first yield at most ([`SPIN_ALONE`] or [`SPIN_SHARED`]).
    pub spin: Duration,
}

impl Watch<'_> {
    /// Returns once `flag` holds `epoch`. `check` runs now and then while the flag is late and
    /// may end the wait with its own error (a mismatched call seen in the peer's header);
    /// `spin` says, when the flag is late, how long to spin before yielding (at most
    /// `self.spin`).
    #[inline]
    pub fn until(
        &self,
        flag: &AtomicU64,
        epoch: u64,
        peer: usize,
        phase: Phase,
        check: &mut dyn FnMut() -> Result<()>,
        spin: &dyn Fn() -> Duration,
    ) -> Result<()> {
        if flag.load(Ordering::Acquire) == epoch {
            return Ok(());
        }
        self.slow(flag, epoch, peer, phase, check, spin().min(self.spin))
    }

    #[cold]
    fn slow(
        &self,
        flag: &AtomicU64,
        epoch: u64,
        peer: usize,
        phase: Phase,
        check: &mut dyn FnMut() -> Result<()>,
        spin: Duration,
    ) -> Result<()> {
        let start = Instant::now();
        let mut last_liveness = start;
        let mut spins: u32 = 0;
        let mut sleep = SLEEP;
        loop {
            if flag.load(Ordering::Acquire) == epoch {
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins % SPINS_PER_CHECK != 0 {
                std::hint::spin_loop();
                continue;
            }
            let now = now_after(start);
            let waited = now - start;
            if waited >= spin + YIELD_FOR {
                std::thread::sleep(sleep);
                sleep = (sleep * 2).min(SLEEP_MAX);
            } else if waited >= spin {
                std::thread::yield_now();
                // Every yield is a check (the clock, the caller's check) from here on.
                spins = spins.wrapping_add(SPINS_PER_CHECK - 1);
            }
            check()?;
            if waited >= self.timeout {
                return Err(Error::PeerTimeout {
                    peer,
                    phase: phase.to_string(),
                    waited,
                });
            }
            if now - last_liveness >= LIVENESS_EVERY {
                last_liveness = now;
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
    use std::sync::Arc;

    fn never() -> Result<()> {
        Ok(())
    }

    fn full() -> Duration {
        SPIN_ALONE
    }

    const PHASE: Phase = Phase {
        step: "test",
        seq: 1,
        chunk: 0,
    };

    fn watch<'a>(timeout: Duration, pids: &'a [Option<u32>]) -> Watch<'a> {
        Watch {
            timeout,
            peer_pids: pids,
            interrupted: None,
            spin: SPIN_ALONE,
        }
    }

    #[test]
    fn returns_once_another_thread_raises_the_flag() {
        let flag = Arc::new(AtomicU64::new(6));
        let writer = {
            let flag = flag.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                flag.store(7, Ordering::Release);
            })
        };
        let start = Instant::now();
        watch(Duration::from_secs(5), &[])
            .until(&flag, 7, 1, PHASE, &mut never, &full)
            .unwrap();
        assert!(start.elapsed() >= Duration::from_millis(15));
        writer.join().unwrap();
    }

    #[test]
    fn the_callers_check_ends_a_late_wait_with_its_error() {
        let flag = AtomicU64::new(0);
        let mut calls = 0;
        let err = watch(Duration::from_secs(30), &[])
            .until(
                &flag,
                1,
                1,
                PHASE,
                &mut || {
                    calls += 1;
                    Err(Error::InvalidArgument("seen".into()))
                },
                &full,
            )
            .unwrap_err();
        assert!(err.to_string().contains("seen"), "{err}");
        assert_eq!(calls, 1);
    }

    #[test]
    fn an_interrupt_stops_the_wait_naming_the_peer() {
        let flag = AtomicU64::new(0);
        let stop = || true;
        let watch = Watch {
            interrupted: Some(&stop),
            ..watch(Duration::from_secs(30), &[])
        };
        let start = Instant::now();
        let err = watch
            .until(&flag, 1, 1, PHASE, &mut never, &full)
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(1));
        assert!(matches!(err, Error::Interrupted { peer: 1, .. }), "{err}");
    }

    #[test]
    fn times_out_naming_the_peer_and_phase() {
        let flag = AtomicU64::new(6); // a stale epoch
        let start = Instant::now();
        let err = watch(Duration::from_millis(100), &[None, None, None])
            .until(&flag, 7, 2, PHASE, &mut never, &full)
            .unwrap_err();
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
        let flag = AtomicU64::new(0);
        let pids = [None, Some(pid)];
        let start = Instant::now();
        let err = watch(Duration::from_secs(30), &pids)
            .until(&flag, 1, 1, PHASE, &mut never, &full)
            .unwrap_err();
        assert!(matches!(err, Error::PeerGone { peer: 1, .. }), "{err}");
        assert!(err.to_string().contains("exited"), "{err}");
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
        let flag = AtomicU64::new(0);
        let err = watch(Duration::from_millis(600), &pids)
            .until(&flag, 1, 2, PHASE, &mut never, &full)
            .unwrap_err();
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
        // Waiting on rank 3 (gone): it comes first, and rank 1 is named too.
        let flag = AtomicU64::new(0);
        let msg = watch(Duration::from_secs(30), &pids)
            .until(&flag, 1, 3, PHASE, &mut never, &full)
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("rank 3 ") && msg.contains("rank 1 (pid"),
            "{msg}"
        );
    }
}
