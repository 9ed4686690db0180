//! `--backend auto|cpu|cuda`: which transport a command runs on, and the one-line reason when
//! `auto` cannot use a GPU.

use anyhow::{bail, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendArg {
    /// CUDA where a usable GPU exists, otherwise CPU (with a note saying why).
    Auto,
    /// POSIX shared memory between processes on this host.
    Cpu,
    /// NVIDIA GPUs.
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cpu,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
        }
    }
}

/// The backend to run and, for `auto` falling back to the CPU, the note to show the user.
pub fn resolve(requested: BackendArg) -> Result<(Backend, Option<String>)> {
    const NO_CUDA_YET: &str = "this build of tpar has no CUDA backend yet";
    match requested {
        BackendArg::Cpu => Ok((Backend::Cpu, None)),
        BackendArg::Cuda => {
            bail!("--backend cuda: {NO_CUDA_YET}; run with --backend cpu (or auto)")
        }
        BackendArg::Auto => {
            let why = match tpar::backend::visible_nvidia_gpus() {
                Ok(n) => format!("{n} NVIDIA GPU(s) visible, but {NO_CUDA_YET}"),
                Err(reason) => format!("no usable GPU: {reason}"),
            };
            Ok((
                Backend::Cpu,
                Some(format!("note: {why}; running the CPU backend")),
            ))
        }
    }
}
