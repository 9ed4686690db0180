//! A rank of a job whose processes a launcher started (`tpar` itself, torchrun, an engine):
//! its place in the job, the rendezvous its communicators are built on, and the one-line
//! diagnostics ranks write to a shared terminal.

use tpar::Rendezvous;

/// What a rank's body gets: its place in the job and the rendezvous to build communicators on.
pub struct Rank {
    pub rendezvous: Rendezvous,
}

/// Rank 0's results so far, in the rendezvous directory, where `tpar`'s launcher prints them
/// if the job is interrupted.
pub const PARTIAL_FILE: &str = "partial-output.txt";

impl Rank {
    pub fn rank(&self) -> usize {
        self.rendezvous.rank()
    }

    pub fn world_size(&self) -> usize {
        self.rendezvous.world_size()
    }

    /// Rank 0 speaks for the job (table, JSON, progress); the others stay quiet.
    pub fn is_leader(&self) -> bool {
        self.rank() == 0
    }

    /// Keeps `text` (the table so far) where the launcher prints it if the job is
    /// interrupted; replaced whole each time, so a reader never sees half of it. Only under
    /// tpar's own launcher, which removes its directory after the job: an outside launcher's
    /// directory is the user's, where the file would stay behind. Private (0600) like the
    /// rendezvous records beside it.
    pub fn save_partial(&self, text: &str) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        if std::env::var_os(tpar::rendezvous::ENV_LAUNCHER).is_none() {
            return;
        }
        let dir = &self.rendezvous.env().dir;
        let tmp = dir.join(format!("{PARTIAL_FILE}.tmp"));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| f.write_all(text.as_bytes()));
        if written.is_ok() {
            let _ = std::fs::rename(&tmp, dir.join(PARTIAL_FILE));
        }
    }
}

/// Prints `tpar[rank R]: message` to stderr in one write, so that the lines of ranks sharing
/// the terminal or a pipe never interleave (a write of under 4 KiB to a pipe is atomic).
pub fn say(rank: usize, message: &str) {
    use std::io::Write;
    let line = format!("tpar[rank {rank}]: {message}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
