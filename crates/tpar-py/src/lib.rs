//! The `tpar._tpar` extension module: one rank's communicators for Python (the CPU backend for
//! host arrays and, on a GPU, tpar's dispatched CUDA allreduce), driven by the `tpar` package
//! (python/tpar), which checks arrays and tensors and passes their addresses and streams.
//! Errors arrive as `tpar.TparError` with the library's own messages.

use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::{Arc, Mutex};

mod fused;
use fused::OperandChecks;

use tpar::backend::cuda::fused::{FusedInput, FusedResidual, FusedSpans};
use tpar::backend::cuda::{borrowed_stream, DeviceSpan, DeviceSpanMut};
use tpar::communicator::{BorrowedNccl, NcclMode};
use tpar::{
    Algorithm, Communicator, Config, CpuCommunicator, DType, MemoryFootprint, RankEnv, Rendezvous,
    Selection,
};

create_exception!(
    _tpar,
    TparError,
    PyException,
    "An error reported by tpar; the message says why and what to do."
);

/// The library's error as a TparError, its text in the Python user's words (the Rust field
/// names it suggests become the Python keyword arguments).
fn err(e: tpar::Error) -> PyErr {
    TparError::new_err(
        e.to_string()
            .replace(
                "--timeout / Config::timeout",
                "timeout= when creating the tpar.Communicator",
            )
            .replace(
                "every rank must use the same Config::chunk_bytes",
                "every rank must pass the same chunk_bytes=",
            ),
    )
}

/// Runs `f`, turning a panic (a bug in tpar) into a TparError instead of pyo3's
/// PanicException, which `except Exception` does not catch.
fn guard<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(TparError::new_err(format!(
                "internal error in {what}: {text}; please report it with the arguments that caused it"
            )))
        }
    }
}

/// The longest `timeout=` accepted: a year, far beyond any real wait, well inside what a
/// `Duration` and the kernels' globaltimer deadline can hold.
const MAX_TIMEOUT_S: f64 = 365.0 * 86400.0;

/// Checks the arguments of `Comm.new` that Python cannot type, naming the Python argument.
fn check_args(
    rank: usize,
    world_size: usize,
    timeout: f64,
    chunk_bytes: Option<usize>,
) -> PyResult<()> {
    if !(timeout > 0.0 && timeout <= MAX_TIMEOUT_S) {
        return Err(TparError::new_err(format!(
            "timeout={timeout}: give a number of seconds above 0 and at most {MAX_TIMEOUT_S} (a year)"
        )));
    }
    if world_size == 0 {
        return Err(TparError::new_err(
            "world_size=0: a group has at least one rank",
        ));
    }
    if rank >= world_size {
        return Err(TparError::new_err(format!(
            "rank={rank} is not below world_size={world_size}: ranks are numbered 0 to {}",
            world_size - 1
        )));
    }
    if let Some(chunk_bytes) =
        chunk_bytes.filter(|c| !(Config::MIN_CHUNK_BYTES..=(1 << 30)).contains(c))
    {
        return Err(TparError::new_err(format!(
            "chunk_bytes={chunk_bytes}: use {} bytes to 1 GiB (the default is {} on the CPU, {} on a GPU)",
            Config::MIN_CHUNK_BYTES,
            Config::CPU_CHUNK_BYTES,
            Config::CUDA_CHUNK_BYTES
        )));
    }
    Ok(())
}

/// `nccl=` as the Python package passes it: "own", "none", or a raw `ncclComm_t` address.
fn nccl_mode(nccl: &Bound<'_, PyAny>) -> PyResult<NcclMode> {
    if let Ok(name) = nccl.extract::<String>() {
        return name.parse().map_err(err);
    }
    match nccl.extract::<u64>() {
        Ok(0) => Err(TparError::new_err("nccl=0: a null NCCL communicator")),
        // SAFETY: documented on `nccl=`: the caller passes the live ncclComm_t of the same
        // ranks (a ProcessGroupNCCL's), which outlives this communicator.
        Ok(address) => Ok(NcclMode::Borrowed(unsafe {
            BorrowedNccl::new(address as usize as *mut std::ffi::c_void)
        })),
        Err(_) => Err(TparError::new_err(
            "nccl=: use \"own\", \"none\", a torch ProcessGroupNCCL or an ncclComm_t address (int)",
        )),
    }
}

