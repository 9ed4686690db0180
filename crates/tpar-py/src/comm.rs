//! `tpar._tpar.Comm`: one rank's communicators for Python, usable from any thread. Each call
//! crosses from Python once: it reads the arrays itself ([`crate::arrays`]), checks them, asks
//! the library's call path for the one decision (cached there, refusals too) and enqueues; a
//! refusal is raised as `tpar.TparRefused` from the call. Calls of one communicator are
//! ordered as they are issued, from whichever thread (the CPU backend's wait and the CUDA
//! launch each hold the communicator's lock; the CPU wait releases the GIL while it holds it).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use tpar::backend::cuda::fused::{FusedInput, FusedResidual, FusedSpans};
use tpar::backend::cuda::{borrowed_stream, DeviceSpan, DeviceSpanMut};
use tpar::communicator::{BorrowedNccl, NcclMode};
use tpar::dispatch::Choice;
use tpar::{
    Algorithm, Communicator, Config, CpuCommunicator, DType, MemoryFootprint, RankEnv, Rendezvous,
    Selection,
};

use crate::arrays::{self, Array, Library, Place};
use crate::errors::{err, guard, python_words, refused, TparError};
use crate::fused::{self, OperandChecks, Operands};

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
        chunk_bytes.filter(|c| !(Config::MIN_CHUNK_BYTES..=Config::MAX_CHUNK_BYTES).contains(c))
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

