//! The `tpar._tpar` extension module: tpar's CPU communicator for Python, driven by the
//! `tpar` package (python/tpar), which checks arrays and passes their addresses. Errors arrive
//! as `tpar.TparError` with the library's own messages.

use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tpar::{Algorithm, CommConfig, CpuCommunicator, DType, RankEnv, Rendezvous};

create_exception!(
    _tpar,
    TparError,
    PyException,
    "An error reported by tpar; the message says why and what to do."
);

fn err(e: tpar::Error) -> PyErr {
    TparError::new_err(e.to_string())
}

/// One rank's CPU communicator (POSIX shared memory between the processes of one host).
#[pyclass(module = "tpar._tpar", unsendable)]
struct CpuComm {
    comm: Option<CpuCommunicator>,
}

impl CpuComm {
    fn comm(&mut self) -> PyResult<&mut CpuCommunicator> {
        self.comm
            .as_mut()
            .ok_or_else(|| TparError::new_err("the communicator is closed; create a new one"))
    }
}

#[pymethods]
impl CpuComm {
    /// Joins the job: `rank`/`world_size`/`rendezvous`/`token` as given, or, where `rendezvous`
    /// is None, from the environment (TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK, WORLD_SIZE).
    #[new]
    #[pyo3(signature = (rank=None, world_size=None, rendezvous=None, token=None, timeout=30.0, chunk_bytes=131072))]
    fn new(
        py: Python<'_>,
        rank: Option<usize>,
        world_size: Option<usize>,
        rendezvous: Option<String>,
        token: Option<String>,
        timeout: f64,
        chunk_bytes: usize,
    ) -> PyResult<CpuComm> {
        if !(timeout > 0.0 && timeout.is_finite()) {
            return Err(TparError::new_err(format!(
                "timeout must be a positive number of seconds, not {timeout}"
            )));
        }
        let env = match rendezvous {
            Some(dir) => {
                let (Some(rank), Some(world_size), Some(token)) = (rank, world_size, token) else {
                    return Err(TparError::new_err("with rendezvous=..., give rank, world_size and token too"));
                };
                RankEnv { rank, world_size, local_rank: rank, local_world_size: world_size, dir: dir.into(), token }
            }
            None => RankEnv::from_env().map_err(err)?.ok_or_else(|| {
                TparError::new_err("no rank environment: set TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK and WORLD_SIZE, or pass rendezvous=, token=, rank=, world_size=")
            })?,
        };
        if rank.is_some_and(|r| r != env.rank) || world_size.is_some_and(|w| w != env.world_size) {
            return Err(TparError::new_err(format!(
                "rank/world_size ({rank:?}/{world_size:?}) disagree with the environment ({}/{})",
                env.rank, env.world_size
            )));
        }
        let config = CommConfig {
            timeout: Duration::from_secs_f64(timeout),
            chunk_bytes,
        };
        // Waiting for peers can take a while: let other Python threads run.
        let comm =
            py.detach(|| Rendezvous::join(env).and_then(|rdv| CpuCommunicator::new(&rdv, config)));
        Ok(CpuComm {
            comm: Some(comm.map_err(err)?),
        })
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
        let bytes = count * dtype.size();
        if output == 0 || input == Some(0) {
            return Err(TparError::new_err("a null buffer address"));
        }
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
        py.detach(|| comm.all_reduce_bytes(dtype, input, output, algorithm))
            .map_err(err)
    }

    /// Bytes this rank allocated, by kind.
    fn memory_footprint<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.comm()?.memory_footprint();
        let d = PyDict::new(py);
        d.set_item("device_bytes", m.device_bytes)?;
        d.set_item("pinned_host_bytes", m.pinned_host_bytes)?;
        d.set_item("shared_host_bytes", m.shared_host_bytes)?;
        d.set_item("peer_mapped_bytes", m.peer_mapped_bytes)?;
        d.set_item("allocated_bytes", m.allocated_bytes())?;
        Ok(d)
    }

    /// Releases the shared memory; later calls raise TparError.
    fn close(&mut self) {
        self.comm = None;
    }
}

#[pymodule]
fn _tpar(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CpuComm>()?;
    m.add("TparError", m.py().get_type::<TparError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