/// One rank's communicators: the CPU backend (POSIX shared memory between the processes of
/// one host) always, and tpar's CUDA communicator (with NCCL behind the same call) when the
/// rank was given a GPU.
/// A fused call's operands from the package's arguments (`[x, residual, weight, y]` addresses).
fn fused_operands(
    dtype: &str,
    tokens: usize,
    hidden: usize,
    [x, residual, weight, y]: [u64; 4],
    residual_out: Option<u64>,
    eps: f32,
) -> PyResult<fused::Operands> {
    Ok(fused::Operands {
        dtype: dtype.parse().map_err(err)?,
        tokens,
        hidden,
        x,
        residual,
        residual_out,
        weight,
        y,
        eps,
    })
}

#[pyclass(module = "tpar._tpar", unsendable)]
struct Comm {
    cpu: Option<CpuCommunicator>,
    cuda: Option<Communicator>,
    device: Option<usize>,
    /// The KeyboardInterrupt (or other exception) a signal handler raised while a call
    /// waited for peers: the call stops and raises it.
    interrupted: Arc<Mutex<Option<PyErr>>>,
}

fn closed() -> PyErr {
    TparError::new_err("the communicator is closed; create a new one")
}

impl Comm {
    fn comm(&mut self) -> PyResult<&mut CpuCommunicator> {
        self.cpu.as_mut().ok_or_else(closed)
    }

    fn cuda(&self) -> PyResult<&Communicator> {
        match (&self.cuda, &self.cpu) {
            (Some(c), _) => Ok(c),
            (None, None) => Err(closed()),
            (None, Some(_)) => Err(TparError::new_err(
                "this communicator has no GPU: create it with device=<the rank's CUDA device> to reduce CUDA tensors",
            )),
        }
    }
}

fn footprint_dict<'py>(py: Python<'py>, m: &MemoryFootprint) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("device_bytes", m.device_bytes)?;
    d.set_item("pinned_host_bytes", m.pinned_host_bytes)?;
    d.set_item("shared_host_bytes", m.shared_host_bytes)?;
    d.set_item("peer_mapped_bytes", m.peer_mapped_bytes)?;
    d.set_item("allocated_bytes", m.allocated_bytes())?;
    d.set_item("device_buffer_bytes", m.device_buffer_bytes)?;
    d.set_item("module_bytes", m.module_bytes)?;
    d.set_item("nccl_bytes", m.nccl_bytes)?;
    d.set_item("nccl_estimated", m.nccl_estimated)?;
    Ok(d)
}

impl Comm {
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
        rank: Option<usize>,
        world_size: Option<usize>,
        rendezvous: Option<String>,
        token: Option<String>,
        timeout: f64,
        chunk_bytes: Option<usize>,
        device: Option<usize>,
        members: Option<Vec<usize>>,
        nccl: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Comm> {
        let nccl = match &nccl {
            None => NcclMode::None,
            Some(n) => nccl_mode(n)?,
        };
        let env = match rendezvous {
            Some(dir) => {
                let (Some(rank), Some(world_size), Some(token)) = (rank, world_size, token) else {
                    return Err(TparError::new_err("with rendezvous=..., give rank=, world_size= and token= too"));
                };
                RankEnv { rank, world_size, local_rank: rank, local_world_size: world_size, dir: dir.into(), token }
            }
            None => RankEnv::from_env().map_err(err)?.ok_or_else(|| {
                TparError::new_err("no rank environment: set TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK and WORLD_SIZE, or pass rendezvous=, token=, rank=, world_size=")
            })?,
        };
        check_args(env.rank, env.world_size, timeout, chunk_bytes)?;
        if rank.is_some_and(|r| r != env.rank) || world_size.is_some_and(|w| w != env.world_size) {
            return Err(TparError::new_err(format!(
                "rank=/world_size= ({rank:?}/{world_size:?}) disagree with the environment ({}/{})",
                env.rank, env.world_size
            )));
        }
        // One Config for both backends: `chunk_bytes=` reaches the CPU inbox and the CUDA
        // buffers alike; left out, each backend takes its own default (`Config::chunk_bytes`
        // says why they differ).
        let config = Config {
            timeout: Duration::from_secs_f64(timeout),
            chunk_bytes,
            ..Config::default()
        };
        let interrupted: Arc<Mutex<Option<PyErr>>> = Arc::default();
        let seen = interrupted.clone();
        // Asked every few ms while ranks gather and every ~50 ms while a call waits for peers
        // (without the GIL): runs Python's signal handlers, so Ctrl-C raises KeyboardInterrupt
        // within a fraction of a second.
        let check: Arc<tpar::backend::cpu::InterruptCheck> = Arc::new(move || {
            Python::attach(|py| match py.check_signals() {
                Ok(()) => false,
                Err(e) => {
                    *seen.lock().expect("interrupt slot") = Some(e);
                    true
                }
            })
        });
        // Waiting for peers can take a while: let other Python threads run.
        let created = py.detach(|| {
            let job = Rendezvous::join(env)?.with_interrupt(check.clone());
            let rdv = match &members {
                Some(m) => job.subgroup(m)?,
                None => job,
            };
            let cpu = CpuCommunicator::new(&rdv, config)?;
            let cuda = device
                .map(|d| Communicator::join_with(&rdv, d, config, nccl))
                .transpose()?;
            Ok((cpu, cuda))
        });
        let (mut cpu, cuda) = created.map_err(|e| Self::interrupted_or(&interrupted, e))?;
        cpu.set_interrupt(Some(check));
        Ok(Comm {
            cpu: Some(cpu),
            cuda,
            device,
            interrupted,
        })
    }

