//! Which transport a job runs on (`--backend auto|cpu|cuda` of the CLI), with the one-line
//! reason when `auto` cannot use a GPU, and what a job settles before it starts any rank: the
//! world size and the algorithms, refused early where the backend cannot run them.

use crate::HarnessError;
use tpar::algorithm::Selection;
use tpar::dispatch::Choice;
use tpar::RankEnv;

/// Why a job cannot be set up: the request is wrong (`Usage`: the message names the fix), or
/// this machine cannot run it.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Failed(#[from] HarnessError),
}

impl From<tpar::Error> for SetupError {
    fn from(e: tpar::Error) -> SetupError {
        SetupError::Failed(e.into())
    }
}

type Result<T> = std::result::Result<T, SetupError>;

macro_rules! fail {
    ($($message:tt)*) => {
        return Err(SetupError::Failed(HarnessError::Failed(format!($($message)*))))
    };
}

macro_rules! usage {
    ($($message:tt)*) => {
        return Err(SetupError::Usage(format!($($message)*)))
    };
}

/// The backend asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendRequest {
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
pub fn resolve(requested: BackendRequest) -> Result<(Backend, Option<String>)> {
    match requested {
        BackendRequest::Cpu => Ok((Backend::Cpu, None)),
        BackendRequest::Cuda => match tpar::backend::cuda::check_available() {
            Ok(_) => Ok((Backend::Cuda, None)),
            Err(why) => fail!("--backend cuda: {why}; run with --backend cpu (or auto)"),
        },
        BackendRequest::Auto => match tpar::backend::cuda::check_available() {
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
    /// backend has. `algos` is the caller's parse of the list it was given (an error there is
    /// the message of a usage error, reported after the backend's own problems).
    pub fn resolve(
        backend: BackendRequest,
        world_size: Option<usize>,
        algos: Option<std::result::Result<Vec<Selection>, String>>,
    ) -> Result<Setup> {
        // A misspelt TPAR_ALGO would otherwise be read only where a communicator is built
        // (never, on the CPU backend): refuse it before anything starts.
        let forced = Selection::from_env()
            .map(Selection::forced)
            .map_err(|e| SetupError::Usage(crate::HarnessError::from(e).chain()))?;
        let (backend, mut note) = resolve(backend)?;
        if let Some(choice) = forced {
            if backend == Backend::Cpu {
                usage!(
                    "TPAR_ALGO={choice} steers the CUDA dispatcher; the CPU backend runs the algorithms of --algos: unset TPAR_ALGO and pass --algos {choice}"
                );
            }
            let line = format!(
                "note: TPAR_ALGO={choice} forces what `auto` runs; the other algorithms run as named"
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
            // A host of more GPUs than tpar serves runs on the first MAX_RANKS by default.
            Backend::Cuda => {
                tpar::backend::cuda::check_available()?.min(tpar::algorithm::MAX_RANKS)
            }
        };
        let world_size = world_size_or(world_size, default_world)?;
        let explicit = algos.is_some();
        let choices = match algos {
            Some(parsed) => parsed.map_err(SetupError::Usage)?,
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
                usage!(
                    "--algos {c}: the CPU backend runs {} ({c} needs --backend cuda)",
                    tpar::CpuCommunicator::ALGORITHMS
                        .map(|a| a.name())
                        .join(", ")
                );
            }
        }
        Ok(Setup {
            backend,
            note,
            world_size,
            choices,
            explicit,
        })
    }

    /// Refuses `--processes` on the CPU backend, which always runs one process per rank.
    pub fn check_processes(&self, processes: bool) -> Result<()> {
        if processes && self.backend == Backend::Cpu {
            usage!(
                "--processes is for the CUDA backend (the CPU backend always runs one process per rank); leave it out or use --backend cuda"
            );
        }
        Ok(())
    }

    /// Refuses a flag that only the CUDA backend reads (`--chain`, `--replays`: CUDA graphs)
    /// where it was given to the CPU backend, which would otherwise ignore it in silence.
    pub fn check_cuda_only(&self, flag: &str, given: bool) -> Result<()> {
        if given && self.backend == Backend::Cpu {
            usage!(
                "{flag} sets how CUDA graphs are timed and the CPU backend has none; leave it out or use --backend cuda"
            );
        }
        Ok(())
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
            usage!(
                "{command} checks tpar's algorithms one by one; {} is compared by `tpar bench`",
                other.name()
            );
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

/// The world size of a job: the launcher's WORLD_SIZE where this process is a rank (a flag
/// that says otherwise is refused, not obeyed by this rank alone), else the flag, else
/// `default`; 1 to [`tpar::algorithm::MAX_RANKS`].
pub fn world_size_or(flag: Option<usize>, default: usize) -> Result<usize> {
    let from_env = RankEnv::from_env()
        .map_err(|e| SetupError::Usage(HarnessError::from(e).chain()))?
        .map(|e| e.world_size);
    if let (Some(flag), Some(env)) = (flag, from_env) {
        if flag != env {
            usage!(
                "-n {flag} but the launcher set WORLD_SIZE={env}: under a launcher the environment \
                 decides; drop -n, or make the two agree"
            );
        }
    }
    let n = from_env.or(flag).unwrap_or(default);
    if n == 0 {
        usage!("--world-size must be at least 1");
    }
    if n > tpar::algorithm::MAX_RANKS {
        let source = if from_env.is_some() {
            format!("WORLD_SIZE={n}")
        } else {
            format!("{n} ranks")
        };
        usage!("{}", tpar::algorithm::too_many_ranks(&source));
    }
    Ok(n)
}

/// `"cpu: <model> (<n> logical cores)"` from /proc/cpuinfo.
pub fn cpu_device() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("cpu: {model} ({cores} logical cores)")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_refused_on_the_cpu_backend_only() {
        let setup = Setup::resolve(BackendRequest::Cpu, Some(2), None).unwrap();
        assert!(setup.check_processes(false).is_ok());
        match setup.check_processes(true) {
            Err(SetupError::Usage(m)) => assert!(m.contains("--processes is for the CUDA"), "{m}"),
            other => panic!("{:?}", other.is_ok()),
        }
        assert!(setup.check_cuda_only("--chain", false).is_ok());
        match setup.check_cuda_only("--chain", true) {
            Err(SetupError::Usage(m)) => assert!(m.starts_with("--chain sets how CUDA"), "{m}"),
            other => panic!("{:?}", other.is_ok()),
        }
    }

    #[test]
    fn the_cpu_backend_refuses_what_it_cannot_run_as_a_usage_error() {
        let nccl = vec![Selection::Forced(Choice::Nccl)];
        match Setup::resolve(BackendRequest::Cpu, Some(2), Some(Ok(nccl))) {
            Err(SetupError::Usage(m)) => assert!(m.contains("needs --backend cuda"), "{m}"),
            other => panic!("{:?}", other.map(|s| s.world_size)),
        }
        match Setup::resolve(BackendRequest::Cpu, Some(2), Some(Err("bad list".into()))) {
            Err(SetupError::Usage(m)) => assert_eq!(m, "bad list"),
            other => panic!("{:?}", other.map(|s| s.world_size)),
        }
        let setup = Setup::resolve(BackendRequest::Cpu, Some(3), None).unwrap();
        assert_eq!((setup.backend, setup.world_size), (Backend::Cpu, 3));
        assert_eq!(
            setup.tpar_algorithms("x").unwrap(),
            tpar::CpuCommunicator::ALGORITHMS.to_vec()
        );
    }
}
