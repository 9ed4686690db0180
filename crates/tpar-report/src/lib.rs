//! tpar's printers: the text tables, JSON files and SVG plots of what `tpar_harness` and
//! `tpar_harness::planner` report, as ripgrep's grep-printer is to its searcher. The `tpar` command
//! maps its subcommands onto the library and prints through this crate; the functions here
//! compute nothing about the machine: each turns a finished report into text.
//!
//! - [`table`]: the plain text table and the cells every table shares (sizes, rank counts,
//!   rows that did not run).
//! - [`output`]: JSON written whole or not at all, and where `--json` puts the table and JSON.
//! - [`plot`]: latency against message size as SVG.
//! - [`bench`], [`selftest`], [`step`], [`tune`], [`doctor`], [`plan`]: the text of each
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

pub use output::{emit, write_json};
pub use table::{name_with_runs, ranks, size, skipped_row, Table};

/// What can stop a report from being written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be written (the JSON, its temporary file, the plot).
    #[error("cannot write {path}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Standard output could not be written (a closed pipe).
    #[error(transparent)]
    Stdout(#[from] std::io::Error),
    /// The plot cannot be drawn; the message says why.
    #[error("{0}")]
    Plot(String),
}

pub type Result<T, E = ReportError> = std::result::Result<T, E>;