    /// The exception a signal handler raised during a wait, if that is why `e` happened.
    fn interrupted_or(slot: &Mutex<Option<PyErr>>, e: tpar::Error) -> PyErr {
        let raised = slot.lock().expect("interrupt slot").take();
        match (raised, &e) {
            (Some(py_err), tpar::Error::Interrupted { .. }) => py_err,
            _ => err(e),
        }
    }
}

#[pymethods]
impl Comm {
    /// Joins the job: `rank`/`world_size`/`rendezvous`/`token` as given, or, where `rendezvous`
    /// is None, from the environment (TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK, WORLD_SIZE).
    /// With `device` (a CUDA ordinal) the rank also gets tpar's CUDA communicator on it.
    #[new]
    #[pyo3(signature = (rank=None, world_size=None, rendezvous=None, token=None, timeout=30.0, chunk_bytes=None, device=None, members=None, nccl=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: Option<usize>,
        world_size: Option<usize>,
        rendezvous: Option<String>,
        token: Option<String>,
        timeout: f64,
        chunk_bytes: Option<usize>,
        device: Option<usize>,
        members: Option<Vec<usize>>,
        nccl: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Comm> {
        guard("Communicator()", || {
            Self::create(
                py,
                rank,
                world_size,
                rendezvous,
                token,
                timeout,
                chunk_bytes,
                device,
                members,
                nccl,
            )
        })
    }