/// The rank environment from the arguments, or from the environment where `rendezvous` is None.
pub(crate) fn rank_env(
    rank: Option<usize>,
    world_size: Option<usize>,
    rendezvous: Option<String>,
    token: Option<String>,
) -> PyResult<RankEnv> {
    match rendezvous {
        Some(dir) => {
            let (Some(rank), Some(world_size), Some(token)) = (rank, world_size, token) else {
                return Err(TparError::new_err(
                    "with rendezvous=..., give rank=, world_size= and token= too",
                ));
            };
            Ok(RankEnv {
                rank,
                world_size,
                local_rank: rank,
                local_world_size: world_size,
                dir: dir.into(),
                token,
            })
        }
        None => RankEnv::from_env().map_err(err)?.ok_or_else(|| {
            TparError::new_err("no rank environment: set TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK and WORLD_SIZE, or pass rendezvous=, token=, rank=, world_size=")
        }),
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

fn closed() -> PyErr {
    TparError::new_err("the communicator is closed; create a new one")
}

/// The CPU backend's algorithm for `algorithm=` (None or `auto`: one-shot, the CPU backend's
/// choice): any of [`CpuCommunicator::ALGORITHMS`]. A name the CPU backend does not run says
/// whether it is a GPU algorithm (host-staged, nccl: they need a CUDA tensor) or no algorithm
/// at all, and lists the ones it runs.
fn cpu_algorithm(algorithm: Option<&str>) -> PyResult<Algorithm> {
    let runs = || CpuCommunicator::ALGORITHMS.map(Algorithm::name).join(", ");
    let name = algorithm.unwrap_or("auto");
    match name.parse::<Selection>() {
        Ok(Selection::Auto) => Ok(Algorithm::OneShot),
        Ok(Selection::Forced(Choice::Tpar(a))) if CpuCommunicator::ALGORITHMS.contains(&a) => Ok(a),
        Ok(Selection::Forced(gpu)) => Err(TparError::new_err(format!(
            "algorithm={name}: {gpu} runs on CUDA tensors only; numpy arrays and CPU tensors go through the CPU backend, which runs {} (or auto: one-shot)",
            runs()
        ))),
        Err(_) => Err(TparError::new_err(format!(
            "algorithm={name}: no such algorithm; numpy arrays and CPU tensors go through the CPU backend, which runs {} (or auto: one-shot)",
            runs()
        ))),
    }
}

/// A CUDA communicator's creation error where this machine has no GPU at all (no driver):
/// the same error, with the way to the CPU backend.
fn cpu_hint(e: tpar::Error) -> tpar::Error {
    match e {
        tpar::Error::Cuda(why) if !tpar::backend::cuda::driver::driver_present() => {
            tpar::Error::Cuda(format!(
            "{why}; without a GPU, device='cpu' runs the CPU backend (numpy arrays and CPU tensors)"
        ))
        }
        other => other,
    }
}

/// A forced choice's name as `last_algorithm` keeps it: its index in [`Choice::ALL`] plus one
/// (0: none yet).
fn choice_code(choice: Choice) -> u8 {
    Choice::ALL
        .iter()
        .position(|c| *c == choice)
        .map_or(0, |i| i as u8 + 1)
}

/// A creation error as a TparError (or the KeyboardInterrupt a signal raised during it), with
/// `cause_rank` and `cause`: the rank whose failure it was and its reason (another rank's,
/// where this rank stopped because a peer failed).
fn creation_error(py: Python<'_>, e: tpar::Error, rank: usize, raised: Option<PyErr>) -> PyErr {
    if let (Some(raised), tpar::Error::Interrupted { .. }) = (raised, &e) {
        return raised;
    }
    let (cause_rank, cause) = match &e {
        tpar::Error::PeerFailed { cause, reason, .. } => (*cause, reason.clone()),
        other => (rank, python_words(&other.to_string())),
    };
    let error = err(e);
    let value = error.value(py);
    let _ = value.setattr(intern!(py, "cause_rank"), cause_rank);
    let _ = value.setattr(intern!(py, "cause"), cause);
    error
}

/// Where a call writes its result.
#[derive(Clone, Copy)]
enum Target<'a, 'py> {
    /// Into the input.
    InPlace,
    /// Into the caller's `out=`.
    Out(&'a Bound<'py, PyAny>),
    /// Into a new array like the input, which the call returns.
    New,
}

/// The last fused call: its allreduce's choice, whether it ran fused, and what decided that.
#[derive(Clone, Copy)]
struct LastFused {
    choice: Choice,
    dtype: DType,
    tokens: usize,
    hidden: usize,
}

/// One rank's communicators: the CPU backend (POSIX shared memory between the processes of
/// one host) always, and tpar's CUDA communicator (with NCCL behind the same call) when the
/// rank was given a GPU.
#[pyclass(module = "tpar._tpar", frozen, weakref)]
pub(crate) struct Comm {
    /// Held while a CPU call waits for peers (without the GIL): taken only without the GIL.
    cpu: Mutex<Option<CpuCommunicator>>,
    /// Held for a CUDA call's decision and launch, never while the GIL is asked for.
    cuda: Mutex<Option<Communicator>>,
    device: Option<usize>,
    rank: usize,
    world_size: usize,
    /// The largest CUDA call `all_reduce` takes (`max_bytes=`); larger ones are refused.
    max_bytes: u64,
    warnings: Vec<String>,
    /// The KeyboardInterrupt (or other exception) a signal handler raised while a call
    /// waited for peers: the call stops and raises it.
    interrupted: Arc<Mutex<Option<PyErr>>>,
    /// What the last call ran ([`choice_code`]).
    last: AtomicU8,
    last_fused: Mutex<Option<LastFused>>,
}

impl Comm {
    /// The CPU communicator, locked; call without the GIL (a call holding it may wait for peers).
    fn cpu_locked(&self) -> MutexGuard<'_, Option<CpuCommunicator>> {
        self.cpu
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn cuda_locked(&self) -> MutexGuard<'_, Option<Communicator>> {
        self.cuda
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Why there is no CUDA communicator to use: closed, or created without a GPU.
    fn no_cuda(&self, what: &str) -> PyErr {
        if self.device.is_none() {
            refused(
                None,
                "no-gpu",
                format!("{what} but this communicator has no GPU: create it with device=<the rank's CUDA device>"),
            )
        } else {
            closed()
        }
    }

    /// The exception a signal handler raised during a wait, if that is why `e` happened.
    fn interrupted_or(&self, e: tpar::Error) -> PyErr {
        let raised = self.interrupted.lock().expect("interrupt slot").take();
        match (raised, &e) {
            (Some(py_err), tpar::Error::Interrupted { .. }) => py_err,
            _ => err(e),
        }
    }

    fn record(&self, choice: Choice) {
        self.last.store(choice_code(choice), Ordering::Relaxed);
    }

    /// The refusal of a CUDA array that this communicator cannot take here (another GPU, over
    /// `max_bytes`), or None.
    fn cuda_refusal(&self, a: &Array, device: usize, max_bytes: Option<u64>) -> Option<PyErr> {
        match self.device {
            None => Some(self.no_cuda(&format!("tensor on cuda:{device}"))),
            Some(mine) if mine != device => Some(refused(
                None,
                "device",
                format!("tensor on cuda:{device} but this communicator's GPU is cuda:{mine}; move the tensor or use that GPU's communicator"),
            )),
            Some(_) => {
                let limit = max_bytes.map_or(self.max_bytes, |m| m.min(self.max_bytes));
                (a.bytes() > limit).then(|| over_limit(a.bytes(), limit))
            }
        }
    }

    /// Where a call of the input `a` (read from `array`) writes: `(input address, None for
    /// in place; output address; the array returned)`.
    fn resolve<'py>(
        &self,
        array: &Bound<'py, PyAny>,
        a: &Array,
        target: Target<'_, 'py>,
    ) -> PyResult<(Option<u64>, u64, Bound<'py, PyAny>)> {
        Ok(match target {
            Target::InPlace => (None, a.address, array.clone()),
            Target::Out(out) => {
                let o = self.out_array(array, a, out)?;
                (Some(a.address), o.address, out.clone())
            }
            Target::New => {
                let (new, address) = arrays::empty_like(array)?;
                (Some(a.address), address, new)
            }
        })
    }

    /// A CUDA allreduce of `a` (a torch tensor on `device`) into `target`.
    fn cuda_all_reduce<'py>(
        &self,
        py: Python<'py>,
        (tensor, a, device): (&Bound<'py, PyAny>, Array, usize),
        target: Target<'_, 'py>,
        algorithm: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if let Some(refusal) = self.cuda_refusal(&a, device, None) {
            return Err(refusal);
        }
        let selection = match algorithm {
            None => Selection::Auto,
            Some(name) => Selection::parse_from("algorithm", Some(name)).map_err(err)?,
        };
        let (input, output, result) = self.resolve(tensor, &a, target)?;
        let torch = arrays::torch(py)?.expect("a torch tensor was given");
        let stream = torch.current_stream(py, device)?;
        let held = self.cuda_locked();
        let comm = held.as_ref().ok_or_else(closed)?;
        let (dtype, count) = (a.dtype, a.count);
        // SAFETY: `tensor` and `out` are live, contiguous CUDA tensors of `count` elements of
        // `dtype` on this communicator's device (read above), held by the caller for the
        // call; `stream` is torch's current stream of that device, which outlives the call.
        // torch's caching allocator keeps their memory until work queued on it has run.
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
        comm.check().map_err(err)?;
        let choice = comm
            .all_reduce_selected(selection, input, output, &stream)
            .map_err(err)?;
        drop(held);
        self.record(choice);
        Ok(result)
    }

    /// Checks `out` against the input `a` (read from `tensor`): the same library, place,
    /// dtype and shape, contiguous and writeable. Returns what was read of it.
    fn out_array(
        &self,
        tensor: &Bound<'_, PyAny>,
        a: &Array,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<Array> {
        let library = match a.library {
            Library::Torch => "a torch tensor",
            Library::Numpy => "a numpy array",
        };
        let o = match arrays::describe(out)? {
            Some(Ok(o)) if o.library == a.library => o,
            Some(Err(refusal)) => {
                return Err(TparError::new_err(format!("out: {}", refusal.message)))
            }
            _ => {
                return Err(TparError::new_err(format!(
                    "out must be {library}, like the input"
                )))
            }
        };
        if o.place != a.place {
            return Err(TparError::new_err(format!(
                "out is on {} but the input is on {}; they must be on the same device",
                arrays::device_name(o.place),
                arrays::device_name(a.place)
            )));
        }
        if o.dtype != a.dtype || !arrays::same_shape(tensor, out)? {
            return Err(TparError::new_err(format!(
                "out is {} {}, the input {} {}; they must match (same shape and dtype)",
                arrays::shape_text(out),
                o.dtype,
                arrays::shape_text(tensor),
                a.dtype
            )));
        }
        if !o.writeable {
            return Err(TparError::new_err("out is read-only"));
        }
        Ok(o)
    }

    /// The CPU backend's allreduce of the host array `a` (read from `array`) into `target`.
    fn host_all_reduce<'py>(
        &self,
        py: Python<'py>,
        (array, a): (&Bound<'py, PyAny>, Array),
        target: Target<'_, 'py>,
        algorithm: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let algorithm = cpu_algorithm(algorithm)?;
        if let Target::InPlace = target {
            if a.scalar {
                return Err(TparError::new_err(
                    "a numpy scalar cannot be reduced in place (it is immutable): pass numpy.array(x), or out= an array of its dtype",
                ));
            }
            if !a.writeable {
                return Err(TparError::new_err(
                    "array is read-only; pass out= or a writeable array",
                ));
            }
        }
        let (input, output, result) = self.resolve(array, &a, target)?;
        let bytes = a.count * a.dtype.size();
        if bytes > 0 && (output == 0 || input == Some(0)) {
            return Err(TparError::new_err("a null buffer address"));
        }
        let dtype = a.dtype;
        guard("all_reduce", || {
            py.detach(|| {
                let mut held = self.cpu_locked();
                let comm = held.as_mut().ok_or(None)?;
                // SAFETY: the arrays were read above: live, C-contiguous host memory of
                // `bytes` bytes, `output` writeable, referenced by the caller for the call.
                let (input, output) = unsafe {
                    (
                        input.map(|p| std::slice::from_raw_parts(p as *const u8, bytes)),
                        std::slice::from_raw_parts_mut(output as *mut u8, bytes),
                    )
                };
                comm.all_reduce_bytes(dtype, input, output, algorithm)
                    .map_err(Some)
            })
            .map_err(|e| e.map_or_else(closed, |e| self.interrupted_or(e)))
        })?;
        self.record(Choice::Tpar(algorithm));
        Ok(result)
    }

    /// The allreduce of `tensor` into `target`: the one entry of both kinds of array.
    /// `max_bytes` (the caller's limit, e.g. an engine's max_size) refuses larger arrays.
    fn reduce<'py>(
        &self,
        py: Python<'py>,
        tensor: &Bound<'py, PyAny>,
        target: Target<'_, 'py>,
        algorithm: Option<&str>,
        max_bytes: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let a = match arrays::describe(tensor)? {
            Some(Ok(a)) => a,
            Some(Err(refusal)) => return Err(refusal.into_err()),
            None => return Err(arrays::not_an_array(tensor)),
        };
        if let Some(limit) = max_bytes.filter(|m| a.bytes() > *m) {
            return Err(over_limit(a.bytes(), limit));
        }
        match a.place {
            Place::Cuda(device) => self.cuda_all_reduce(py, (tensor, a, device), target, algorithm),
            Place::Host => self.host_all_reduce(py, (tensor, a), target, algorithm),
        }
    }
}

/// The refusal of an array over the caller's or the communicator's `max_bytes`.
fn over_limit(bytes: u64, limit: u64) -> PyErr {
    refused(
        None,
        "max-bytes",
        format!(
            "tensor of {bytes} bytes is over the limit of {limit} bytes (max_bytes); raise max_bytes= when creating the Communicator, or reduce larger tensors with torch.distributed"
        ),
    )
}

impl Comm {
    #[allow(clippy::too_many_arguments)]
    fn create(
        py: Python<'_>,
        env: RankEnv,
        timeout: f64,
        chunk_bytes: Option<usize>,
        device: Option<usize>,
        members: Option<Vec<usize>>,
        nccl: NcclMode,
        max_bytes: u64,
    ) -> PyResult<Comm> {
        check_args(env.rank, env.world_size, timeout, chunk_bytes)?;
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
        let rank = env.rank;
        // Waiting for peers can take a while: let other Python threads run.
        let created = py.detach(|| {
            let job = Rendezvous::join(env)?.with_interrupt(check.clone());
            let rdv = match &members {
                Some(m) => job.subgroup(m)?,
                None => job,
            };
            let make = || -> tpar::Result<(CpuCommunicator, Option<Communicator>)> {
                let mut cpu = CpuCommunicator::new(&rdv, config)?;
                let cuda = device
                    .map(|d| Communicator::join_with(&rdv, d, config, nccl).map_err(cpu_hint))
                    .transpose()?;
                cpu.set_interrupt(Some(check.clone()));
                // Every rank is made (a rendezvous round, which also hears of a peer that
                // failed); then one call through the CPU backend, after which every rank has
                // read every record of this creation, so none needs to stay in the directory.
                rdv.barrier("created", config.timeout)?;
                let mut word = [0u8; 4];
                cpu.all_reduce_bytes(DType::F32, None, &mut word, Algorithm::OneShot)?;
                rdv.retire_last_round();
                Ok((cpu, cuda))
            };
            // A rank that fails tells the others at once, so that they stop waiting for it.
            make().map_err(|e| rdv.abort(e))
        });
        let (cpu, cuda) = created.map_err(|e| {
            let raised = interrupted.lock().expect("interrupt slot").take();
            creation_error(py, e, rank, raised)
        })?;
        let warnings = cuda
            .as_ref()
            .map_or_else(Vec::new, |c| c.warnings().to_vec());
        Ok(Comm {
            rank: cpu.rank(),
            world_size: cpu.world_size(),
            cpu: Mutex::new(Some(cpu)),
            cuda: Mutex::new(cuda),
            device,
            max_bytes,
            warnings,
            interrupted,
            last: AtomicU8::new(0),
            last_fused: Mutex::new(None),
        })
    }
}

#[pymethods]
impl Comm {
    /// Joins the job: `rank`/`world_size`/`rendezvous`/`token` as given, or, where `rendezvous`
    /// is None, from the environment (TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK, WORLD_SIZE).
    /// With `device` (a CUDA ordinal) the rank also gets tpar's CUDA communicator on it. A
    /// rank that fails tells its peers at once (they stop waiting and say which rank failed,
    /// and why); the TparError carries `cause_rank` and `cause`.
    #[new]
    #[pyo3(signature = (rank=None, world_size=None, rendezvous=None, token=None, timeout=30.0, chunk_bytes=None, device=None, members=None, nccl=None, max_bytes=64 << 20))]
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
        max_bytes: u64,
    ) -> PyResult<Comm> {
        guard("Communicator()", || {
            let nccl = match &nccl {
                None => NcclMode::None,
                Some(n) => nccl_mode(n)?,
            };
            let env = rank_env(rank, world_size, rendezvous, token)?;
            if rank.is_some_and(|r| r != env.rank)
                || world_size.is_some_and(|w| w != env.world_size)
            {
                return Err(TparError::new_err(format!(
                    "rank=/world_size= ({rank:?}/{world_size:?}) disagree with the environment ({}/{})",
                    env.rank, env.world_size
                )));
            }
            Self::create(
                py,
                env,
                timeout,
                chunk_bytes,
                device,
                members,
                nccl,
                max_bytes,
            )
        })
    }

    /// The CUDA ordinal of this rank's GPU, or None for a CPU-only communicator.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.device
    }

    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.world_size
    }

    #[getter]
    fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// What the last call ran: a tpar algorithm or "nccl" (None before the first call).
    #[getter]
    fn last_algorithm(&self) -> Option<&'static str> {
        match self.last.load(Ordering::Relaxed) {
            0 => None,
            code => Some(Choice::ALL[code as usize - 1].name()),
        }
    }

    /// `(fused, reason)` of the last fused CUDA call (None before one).
    #[getter]
    fn last_fused_path(&self) -> Option<(bool, String)> {
        let last = (*self.last_fused.lock().expect("last fused"))?;
        let held = self.cuda_locked();
        let path =
            held.as_ref()?
                .fused_decision(last.choice, last.dtype, last.hidden, Some(last.tokens));
        Some((path.fused, path.reason))
    }

    /// Sums `tensor` over the ranks, in place or into `out` (the same library, device, shape
    /// and dtype), and returns the array holding the result; `algorithm` forces a choice
    /// (on the CPU: any the CPU backend runs; auto or None: one-shot). A torch CUDA tensor is
    /// reduced on torch's current stream of its device, decided once and queued without
    /// synchronising; a refusal (a dtype, layout, device or size tpar does not take, or a call
    /// decided for NCCL with nccl="none") raises `TparRefused` before anything is queued.
    #[pyo3(signature = (tensor, out=None, algorithm=None))]
    fn all_reduce<'py>(
        &self,
        py: Python<'py>,
        tensor: &Bound<'py, PyAny>,
        out: Option<&Bound<'py, PyAny>>,
        algorithm: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard("all_reduce", || {
            let target = out.map_or(Target::InPlace, Target::Out);
            self.reduce(py, tensor, target, algorithm, None)
        })
    }

    /// The sum of `tensor` over the ranks in a new array like it (the input is left as it
    /// was): the engines' out-of-place call, its output made here. As [`Comm::all_reduce`]
    /// otherwise; `max_bytes` refuses larger arrays (host arrays too).
    #[pyo3(signature = (tensor, algorithm=None, max_bytes=None))]
    fn all_reduce_new<'py>(
        &self,
        py: Python<'py>,
        tensor: &Bound<'py, PyAny>,
        algorithm: Option<&str>,
        max_bytes: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        guard("all_reduce", || {
            self.reduce(py, tensor, Target::New, algorithm, max_bytes)
        })
    }

    /// `(choice, reason)`: what `all_reduce(tensor)` would run and why, with the call's own
    /// decision (the same cache, capture state read from torch's current stream); `(None,
    /// why)` where it would be refused. `max_bytes` lowers the communicator's limit.
    #[pyo3(signature = (tensor, algorithm=None, max_bytes=None))]
    fn decision(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        algorithm: Option<&str>,
        max_bytes: Option<u64>,
    ) -> PyResult<(Option<&'static str>, String)> {
        guard("decision", || {
            let a = match arrays::describe(tensor)? {
                Some(Ok(a)) => a,
                Some(Err(refusal)) => return Ok((None, refusal.message)),
                None => return Ok((None, arrays::not_an_array(tensor).value(py).to_string())),
            };
            let Place::Cuda(device) = a.place else {
                let choice = cpu_algorithm(algorithm)?;
                if max_bytes.is_some_and(|m| a.bytes() > m) {
                    return Ok((None, format!("{} bytes is over max_bytes", a.bytes())));
                }
                return Ok((
                    Some(choice.name()),
                    "the CPU backend (shared memory between the ranks' processes)".to_owned(),
                ));
            };
            if let Some(refusal) = self.cuda_refusal(&a, device, max_bytes) {
                return Ok((None, refusal.value(py).to_string()));
            }
            let selection = Selection::parse_from("algorithm", algorithm).map_err(err)?;
            let torch = arrays::torch(py)?.expect("a torch tensor was given");
            let stream = torch.current_stream(py, device)?;
            let held = self.cuda_locked();
            let comm = held.as_ref().ok_or_else(closed)?;
            // SAFETY: torch's current stream of this communicator's device, live for the call.
            let stream = unsafe {
                borrowed_stream(
                    comm.cuda().context(),
                    stream as tpar::backend::cuda::CuStream,
                )
            };
            let capturing = comm.capturing(&stream).map_err(err)?;
            let decided = comm.decide(selection, a.dtype, a.bytes(), capturing);
            Ok(match &*decided {
                Ok(d) => (Some(d.choice.name()), d.reason.clone()),
                Err(refused) => (None, python_words(&refused.to_string())),
            })
        })
    }

    /// `(choice, reason)`: what a CUDA call of `bytes` of `dtype` runs and why; `(None, why)`
    /// where such a call is refused (e.g. decided for NCCL with nccl="none": the reason names
    /// the choice). `capturing`: asked for a call inside CUDA-graph capture.
    fn decision_for_bytes(
        &self,
        dtype: &str,
        bytes: u64,
        capturing: bool,
    ) -> PyResult<(String, String)> {
        guard("decision_for_bytes", || {
            let dtype: DType = dtype.parse().map_err(err)?;
            let held = self.cuda_locked();
            let comm = held
                .as_ref()
                .ok_or_else(|| self.no_cuda("a CUDA call's decision asked"))?;
            let decided = comm.decide(Selection::Auto, dtype, bytes, capturing);
            Ok(match &*decided {
                Ok(d) => (d.choice.name().to_owned(), d.reason.clone()),
                Err(refused) => (
                    refused.choice().map_or("none", Choice::name).to_owned(),
                    format!("REFUSED here: {}", python_words(&refused.to_string())),
                ),
            })
        })
    }

    /// `(choice, fused, reason)` for a CUDA fused call of `tokens x hidden` elements of
    /// `dtype`: what its allreduce runs (as for a plain call of the same bytes), whether the
    /// fused kernel runs it or the allreduce is followed by tpar's separate norm kernel, and
    /// why; a refused allreduce says so in the reason, with `fused` False.
    #[pyo3(signature = (dtype, tokens, hidden, capturing, algorithm=None))]
    fn fused_decision(
        &self,
        dtype: &str,
        tokens: usize,
        hidden: usize,
        capturing: bool,
        algorithm: Option<&str>,
    ) -> PyResult<(String, bool, String)> {
        guard("fused_decision", || {
            let dtype: DType = dtype.parse().map_err(err)?;
            let bytes = tokens
                .checked_mul(hidden)
                .and_then(|e| e.checked_mul(dtype.size()))
                .ok_or_else(|| {
                    TparError::new_err(format!("{tokens} x {hidden} elements is too many"))
                })?;
            let selection = Selection::parse_from("algorithm", algorithm).map_err(err)?;
            let held = self.cuda_locked();
            let comm = held
                .as_ref()
                .ok_or_else(|| self.no_cuda("a CUDA fused call's decision asked"))?;
            let decided = comm.decide(selection, dtype, bytes as u64, capturing);
            Ok(match &*decided {
                Ok(d) => {
                    let path = comm.fused_decision(d.choice, dtype, hidden, Some(tokens));
                    (
                        d.choice.name().to_owned(),
                        path.fused,
                        format!("allreduce: {}; {}", d.reason, path.reason),
                    )
                }
                Err(refused) => (
                    refused.choice().map_or("none", Choice::name).to_owned(),
                    false,
                    format!("REFUSED here: {}", python_words(&refused.to_string())),
                ),
            })
        })
    }

    /// Whether `x`, `residual` and `weight` fit the fused op here: None, or `(reason, why)`
    /// (the one check of the fused operands, the same the call makes, and this communicator's
    /// device and limit; `max_bytes` lowers the limit, for host arrays too).
    #[pyo3(signature = (x, residual, weight, max_bytes=None))]
    fn fused_fit(
        &self,
        py: Python<'_>,
        x: &Bound<'_, PyAny>,
        residual: &Bound<'_, PyAny>,
        weight: &Bound<'_, PyAny>,
        max_bytes: Option<u64>,
    ) -> PyResult<Option<(String, String)>> {
        guard("fused_fit", || {
            let op = match fused::read_operands(x, residual, weight)? {
                Err(refusal) => return Ok(Some((refusal.reason.to_owned(), refusal.message))),
                Ok(op) => op,
            };
            let refusal = match op.place {
                Place::Cuda(device) => self.cuda_refusal(&op.x, device, max_bytes),
                Place::Host => max_bytes
                    .filter(|m| op.x.bytes() > *m)
                    .map(|m| over_limit(op.x.bytes(), m)),
            };
            refusal
                .map(|e| {
                    let value = e.value(py);
                    Ok((
                        value.getattr(intern!(py, "reason"))?.extract()?,
                        value.to_string(),
                    ))
                })
                .transpose()
        })
    }

    /// The fused allreduce + residual add + RMSNorm (semantics in `tpar::norm`): returns
    /// `(y, residual_out)`. `out` receives `y` (it may be `x`), else a new array; `in_place`
    /// writes `residual_out` into `residual`, else into a new array. CUDA tensors run on torch's
    /// current stream, decided as a plain call of the same bytes (`algorithm` forces one);
    /// host arrays on the CPU backend (`algorithm`: any it runs). Operands that do
    /// not fit raise `TparRefused`.
    #[pyo3(signature = (x, residual, weight, eps, out=None, in_place=true, algorithm=None))]
    #[allow(clippy::too_many_arguments)]
    fn fused_add_rms_norm<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        residual: &Bound<'py, PyAny>,
        weight: &Bound<'py, PyAny>,
        eps: f64,
        out: Option<&Bound<'py, PyAny>>,
        in_place: bool,
        algorithm: Option<&str>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        guard("fused_add_rms_norm", || {
            let op = match fused::read_operands(x, residual, weight)? {
                Ok(op) => op,
                Err(refusal) => return Err(refusal.into_err()),
            };
            if !(eps.is_finite() && eps >= 0.0) {
                return Err(TparError::new_err(format!(
                    "eps={eps}: must be finite and >= 0 (e.g. 1e-6)"
                )));
            }
            let y = match out {
                Some(out) => {
                    let o = self.out_array(x, &op.x, out)?;
                    (out.clone(), o.address)
                }
                None => arrays::empty_like(x)?,
            };
            let (residual_out, residual_out_address) = if in_place {
                if !op.residual.writeable {
                    return Err(TparError::new_err(
                        "residual is read-only; pass in_place=False or a writeable array",
                    ));
                }
                (residual.clone(), None)
            } else {
                let (new, address) = arrays::empty_like(residual)?;
                (new, Some(address))
            };
            let call = Operands {
                dtype: op.x.dtype,
                tokens: op.tokens,
                hidden: op.hidden,
                x: op.x.address,
                residual: op.residual.address,
                residual_out: residual_out_address,
                weight: op.weight.address,
                y: y.1,
                eps: eps as f32,
            };
            if !call.check().map_err(TparError::new_err)? {
                return Ok((y.0, residual_out));
            }
            match op.place {
                Place::Cuda(device) => {
                    self.fused_cuda(py, device, &op.x, &call, algorithm)?;
                }
                Place::Host => {
                    let algorithm = cpu_algorithm(algorithm)?;
                    py.detach(|| {
                        let mut held = self.cpu_locked();
                        let comm = held.as_mut().ok_or(None)?;
                        // SAFETY: the operands were read above (live, C-contiguous host arrays
                        // of these shapes, outputs writeable) and checked for aliasing; the
                        // caller holds them for the call.
                        unsafe { fused::cpu(comm, &call, algorithm) }.map_err(Some)
                    })
                    .map_err(|e| e.map_or_else(closed, |e| self.interrupted_or(e)))?;
                    self.record(Choice::Tpar(algorithm));
                }
            }
            Ok((y.0, residual_out))
        })
    }

    /// Returns once every rank has called it (through the CPU backend).
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        guard("barrier", || {
            py.detach(|| {
                let mut held = self.cpu_locked();
                let comm = held.as_mut().ok_or(None)?;
                let mut word = [0u8; 4];
                comm.all_reduce_bytes(DType::F32, None, &mut word, Algorithm::OneShot)
                    .map_err(Some)
            })
            .map_err(|e| e.map_or_else(closed, |e| self.interrupted_or(e)))
        })
    }

    /// How many NCCL communicators tpar created itself for this communicator (0 or 1).
    #[getter]
    fn own_nccl_created(&self) -> usize {
        self.cuda_locked()
            .as_ref()
            .map_or(0, Communicator::own_nccl_created)
    }

    /// What creating the CUDA communicator found that its user should hear about (paths the
    /// init self-test vetoed, a GPU time-sliced between processes); empty for the CPU backend.
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.warnings.clone()
    }

    /// Raises the error a kernel or NCCL reported since the last check, if any.
    fn check(&self) -> PyResult<()> {
        guard("check", || {
            let held = self.cuda_locked();
            let comm = held.as_ref().ok_or_else(|| self.no_cuda("check()"))?;
            comm.check().map_err(err)
        })
    }

    /// Bytes this rank allocated, by kind, summed over its backends, with each backend's
    /// own figures under "cpu" and "cuda".
    fn memory_footprint<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let cpu = py
            .detach(|| {
                self.cpu_locked()
                    .as_ref()
                    .map(CpuCommunicator::memory_footprint)
            })
            .ok_or_else(closed)?;
        let cuda = self
            .cuda_locked()
            .as_ref()
            .map(Communicator::memory_footprint);
        let sum = cuda.map_or(cpu, |g| cpu + g);
        let d = footprint_dict(py, &sum)?;
        d.set_item("cpu", footprint_dict(py, &cpu)?)?;
        if let Some(g) = cuda {
            d.set_item("cuda", footprint_dict(py, &g)?)?;
        }
        Ok(d)
    }

    /// Waits for tpar's work on the GPU, then releases every buffer; later calls raise
    /// TparError. A call in flight on another thread finishes first. (Dropping the object
    /// without close() does the same.)
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(cuda) = self.cuda_locked().take() {
                // Kernels may still be queued on the caller's stream: their buffers must
                // outlive them.
                let _ = cuda.cuda().context().synchronize();
                drop(cuda);
            }
            self.cpu_locked().take();
        });
    }
}

