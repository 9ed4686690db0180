//! tpar's printers: the text tables, JSON files and SVG plots of what `tpar_harness` and
//! `tpar_harness::planner` report, as ripgrep's grep-printer is to its searcher. The `tpar` command
//! maps its subcommands onto the library and prints through this crate; the functions here
//! compute nothing about the machine: each turns a finished report into text.
//!
//! - [`table`]: the plain text table and the cells every table shares (sizes, rank counts,
//!   rows that did not run).
//! - [`output`]: where output goes: stdout without panics, files replaced whole, devices and
//!   FIFOs written in place, targets checked before a run.
//! - [`plot`]: latency against message size as SVG.
//! - [`bench`](mod@bench), [`selftest`], [`step`], [`tune`], [`doctor`], [`plan`]: the text of each
//!   command's report.

pub mod bench;
pub mod doctor;
pub mod output;
pub mod plan;
pub mod plot;
pub mod selftest;
pub mod step;
pub mod table;
pub mod tune;

pub use output::{
    check_target, emit, emit_to, print_err, print_out, table_on_stdout, write_json, write_target,
};
pub use table::{name_with_runs, ranks, size, skipped_row, Table};

/// What can stop a report from being written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// An output target (`--json`, `--plot`) that cannot be written, found before writing:
    /// `target` is the flag and the path, `reason` says why and the fix.
    #[error("{target}: {reason}")]
    Target { target: String, reason: String },
    /// Writing a target failed (`target`: the flag and the path; `source`: the system's reason).
    #[error("cannot write {target}")]
    Write {
        target: String,
        #[source]
        source: std::io::Error,
    },
    /// Standard output could not be written (a closed pipe, a full disk).
    #[error("cannot write to standard output")]
    Stdout(#[source] std::io::Error),
    /// The plot cannot be drawn; the message says why.
    #[error("{0}")]
    Plot(String),
}

impl ReportError {
    /// Standard output's reader went away (`tpar ... | head -1`): the command should end
    /// quietly, as a program killed by SIGPIPE does.
    pub fn is_closed_stdout(&self) -> bool {
        matches!(self, ReportError::Stdout(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
    }
}

pub type Result<T, E = ReportError> = std::result::Result<T, E>;