    /// The CUDA ordinal of this rank's GPU, or None for a CPU-only communicator.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.device
    }

    /// Queues `output = sum over ranks of input` (`input=None`: in place) for `count`
    /// elements of `dtype` at device addresses on the CUDA `stream` and returns what ran
    /// (a tpar algorithm or "nccl"). No synchronisation: the caller's stream orders it. Errors
    /// a kernel reported since the last call (a peer that timed out, a mismatched call) are
    /// raised here first.
    /// `algorithm` forces one path (a tpar algorithm or "nccl"); one that cannot run here is
    /// an error, never skipped.
    #[pyo3(signature = (dtype, input, output, count, stream, capturing, algorithm=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_cuda(
        &self,
        dtype: &str,
        input: Option<u64>,
        output: u64,
        count: usize,
        stream: usize,
        capturing: bool,
        algorithm: Option<&str>,
    ) -> PyResult<String> {
        let dtype: DType = dtype.parse().map_err(err)?;
        if count > 0 && (output == 0 || input == Some(0)) {
            return Err(TparError::new_err("a null buffer address"));
        }
        let comm = self.cuda()?;
        comm.check().map_err(err)?;
        count
            .checked_mul(dtype.size())
            .ok_or_else(|| TparError::new_err(format!("count={count} elements is too many")))?;
        let selection = Selection::parse_from("algorithm", algorithm).map_err(err)?;
        // The library reads the stream's capture state itself; what Python saw is the same.
        let _ = capturing;
        let device = comm.cuda().context().ordinal();
        // SAFETY: the tpar package passes live, contiguous CUDA tensors of `count` elements of
        // `dtype` on this communicator's device and the stream torch orders them on; torch's
        // caching allocator keeps their memory until work queued on that stream has run, and
        // the stream outlives this call.
        let (input, output, stream) = unsafe {
            (
                input.map(|p| DeviceSpan::from_raw(device, p, count, dtype)),
                DeviceSpanMut::from_raw(device, output, count, dtype),
                borrowed_stream(
                    comm.cuda().context(),
                    stream as tpar::backend::cuda::CuStream,
                ),
            )
        };
        let plan = comm
            .all_reduce_selected(selection, input, output, &stream)
            .map_err(err)?;
        Ok(plan.choice.name().to_owned())
    }

    /// Returns once every rank has called it (through the CPU backend).
    fn barrier(&mut self, py: Python<'_>) -> PyResult<()> {
        let slot = self.interrupted.clone();
        let comm = self.comm()?;
        let mut word = [0u8; 4];
        py.detach(|| comm.all_reduce_bytes(DType::F32, None, &mut word, Algorithm::OneShot))
            .map_err(|e| Self::interrupted_or(&slot, e))
    }

    /// `(choice, reason)`: what a CUDA call of `bytes` of `dtype` runs and why.
    fn plan(&self, dtype: &str, bytes: u64, capturing: bool) -> PyResult<(String, String)> {
        let dtype: DType = dtype.parse().map_err(err)?;
        let comm = self.cuda()?;
        let plan = comm.decision(dtype, bytes, capturing).map_err(err)?;
        let reason = match comm.refusal(&plan) {
            Some(_) => format!("{}; REFUSED here: this communicator has nccl=\"none\", so all_reduce raises for this call and should_use() says False: keep it on your own NCCL", plan.reason),
            None => plan.reason,
        };
        Ok((plan.choice.name().to_owned(), reason))
    }

    /// Why a CUDA call of `bytes` of `dtype` would be refused before launch (planned for NCCL
    /// with nccl="none"), or None when it runs.
    fn refusal(&self, dtype: &str, bytes: u64, capturing: bool) -> PyResult<Option<String>> {
        let dtype: DType = dtype.parse().map_err(err)?;
        let comm = self.cuda()?;
        let plan = comm.decision(dtype, bytes, capturing).map_err(err)?;
        Ok(comm.refusal(&plan))
    }

    /// How many NCCL communicators tpar created itself for this communicator (0 or 1).
    #[getter]
    fn own_nccl_created(&self) -> usize {
        self.cuda.as_ref().map_or(0, Communicator::own_nccl_created)
    }

    /// What creating the CUDA communicator found that its user should hear about (paths the
    /// init self-test vetoed, a GPU time-sliced between processes); empty for the CPU backend.
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.cuda
            .as_ref()
            .map_or_else(Vec::new, |c| c.warnings().to_vec())
    }

    /// Raises the error a kernel or NCCL reported since the last check, if any.
    fn check(&self) -> PyResult<()> {
        self.cuda()?.check().map_err(err)
    }

    #[getter]
    fn rank(&mut self) -> PyResult<usize> {
        Ok(self.comm()?.rank())
    }

    #[getter]
    fn world_size(&mut self) -> PyResult<usize> {
        Ok(self.comm()?.world_size())
    }

    /// `output = sum over ranks of input` for `count` elements of `dtype` at the given
    /// addresses (`input=None`: in place). The Python side checks the arrays.
    #[pyo3(signature = (dtype, input, output, count, algorithm))]
    fn all_reduce_ptr(
        &mut self,
        py: Python<'_>,
        dtype: &str,
        input: Option<usize>,
        output: usize,
        count: usize,
        algorithm: &str,
    ) -> PyResult<()> {
        let dtype: DType = dtype.parse().map_err(err)?;
        let algorithm: Algorithm = algorithm.parse().map_err(err)?;
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| TparError::new_err(format!("count={count} elements is too many")))?;
        if output == 0 || input == Some(0) {
            return Err(TparError::new_err("a null buffer address"));
        }
        let slot = self.interrupted.clone();
        let comm = self.comm()?;
        // SAFETY: the tpar package passes the addresses of live, C-contiguous arrays of
        // `count` elements of `dtype` that it keeps referenced for the duration of the call.
        let (input, output) = unsafe {
            (
                input.map(|p| std::slice::from_raw_parts(p as *const u8, bytes)),
                std::slice::from_raw_parts_mut(output as *mut u8, bytes),
            )
        };
        // The wait for peers happens without the GIL: other ranks may be threads of this process.
        guard("all_reduce", || {
            py.detach(|| comm.all_reduce_bytes(dtype, input, output, algorithm))
                .map_err(|e| Self::interrupted_or(&slot, e))
        })
    }

    /// Bytes this rank allocated, by kind, summed over its backends, with each backend's
    /// own figures under "cpu" and "cuda".
    fn memory_footprint<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cpu = self.comm()?.memory_footprint();
        let cuda = self.cuda.as_ref().map(Communicator::memory_footprint);
        let sum = cuda.map_or(cpu, |g| cpu + g);
        let d = footprint_dict(py, &sum)?;
        d.set_item("cpu", footprint_dict(py, &cpu)?)?;
        if let Some(g) = cuda {
            d.set_item("cuda", footprint_dict(py, &g)?)?;
        }
        Ok(d)
    }

    /// Waits for tpar's work on the GPU, then releases every buffer; later calls raise
    /// TparError. (Dropping the object without close() does the same.)
    fn close(&mut self, py: Python<'_>) {
        if let Some(cuda) = self.cuda.take() {
            // Kernels may still be queued on the caller's stream: their buffers must outlive them.
            py.detach(|| {
                let _ = cuda.cuda().context().synchronize();
                drop(cuda);
            });
        }
        self.cpu = None;
    }

    // -- fused allreduce + residual add + RMSNorm (issue 15) ---------------------------------

    /// `(choice, fused, reason)` for a CUDA fused call of `tokens x hidden` elements of
    /// `dtype`: what its allreduce runs (a tpar algorithm or "nccl", as for a plain call of the
    /// same bytes), whether the fused kernel runs it or the allreduce is followed by tpar's
    /// separate norm kernel, and why.
    #[pyo3(signature = (dtype, tokens, hidden, capturing, algorithm=None))]
    fn fused_plan(
        &self,
        dtype: &str,
        tokens: usize,
        hidden: usize,
        capturing: bool,
        algorithm: Option<&str>,
    ) -> PyResult<(String, bool, String)> {
        let dtype: DType = dtype.parse().map_err(err)?;
        let comm = self.cuda()?;
        let bytes = tokens
            .checked_mul(hidden)
            .and_then(|e| e.checked_mul(dtype.size()))
            .ok_or_else(|| {
                TparError::new_err(format!("{tokens} x {hidden} elements is too many"))
            })?;
        let plan = Selection::parse_from("algorithm", algorithm)
            .and_then(|s| comm.decision_for(s, dtype, bytes as u64, capturing))
            .map_err(err)?;
        let path = comm
            .cuda()
            .fused_plan(plan.choice.algorithm(), dtype, hidden);
        Ok((
            plan.choice.name().to_owned(),
            path.fused,
            format!("allreduce: {}; {}", plan.reason, path.reason),
        ))
    }

    /// Queues the fused op on the CUDA `stream` for device addresses (semantics in
    /// `tpar::norm`): `residual_out = sum over ranks of x + residual` (`residual_out=None`: in
    /// place on `residual`), `y = rmsnorm(residual_out) * weight`; `y` may be `x`. Returns what
    /// ran, as `fused_plan`. No synchronisation; a refusal (planned for NCCL with nccl="none",
    /// a forced algorithm that cannot run) raises before anything is queued.
    #[pyo3(signature = (dtype, tokens, hidden, x, residual, residual_out, weight, y, eps, stream, capturing, algorithm=None))]
    #[allow(clippy::too_many_arguments)]
    fn fused_add_rms_norm_cuda(
        &self,
        dtype: &str,
        tokens: usize,
        hidden: usize,
        x: u64,
        residual: u64,
        residual_out: Option<u64>,
        weight: u64,
        y: u64,
        eps: f32,
        stream: usize,
        capturing: bool,
        algorithm: Option<&str>,
    ) -> PyResult<(String, bool, String)> {
        let op = fused_operands(
            dtype,
            tokens,
            hidden,
            [x, residual, weight, y],
            residual_out,
            eps,
        )?;
        op.check().map_err(TparError::new_err)?;
        let comm = self.cuda()?;
        comm.check().map_err(err)?;
        let selection = Selection::parse_from("algorithm", algorithm).map_err(err)?;
        // The library reads the stream's capture state itself; what Python saw is the same.
        let _ = capturing;
        let device = comm.cuda().context().ordinal();
        let (dtype, count) = (op.dtype, tokens * hidden);
        // SAFETY: the tpar package passes live, contiguous CUDA tensors of these shapes on
        // this communicator's device (checked above for aliasing) and the stream torch
        // orders them on; torch's caching allocator keeps their memory until work queued
        // there has run, and the stream outlives this call.
        let (spans, stream) = unsafe {
            let reads = |p: u64, n: usize| DeviceSpan::from_raw(device, p, n, dtype);
            let writes = |p: u64| DeviceSpanMut::from_raw(device, p, count, dtype);
            let input = if op.y == op.x {
                FusedInput::YIntoX(writes(op.x))
            } else {
                FusedInput::Separate {
                    x: reads(op.x, count),
                    y: writes(op.y),
                }
            };
            let residual = match op.residual_out {
                Some(out) if out != op.residual => FusedResidual::Separate {
                    residual: reads(op.residual, count),
                    out: writes(out),
                },
                _ => FusedResidual::InPlace(writes(op.residual)),
            };
            let spans = FusedSpans {
                input,
                residual,
                weight: reads(op.weight, hidden),
                tokens,
                hidden,
                eps: op.eps,
            };
            let stream = borrowed_stream(
                comm.cuda().context(),
                stream as tpar::backend::cuda::CuStream,
            );
            (spans, stream)
        };
        let run = guard("fused_add_rms_norm", || {
            comm.fused_add_rms_norm_selected(selection, spans, &stream)
                .map_err(err)
        })?;
        Ok((
            run.allreduce.choice.name().to_owned(),
            run.path.fused,
            format!("allreduce: {}; {}", run.allreduce.reason, run.path.reason),
        ))
    }

    /// The fused op on the CPU backend for host addresses (numpy arrays, torch CPU tensors):
    /// the allreduce of `x` with `algorithm` (one-shot or two-shot), then the residual add
    /// and RMSNorm of `tpar::norm`'s reference, the same bits the GPU kernels give.
    #[pyo3(signature = (dtype, tokens, hidden, x, residual, residual_out, weight, y, eps, algorithm))]
    #[allow(clippy::too_many_arguments)]
    fn fused_add_rms_norm_ptr(
        &mut self,
        py: Python<'_>,
        dtype: &str,
        tokens: usize,
        hidden: usize,
        x: u64,
        residual: u64,
        residual_out: Option<u64>,
        weight: u64,
        y: u64,
        eps: f32,
        algorithm: &str,
    ) -> PyResult<()> {
        let op = fused_operands(
            dtype,
            tokens,
            hidden,
            [x, residual, weight, y],
            residual_out,
            eps,
        )?;
        let algorithm: Algorithm = algorithm.parse().map_err(err)?;
        if !op.check().map_err(TparError::new_err)? {
            return Ok(());
        }
        let slot = self.interrupted.clone();
        let comm = self.comm()?;
        // The wait for peers happens without the GIL: other ranks may be threads of this process.
        guard("fused_add_rms_norm", || {
            // SAFETY: the tpar package passes the addresses of live, C-contiguous arrays of
            // these shapes (checked above for aliasing) that it keeps referenced for the call.
            py.detach(|| unsafe { fused::cpu(comm, &op, algorithm) })
                .map_err(|e| Self::interrupted_or(&slot, e))
        })
    }
}

