//! The one signal call of the `tpar` command, fenced here: ending as a program killed by
//! SIGPIPE does when standard output's reader went away (`tpar bench | head -1`).

/// The exit status a shell reports for a program killed by SIGPIPE.
pub const SIGPIPE_STATUS: i32 = 128 + libc::SIGPIPE;

/// Ends this process by SIGPIPE's default action: killed by the signal, nothing printed, as
/// `yes | head -1` ends `yes` (a shell reports status 141). Rust starts programs with SIGPIPE
/// ignored, which turns a closed pipe into an error instead; the default is restored first.
pub fn die_of_sigpipe() -> ! {
    // SAFETY: signal() only sets this process's disposition of SIGPIPE to the default action
    // (no handler runs), and raise() sends SIGPIPE to the calling thread; neither touches
    // memory of ours.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    // Reached only if SIGPIPE is blocked in this thread: the status the signal would give.
    std::process::exit(SIGPIPE_STATUS)
}