impl Comm {
    /// A fused CUDA call of checked operands on `device`.
    fn fused_cuda(
        &self,
        py: Python<'_>,
        device: usize,
        x: &Array,
        op: &Operands,
        algorithm: Option<&str>,
    ) -> PyResult<()> {
        if let Some(refusal) = self.cuda_refusal(x, device, None) {
            return Err(refusal);
        }
        let selection = Selection::parse_from("algorithm", algorithm).map_err(err)?;
        let torch = arrays::torch(py)?.expect("a torch tensor was given");
        let stream = torch.current_stream(py, device)?;
        let held = self.cuda_locked();
        let comm = held.as_ref().ok_or_else(closed)?;
        let (dtype, tokens, hidden) = (op.dtype, op.tokens, op.hidden);
        let count = tokens * hidden;
        // SAFETY: the operands are live, contiguous CUDA tensors of these shapes on this
        // communicator's device (read and checked for aliasing above), held by the caller for
        // the call; `stream` is torch's current stream of that device. torch's caching
        // allocator keeps their memory until work queued there has run.
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
        comm.check().map_err(err)?;
        let run = comm
            .fused_add_rms_norm_selected(selection, spans, &stream)
            .map_err(err)?;
        drop(held);
        self.record(run.allreduce);
        *self.last_fused.lock().expect("last fused") = Some(LastFused {
            choice: run.allreduce,
            dtype,
            tokens,
            hidden,
        });
        Ok(())
    }
}

impl Drop for Comm {
    /// Garbage collection without close(), on whichever thread: kernels may still be queued
    /// on the caller's stream, so their buffers are released only after the GPU is done.
    fn drop(&mut self) {
        let cuda = self
            .cuda
            .get_mut()
            .map_or_else(|p| p.into_inner().take(), Option::take);
        if let Some(cuda) = cuda {
            let _ = cuda.cuda().context().synchronize();
            drop(cuda);
        }
    }
}
