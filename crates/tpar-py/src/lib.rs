//! The `tpar._tpar` extension module: one rank's communicators for Python (the CPU backend for
//! host arrays and, on a GPU, tpar's dispatched CUDA allreduce), driven by the `tpar` package
//! (python/tpar). A call crosses from Python once with the arrays themselves: the module reads
//! them (`arrays`), checks them and runs the library's one call path (`comm`). Errors
//! arrive as `tpar.TparError` with the library's own messages (a refusal as its subclass
//! `tpar.TparRefused`), never as a panic.

use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;

mod arrays;
mod comm;
mod errors;
mod fused;

use comm::Comm;
use errors::{err, TparError, TparRefused};

use tpar::{Algorithm, Config, CpuCommunicator, DType, Rendezvous};

#[pymodule]
fn _tpar(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The `tpar` command's set-up, at import (before this process's first CUDA call through
    // tpar): NVRTC, NCCL and cuBLAS are also looked for in this interpreter's sys.path.
    let sys_path: Vec<String> = m.py().import("sys")?.getattr("path")?.extract()?;
    tpar::environment::prepare(sys_path.into_iter().map(std::path::PathBuf::from));
    m.add_function(wrap_pyfunction!(environment, m)?)?;
    m.add_class::<Comm>()?;
    m.add("TparError", m.py().get_type::<TparError>())?;
    m.add("TparRefused", m.py().get_type::<TparRefused>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // The most ranks one communicator serves (the kernels' bound), for the argument checks.
    m.add("MAX_RANKS", tpar::algorithm::MAX_RANKS)?;
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
    let env = comm::rank_env(rank, world_size, rendezvous, token)?;
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
            "algorithm {a}: the CPU backend runs {} (backend=\"cuda\" runs the others)",
            CpuCommunicator::ALGORITHMS.map(Algorithm::name).join(", ")
        )));
    }
    let me = harness_rank(rank, world_size, rendezvous, token)?;
    let world = me.world_size();
    let rows = py
        .detach(|| {
            if cuda {
                let settings = cuda_selftest::CudaSelftestSettings {
                    counts,
                    dtypes,
                    algorithms,
                    timeout,
                    timeout_case: timeout_case && world > 1,
                    replays,
                    islands: None,
                };
                cuda_selftest::run(&|c| CudaRanks::process(&me, c), &settings).map(|s| s.rows)
            } else {
                let settings = cpu_selftest::CpuSelftestSettings {
                    counts,
                    dtypes,
                    algorithms,
                    timeout,
                    timeout_case: timeout_case && world > 1,
                    islands: None,
                };
                cpu_selftest::run(&me, &settings, |_| {})
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
    let settings = tune::settings(pairs, dtype, iters);
    let tuned = py
        .detach(|| {
            let config = Config {
                timeout,
                ..Config::default()
            };
            let mut group = CudaRanks::process(&me, config)?;
            tune::run(&mut group, &settings, &topology, |_, _| {})
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
