//! How a command ends when it fails: its error said on one line with each cause once, exit 2
//! for a usage error and 1 for a failed run, and standard output's failures told apart (a
//! closed pipe ends the process quietly by SIGPIPE, as `yes | head -1` ends `yes`).

use std::process::ExitCode;

use tpar_report::ReportError;

/// Exit status of a usage error (clap's, and ours found while checking arguments); a run that
/// fails exits 1.
pub const USAGE_EXIT: u8 = 2;

/// Says `e` and gives the exit status it ends with; a closed stdout ends the process here.
pub fn failed(e: &anyhow::Error) -> ExitCode {
    if closed_stdout(e) {
        crate::sys::die_of_sigpipe();
    }
    tpar_report::print_err(&error_line(e));
    if crate::args::is_usage(e) {
        ExitCode::from(USAGE_EXIT)
    } else {
        ExitCode::FAILURE
    }
}

/// `tpar: error: message: cause ...` on one line, each cause said once.
pub fn error_line(e: &anyhow::Error) -> String {
    let chain = tpar_harness::error_chain(e.as_ref());
    format!("tpar: error: {}", one_line(&chain))
}

/// Messages are one line: a multi-line cause (a rank's output, a parser's report) is joined.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The error is standard output's reader going away (`tpar ... | head -1`).
pub fn closed_stdout(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<ReportError>()
            .is_some_and(ReportError::is_closed_stdout)
    })
}

/// The error is standard output refusing a write (a closed pipe, a full disk).
pub fn stdout_failed(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<ReportError>(),
            Some(ReportError::Stdout(_))
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_line_says_each_cause_once() {
        let io = tpar::Error::Io {
            what: "cannot read topology file",
            path: "/nonexist".into(),
            source: std::io::Error::from_raw_os_error(2),
        };
        let e = anyhow::Error::new(io).context("tpar doctor");
        assert_eq!(
            error_line(&e),
            "tpar: error: tpar doctor: cannot read topology file /nonexist: No such file or directory (os error 2)"
        );
        assert_eq!(one_line("a\n\n  b \n"), "a; b");
    }

    #[test]
    fn stdout_failures_are_found_in_the_chain() {
        let pipe = ReportError::Stdout(std::io::ErrorKind::BrokenPipe.into());
        let e = anyhow::Error::new(pipe).context("rank 0");
        assert!(closed_stdout(&e) && stdout_failed(&e));
        let full = anyhow::Error::new(ReportError::Stdout(std::io::Error::from_raw_os_error(28)));
        assert!(!closed_stdout(&full) && stdout_failed(&full));
        assert!(!stdout_failed(&anyhow::anyhow!("other")));
    }
}
