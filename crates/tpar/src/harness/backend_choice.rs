//! `--backend auto|cpu|cuda`: which transport a command runs on, and the one-line reason when
//! `auto` cannot use a GPU.

use anyhow::{bail, Result};
use tpar::dispatch::Choice;

use tpar::algorithm::Selection;
use tpar::harness::cuda_ranks::parse_selection;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// CUDA where a usable GPU exists, otherwise CPU (with a note saying why).
    Auto,
    /// POSIX shared memory between processes on this host.
    Cpu,
    /// NVIDIA GPUs (driver and NVRTC loaded at run time).
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
        }
    }
}

/// The backend to run and, for `auto` falling back to the CPU, the note to show the user.
pub fn resolve(requested: BackendArg) -> Result<(Backend, Option<String>)> {
    match requested {
        BackendArg::Cpu => Ok((Backend::Cpu, None)),
        BackendArg::Cuda => match tpar::backend::cuda::probe() {
            Ok(_) => Ok((Backend::Cuda, None)),
            Err(why) => bail!("--backend cuda: {why}; run with --backend cpu (or auto)"),
        },
        BackendArg::Auto => match tpar::backend::cuda::probe() {
            Ok(_) => Ok((Backend::Cuda, None)),
            Err(why) => Ok((
                Backend::Cpu,
                Some(format!(
                    "note: no usable GPU ({why}); running the CPU backend"
                )),
            )),
        },
    }
}

/// What a command that runs ranks settles before it starts any: the backend (and the note when
/// `auto` fell back), the world size and the algorithms.
pub struct Setup {
    pub backend: Backend,
    pub note: Option<String>,
    pub world_size: usize,
    /// tpar's algorithms, and NCCL and `auto` where the backend is CUDA.
    pub choices: Vec<Selection>,
    /// The choices were named by `--algos` (not the default list).
    pub explicit: bool,
}

impl Setup {
    /// Defaults: as many ranks as GPUs (CUDA) or cores (CPU, 2 to 8); every algorithm the
    /// backend has.
    pub fn resolve(
        backend: BackendArg,
        world_size: Option<usize>,
        algos: Option<&str>,
    ) -> Result<Setup> {
        // A misspelt TPAR_ALGO would otherwise be read only where a communicator is built
        // (never, on the CPU backend): refuse it before anything starts.
        let forced = Selection::from_env()
            .map(Selection::forced)
            .map_err(|e| crate::args::usage(e.into()))?;
        let (backend, mut note) = resolve(backend)?;
        if let Some(choice) = forced {
            if backend == Backend::Cpu {
                bail!(crate::args::Usage(format!(
                    "TPAR_ALGO={choice} steers the CUDA dispatcher; the CPU backend runs the algorithms of --algos: unset TPAR_ALGO and pass --algos {choice}"
                )));
            }
            let line = format!(
                "note: TPAR_ALGO={choice} forces the `auto` route; the other routes run as named"
            );
            note = Some(match note {
                Some(n) => format!("{n}\n{line}"),
                None => line,
            });
        }
        let default_world = match backend {
            Backend::Cpu => std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .clamp(2, 8),
            Backend::Cuda => tpar::backend::cuda::probe()?,
        };
        let world_size = crate::ranks::world_size_or(world_size, default_world)?;
        let choices = match algos {
            Some(list) => crate::args::parse_list(list, "algos", |s| Ok(parse_selection(s)?))?,
            None if backend == Backend::Cuda => Choice::ALL
                .map(Selection::Forced)
                .into_iter()
                .chain([Selection::Auto])
                .collect(),
            None => tpar::CpuCommunicator::ALGORITHMS
                .map(|a| Selection::Forced(Choice::Tpar(a)))
                .to_vec(),
        };
        if backend == Backend::Cpu {
            let cpu_runs = |c: &Selection| matches!(c, Selection::Forced(Choice::Tpar(a)) if tpar::CpuCommunicator::ALGORITHMS.contains(a));
            if let Some(c) = choices.iter().find(|c| !cpu_runs(c)) {
                bail!(crate::args::Usage(format!("--algos {c}: the CPU backend runs one-shot and two-shot ({c} needs --backend cuda)")));
            }
        }
        Ok(Setup {
            backend,
            note,
            world_size,
            choices,
            explicit: algos.is_some(),
        })
    }

    /// tpar's own algorithms among the choices, for commands that check exact sums (NCCL's own
    /// summation order does not give them): NCCL is left out of the default list, and refused
    /// when asked for by name.
    pub fn tpar_algorithms(&self, command: &str) -> Result<Vec<tpar::Algorithm>> {
        if let Some(other) = self
            .choices
            .iter()
            .find(|c| !matches!(c, Selection::Forced(Choice::Tpar(_))))
            .filter(|_| self.explicit)
        {
            bail!(crate::args::Usage(format!(
                "{command} checks tpar's algorithms one by one; {} is compared by `tpar bench`",
                other.name()
            )));
        }
        Ok(self
            .choices
            .iter()
            .filter_map(|c| match c {
                Selection::Forced(Choice::Tpar(a)) => Some(*a),
                _ => None,
            })
            .collect())
    }
}

/// "NVIDIA H200, driver 580.159.04" for the first GPU, from the driver's /proc file.
pub fn cuda_device(ctx: &cudarc::driver::CudaContext, gpus: usize) -> String {
    let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_owned());
    let driver = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|v| {
            v.split_whitespace()
                .find(|w| {
                    w.chars().filter(|c| *c == '.').count() >= 1
                        && w.chars().next().is_some_and(|c| c.is_ascii_digit())
                })
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let cuda = tpar::backend::cuda::driver::driver_version()
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
        .unwrap_or_default();
    format!("cuda: {gpus} x {name}, driver {driver} (CUDA {cuda})")
}