impl Drop for Comm {
    /// Garbage collection without close(): kernels may still be queued on the caller's
    /// stream, so their buffers are released only after the GPU is done with them.
    fn drop(&mut self) {
        if let Some(cuda) = self.cuda.take() {
            let _ = cuda.cuda().context().synchronize();
            drop(cuda);
        }
    }
}

#[pymodule]
fn _tpar(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The `tpar` command's set-up, at import (before this process's first CUDA call through
    // tpar): NVRTC, NCCL and cuBLAS are also looked for in this interpreter's sys.path.
    let sys_path: Vec<String> = m.py().import("sys")?.getattr("path")?.extract()?;
    tpar::environment::prepare(sys_path.into_iter().map(std::path::PathBuf::from));
    m.add_function(wrap_pyfunction!(environment, m)?)?;
    m.add_class::<Comm>()?;
    m.add("TparError", m.py().get_type::<TparError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    add_harness(m)?;
    Ok(())
}

/// What this process has for CUDA, as `tpar doctor` sees it: `cuda_device_max_connections`
/// (tpar sets 32 at import unless it was set), `nvrtc` (its version, or None), `nvrtc_error`
/// (why it cannot be loaded, or None), `nvrtc_file` (the libnvrtc this process loaded) and
/// `nvrtc_search_dirs` (the folders holding NVRTC, in the order they are tried). Loads NVRTC
/// if it can be found, as the first kernel compile would.
#[pyfunction]
fn environment(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let env = tpar::environment::Environment::now();
    let dict = pyo3::types::PyDict::new(py);
    dict.set_item(
        "cuda_device_max_connections",
        env.cuda_device_max_connections,
    )?;
    dict.set_item("nvrtc", env.nvrtc.as_ref().ok())?;
    dict.set_item("nvrtc_error", env.nvrtc.as_ref().err())?;
    let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
    dict.set_item("nvrtc_file", env.nvrtc_file.as_deref().map(path))?;
    let dirs: Vec<String> = env.nvrtc_search_dirs.iter().map(|d| path(d)).collect();
    dict.set_item("nvrtc_search_dirs", dirs)?;
    Ok(dict)
}

// ---- The harness for Python: verify and tune a machine as `tpar selftest` and `tpar tune` do.

/// A harness error as a TparError: the library's own errors in the Python user's words, the
/// others with their chain of causes (`context: cause`), as the `tpar` command prints them.
fn harness_err(e: tpar_harness::HarnessError) -> PyErr {
    if let tpar_harness::HarnessError::Tpar(inner) = e {
        return err(inner);
    }
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    TparError::new_err(text)
}

/// This process's rank of the job: from `rendezvous`/`token`/`rank`/`world_size` where given,
/// else from the rank environment (TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK, WORLD_SIZE).
fn harness_rank(
    rank: Option<usize>,
    world_size: Option<usize>,
    rendezvous: Option<String>,
    token: Option<String>,
) -> PyResult<tpar_harness::ranks::Rank> {
    let env = match rendezvous {
        Some(dir) => {
            let (Some(rank), Some(world_size), Some(token)) = (rank, world_size, token) else {
                return Err(TparError::new_err(
                    "with rendezvous=..., give rank=, world_size= and token= too",
                ));
            };
            RankEnv {
                rank,
                world_size,
                local_rank: rank,
                local_world_size: world_size,
                dir: dir.into(),
                token,
            }
        }
        None => RankEnv::from_env().map_err(err)?.ok_or_else(|| {
            TparError::new_err("no rank environment: set TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK and WORLD_SIZE, or pass rendezvous=, token=, rank=, world_size=")
        })?,
    };
    let rendezvous = Rendezvous::join(env).map_err(err)?;
    Ok(tpar_harness::ranks::Rank { rendezvous })
}

fn parse_each<T: std::str::FromStr<Err = tpar::Error>>(names: Vec<String>) -> PyResult<Vec<T>> {
    names.iter().map(|n| n.parse::<T>().map_err(err)).collect()
}

fn positive_seconds(name: &str, value: f64) -> PyResult<Duration> {
    if !(value.is_finite() && value > 0.0 && value <= 86_400.0) {
        return Err(TparError::new_err(format!(
            "{name}={value}: give seconds, more than 0 and at most 86400"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

/// The numerical self-test of `tpar selftest` on this rank: every rank of the job calls it
/// together. `backend` "cpu" (shared memory) or "cuda" (this rank's GPU: local rank modulo the
/// GPUs). Returns {"backend", "world_size", "rows": [{"case", "dtype", "elements",
/// "placement", "mode", "result", "failed_ranks"}], "passed", "failed"}: a row fails when any
/// rank got a wrong bit.
#[pyfunction]
#[pyo3(signature = (backend="cpu", counts=None, dtypes=None, algorithms=None, timeout=30.0, timeout_case=true, replays=1000, rank=None, world_size=None, rendezvous=None, token=None))]
#[allow(clippy::too_many_arguments)]
fn verify<'py>(
    py: Python<'py>,
    backend: &str,
    counts: Option<Vec<usize>>,
    dtypes: Option<Vec<String>>,
    algorithms: Option<Vec<String>>,
    timeout: f64,
    timeout_case: bool,
    replays: usize,
    rank: Option<usize>,
    world_size: Option<usize>,
    rendezvous: Option<String>,
    token: Option<String>,
) -> PyResult<Bound<'py, PyDict>> {
    use tpar_harness::{cpu_selftest, cuda_ranks::CudaRanks, cuda_selftest};
    let timeout = positive_seconds("timeout", timeout)?;
    let counts = counts.unwrap_or_else(|| vec![0, 1, 7, 1023, 65541, 1_048_579]);
    let dtypes = match dtypes {
        Some(names) => parse_each::<DType>(names)?,
        None => vec![DType::F32, DType::F16, DType::Bf16],
    };
    let cuda = match backend {
        "cpu" => false,
        "cuda" => true,
        other => {
            return Err(TparError::new_err(format!(
                "backend={other:?}: give \"cpu\" or \"cuda\""
            )))
        }
    };
    let algorithms = match algorithms {
        Some(names) => parse_each::<Algorithm>(names)?,
        None if cuda => Algorithm::ALL.to_vec(),
        None => CpuCommunicator::ALGORITHMS.to_vec(),
    };
    if let Some(a) = algorithms
        .iter()
        .find(|a| !cuda && !CpuCommunicator::ALGORITHMS.contains(a))
    {
        return Err(TparError::new_err(format!(
            "algorithm {a}: the CPU backend runs one-shot and two-shot (backend=\"cuda\" runs the others)"
        )));
    }
    let me = harness_rank(rank, world_size, rendezvous, token)?;
    let world = me.world_size();
    let rows = py
        .detach(|| {
            if cuda {
                let plan = cuda_selftest::CudaSelftestSettings {
                    counts,
                    dtypes,
                    algorithms,
                    timeout,
                    timeout_case: timeout_case && world > 1,
                    replays,
                    islands: None,
                };
                cuda_selftest::run(&|c| CudaRanks::process(&me, c), &plan).map(|s| s.rows)
            } else {
                let plan = cpu_selftest::CpuSelftestSettings {
                    counts,
                    dtypes,
                    algorithms,
                    timeout,
                    timeout_case: timeout_case && world > 1,
                    islands: None,
                };
                cpu_selftest::run(&me, &plan, |_| {})
            }
        })
        .map_err(harness_err)?;
    let d = PyDict::new(py);
    d.set_item("backend", backend)?;
    d.set_item("world_size", world)?;
    let keys = ["case", "dtype", "elements", "placement", "mode"];
    let mut listed = Vec::new();
    for row in &rows {
        let r = PyDict::new(py);
        for (key, cell) in keys.iter().zip(&row.cells) {
            r.set_item(*key, cell)?;
        }
        r.set_item("result", &row.result)?;
        r.set_item("failed_ranks", row.bad)?;
        listed.push(r);
    }
    let failed = rows.iter().filter(|r| r.bad > 0).count();
    d.set_item("rows", listed)?;
    d.set_item("passed", rows.len() - failed)?;
    d.set_item("failed", failed)?;
    Ok(d)
}

/// `tpar tune` on this rank of the job (every rank calls it together, one GPU each: local rank
/// modulo the GPUs): every tpar algorithm and NCCL timed by graph replay at each of `sizes`
/// (bytes), the fastest correct choice per size written by rank 0 as the tuning table the
/// dispatcher reads on this machine. Returns {"written_to" (rank 0, else None), "crossovers",
/// "entries": [(max_bytes, choice, p50_us)], "measurements": [{"bytes", "algo", "p50_us",
/// "correct", "skipped"}]}.
#[pyfunction]
#[pyo3(signature = (sizes=None, dtype="bf16", iters=50, timeout=30.0, rank=None, world_size=None, rendezvous=None, token=None))]
#[allow(clippy::too_many_arguments)]
fn tune<'py>(
    py: Python<'py>,
    sizes: Option<Vec<u64>>,
    dtype: &str,
    iters: usize,
    timeout: f64,
    rank: Option<usize>,
    world_size: Option<usize>,
    rendezvous: Option<String>,
    token: Option<String>,
) -> PyResult<Bound<'py, PyDict>> {
    use tpar_harness::{cuda_ranks::CudaRanks, tune};
    let timeout = positive_seconds("timeout", timeout)?;
    let dtype: DType = dtype.parse().map_err(err)?;
    let sizes = sizes.unwrap_or_else(|| {
        [
            1u64, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536,
        ]
        .map(|k| k << 10)
        .to_vec()
    });
    if sizes.is_empty() || iters == 0 {
        return Err(TparError::new_err("give at least one size and iters >= 1"));
    }
    let mut pairs = Vec::new();
    for &bytes in &sizes {
        if bytes == 0 || bytes % dtype.size() as u64 != 0 {
            return Err(TparError::new_err(format!(
                "size {bytes}: give a positive whole number of {dtype} elements ({} bytes each)",
                dtype.size()
            )));
        }
        pairs.push((bytes, (bytes / dtype.size() as u64) as usize));
    }
    tpar::backend::cuda::check_available().map_err(|e| {
        TparError::new_err(format!("tune measures GPUs, and none is usable here: {e}"))
    })?;
    let topology = tpar::topology::Topology::detect().map_err(err)?;
    let me = harness_rank(rank, world_size, rendezvous, token)?;
    let plan = tune::plan(pairs, dtype, iters);
    let tuned = py
        .detach(|| {
            let config = Config {
                timeout,
                ..Config::default()
            };
            let mut group = CudaRanks::process(&me, config)?;
            tune::run(&mut group, &plan, &topology, |_, _| {})
        })
        .map_err(harness_err)?;
    let d = PyDict::new(py);
    d.set_item(
        "written_to",
        tuned.written_to.map(|p| p.display().to_string()),
    )?;
    d.set_item("crossovers", tune::crossovers(&tuned.table))?;
    let entries: Vec<(u64, String, f64)> = tuned
        .table
        .entries
        .iter()
        .map(|e| (e.max_bytes, e.choice.name().to_owned(), e.p50_us))
        .collect();
    d.set_item("entries", entries)?;
    let mut measurements = Vec::new();
    for r in &tuned.rows {
        let m = PyDict::new(py);
        m.set_item("bytes", r.bytes)?;
        m.set_item("algo", &r.algo)?;
        m.set_item("p50_us", r.skipped.is_none().then_some(r.p50_us))?;
        m.set_item("correct", r.skipped.is_none().then_some(r.correct))?;
        m.set_item("skipped", r.skipped.as_deref())?;
        measurements.push(m);
    }
    d.set_item("measurements", measurements)?;
    Ok(d)
}

fn add_harness(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(verify, m)?)?;
    m.add_function(wrap_pyfunction!(tune, m)?)?;
    Ok(())
}
