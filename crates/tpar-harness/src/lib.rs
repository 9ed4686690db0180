//! The measuring and checking harness: what `tpar bench`, `tpar selftest`, `tpar tune` and
//! `tpar doctor` run, in a library so that Python and engines can tune and verify a machine
//! the same way the command does. Built on the core crate `tpar` (what an engine links), which
//! knows nothing of this one; capacity planning ([`planner`]) and cuBLAS ([`blas`]) live here
//! too.
//!
//! - [`cuda_ranks`]: a group of CUDA ranks, as threads of this process (one stream each) or as
//!   this process's rank of a job, with the collective invariant every caller keeps: call
//!   counts come from an allreduced value, or the ranks' epochs drift apart.
//! - [`ranks`]: a rank of a job started by a launcher, and its diagnostics.
//! - [`job`]: running a body as the ranks of a job (this process as a rank, or launching
//!   copies of a program and collecting how each ended).
//! - [`provenance`]: host, device, commit, date and command, recorded with every result.
//! - [`known`]: known inputs, their exact sums and the cross-rank tally of failed checks.
//! - [`cuda_bench`]: timing by graph replay with agreed counts, and the floors of the same run.
//! - the one numerical check is [`tpar::verify`] (below the communicator, which runs it at
//!   init); `tpar doctor` and the sweep run it on rank groups from here.
//! - [`cuda_selftest`]: the numerical self-test sweep (eager, graph-replayed, many replays).
//! - [`backend_choice`]: which backend a job runs on, its world size and algorithms.
//! - [`debug_rank`]: scripted calls with injected faults (the hidden `tpar debug-rank`).
//! - [`doctor`]: what `tpar doctor` examines and finds, as a report.
//! - [`cpu_bench`]: the CPU backend's benchmark on one rank of a job.
//! - [`cpu_selftest`]: the CPU backend's self-test on one rank of a job.
//! - [`selftest_row`]: one row of a self-test (what was checked, on how many ranks it failed).
//! - [`tune`]: the tuning table from measured rows.
//! - [`bench_step`] and [`blas`]: one tensor-parallel forward pass timed with each way of
//!   reducing, and the cuBLAS binding it needs (its FFI fenced in that one file).
//! - [`step_request`]: what a `bench step` request settles first (model, layers, passes) and
//!   its report.
//! - [`fused_bench`]: the fused allreduce + residual add + RMSNorm's self-test rows and bench.
//! - [`anatomy`]: what each piece of one call costs (a ladder of kernels).
//! - [`limits`]: what this host can hold (RAM, /dev/shm, cores) against a job's needs.
//! - [`reports`]: each run's report as written out (rows, timing, provenance).
//! - [`runs`]: the bench's rank bodies (CPU on a rank, CUDA on a group), settings to report.
//! - [`sizes`]: message sizes as written (`4K`), the default sweeps, sizes as element counts.
//! - [`stats`]: percentiles and bus bandwidth.
//! - [`planner`]: capacity planning before a server starts (memory, speculative decoding, the
//!   latency model of a step).
//!
//! Output (tables, JSON, plots, progress bars) is the caller's: functions here return rows.

pub mod anatomy;
pub mod backend_choice;
pub mod bench_step;
pub mod blas;
pub mod cpu_bench;
pub mod cpu_selftest;
pub mod cuda_bench;
pub mod cuda_ranks;
pub mod cuda_selftest;
pub mod debug_rank;
pub mod doctor;
pub mod fused_bench;
pub mod job;
pub mod known;
pub mod limits;
pub mod planner;
pub mod provenance;
pub mod ranks;
pub mod reports;
pub mod runs;
pub mod selftest_row;
pub mod sizes;
pub mod stats;
pub mod step_request;
pub mod tune;

/// What can end a harness run: the library's own errors, the CUDA driver's, a check that
/// could not be made, each with the context that says where.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error(transparent)]
    Tpar(#[from] tpar::Error),
    #[error(transparent)]
    Driver(#[from] cudarc::driver::DriverError),
    #[error(transparent)]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// A measurement or check that cannot be made as asked (the message says why and the fix).
    #[error("{0}")]
    Failed(String),
    /// `source`, seen from the step named by `context` ("rank 3", "rung 2, 4096 B").
    #[error("{context}")]
    Context {
        context: String,
        #[source]
        source: Box<HarnessError>,
    },
}

pub type Result<T, E = HarnessError> = std::result::Result<T, E>;

impl HarnessError {
    /// The message with every cause after it, `context: cause: ...`, as the CLI prints errors.
    pub fn chain(&self) -> String {
        error_chain(self)
    }
}

/// `error: cause: cause ...`, leaving out a cause whose text the message already holds (an
/// error that prints its source inline and also returns it from `source()` would otherwise
/// say "(os error 2): No such file or directory (os error 2)").
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        source = cause.source();
    }
    text
}

/// Adds the step an error happened in, as `anyhow::Context` does (the CLI prints the chain
/// `context: cause`).
pub trait Context<T> {
    fn context(self, context: impl Into<String>) -> Result<T>;
    fn with_context<C: Into<String>>(self, context: impl FnOnce() -> C) -> Result<T>;
}

impl<T, E: Into<HarnessError>> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| HarnessError::Context {
            context: context.into(),
            source: Box::new(e.into()),
        })
    }

    fn with_context<C: Into<String>>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| HarnessError::Context {
            context: context().into(),
            source: Box::new(e.into()),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| HarnessError::Failed(context.into()))
    }

    fn with_context<C: Into<String>>(self, context: impl FnOnce() -> C) -> Result<T> {
        self.ok_or_else(|| HarnessError::Failed(context().into()))
    }
}

/// Returns a [`HarnessError::Failed`] with a formatted message.
macro_rules! bail {
    ($($message:tt)*) => {
        return Err($crate::HarnessError::Failed(format!($($message)*)))
    };
}
pub(crate) use bail;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_keeps_the_cause_as_the_source() {
        let inner: Result<()> = Err(HarnessError::Failed("element 7 was 3".into()));
        let e = inner.context("rank 1").unwrap_err();
        assert_eq!(e.to_string(), "rank 1");
        let source = std::error::Error::source(&e).expect("a source");
        assert_eq!(source.to_string(), "element 7 was 3");
        assert_eq!(e.chain(), "rank 1: element 7 was 3");
        let io = tpar::Error::Io {
            what: "cannot read",
            path: "/x".into(),
            source: std::io::Error::from_raw_os_error(2),
        };
        assert_eq!(
            error_chain(&io),
            "cannot read /x: No such file or directory (os error 2)"
        );
        let none: Option<u8> = None;
        assert_eq!(
            none.context("no graph").unwrap_err().to_string(),
            "no graph"
        );
    }
}
