//! tpar: low-latency allreduce across the ranks of one host, for tensor-parallel inference.
//!
//! The crate is organised in layers:
//! - [`protocol`]: what every transport shares: the algorithms' schedules and summation order,
//!   call headers, chunking, and the GPU's wire format (LL lines that carry a tag beside the
//!   data, buffer layout), which the kernels implement. Pure functions, no I/O. The CPU backend
//!   moves plain data with its own layout ([`backend::cpu::layout`]).
//! - [`rendezvous`] and [`launch`]: how the ranks of one job find each other on this host
//!   (a private directory and a random job token) and how `tpar` starts its own ranks.
//! - [`backend`]: transports. [`backend::cpu`] runs the protocol over POSIX shared memory
//!   between processes; [`backend::cuda`] runs it in CUDA kernels; [`backend::nccl`] loads NCCL.
//! - [`topology`] and [`dispatch`]: what the machine is (plain data; [`backend::machine`] reads
//!   it) and which path runs each message (pure policy: no backend imports);
//!   [`communicator::Communicator`] puts the CUDA and NCCL backends behind one call path
//!   (check -> decide -> enqueue).
//! - [`check`]: known inputs and their exact sums, so every self-test and benchmark verifies
//!   what it runs.
//! - [`environment`]: the process set-up every entry runs before CUDA (the `tpar` command at
//!   start, Python at import): NVRTC found where it is installed, `CUDA_DEVICE_MAX_CONNECTIONS`.
//! - [`verify`]: the one numerical check (known inputs, exact sums) behind every self-test.
//! - [`dtype`], [`algorithm`], [`islands`], [`memory`], [`error`], [`cache`], [`config`]: the
//!   small vocabulary types, the settings every rank of a communicator agrees on, and the cache root.
//!
//! What measures and checks a machine (bench, selftest, tune, doctor, the bench step with
//! cuBLAS) and capacity planning are the `tpar-harness` crate, built on this one: an engine
//! links only this crate.
//!
//! Layers point down only: `python3 scripts/import_graph.py` checks it (ARCHITECTURE.md).

pub mod algorithm;
pub mod backend;
pub mod cache;
pub mod check;
pub mod communicator;
pub mod config;
pub mod dispatch;
pub mod dtype;
pub mod environment;
pub mod error;
pub mod hash;
pub mod islands;
pub mod launch;
pub mod memory;
pub mod norm;
pub mod protocol;
pub mod rendezvous;
mod sys;
pub mod topology;
pub mod verify;
mod wait;

pub use algorithm::{Algorithm, Selection};
pub use backend::cpu::CpuCommunicator;
pub use communicator::Communicator;
pub use config::Config;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use islands::Islands;
pub use memory::MemoryFootprint;
pub use rendezvous::{RankEnv, Rendezvous};
pub use sys::{allowed_cpus, dir_writable, free_bytes, host_name, set_allowed_cpus};
