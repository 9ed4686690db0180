//! cuBLAS for `tpar bench step`, through cudarc and loaded at run time like the rest of CUDA:
//! one handle per rank bound to the rank's stream, and the one GEMM the step needs (bf16 in
//! and out, fp32 accumulation). The driver level of the harness's cuBLAS use: every cuBLAS
//! call and its `unsafe` is here, each with its `# Safety` or `SAFETY` note, under the safe
//! [`Blas::gemm`] (which checks its buffers' sizes and GPU) that the step bench calls.

use std::ffi::c_void;
use std::sync::Arc;

use super::{bail, Context, HarnessError, Result};
use cudarc::cublas::{result, sys};
use cudarc::driver::CudaStream;
use tpar::backend::cuda::driver::DeviceMemory;

/// Loads cuBLAS: from the loader's path, else from a CUDA toolkit or pip's
/// `nvidia-cublas` wheel (libcublasLt first: libcublas needs it beside it).
pub fn load() -> Result<()> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    let mut dirs = tpar::backend::libsearch::cuda_toolkit_lib_dirs();
    for sp in tpar::backend::libsearch::python_site_packages() {
        dirs.push(sp.join("nvidia/cu13/lib"));
        dirs.push(sp.join("nvidia/cublas/lib"));
    }
    let dirs = tpar::backend::libsearch::dirs_holding(dirs, &["libcublas.so.13"]);
    if let Some(dir) = dirs.first() {
        let one = std::slice::from_ref(dir);
        tpar::backend::libsearch::preload(one, &["libcublasLt.so.13"]);
        tpar::backend::libsearch::preload(one, &["libcublas.so.13"]);
    }
    // SAFETY: as above.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    bail!("cuBLAS (libcublas.so.13) cannot be loaded: install a CUDA 13 toolkit or `pip install nvidia-cublas`, or put its folder on LD_LIBRARY_PATH")
}

/// One cuBLAS handle whose work goes to one stream.
pub struct Blas {
    handle: sys::cublasHandle_t,
    _stream: Arc<CudaStream>,
    /// cuBLAS's scratch, given up front: it cannot allocate while a graph is being captured.
    _workspace: DeviceMemory,
}

const WORKSPACE_BYTES: usize = 32 << 20;

impl Blas {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
        load()?;
        stream.context().bind_to_thread()?;
        let handle = result::create_handle().context("cublasCreate failed")?;
        let blas = Blas {
            handle,
            _stream: stream.clone(),
            _workspace: DeviceMemory::zeroed(stream.context(), WORKSPACE_BYTES)?,
        };
        // SAFETY: a handle just created and a live stream of the current context.
        unsafe { result::set_stream(handle, stream.cu_stream() as sys::cudaStream_t) }
            .context("cublasSetStream failed")?;
        // SAFETY: the workspace lives as long as the handle (both in `blas`).
        let status = unsafe {
            sys::cublasSetWorkspace_v2(
                handle,
                blas._workspace.ptr() as *mut c_void,
                WORKSPACE_BYTES,
            )
        };
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            bail!("cublasSetWorkspace failed: {status:?}");
        }
        Ok(blas)
    }

    /// Queues `C[rows, m] (+)= A[rows, k] x W[k, m]` for row-major bf16 matrices with row
    /// lengths `a_row` (>= k) and m, on this handle's stream: the buffers' sizes are checked
    /// against what cuBLAS reads and writes, and the borrows keep `c` from being `a` or `w`.
    /// As with any queued work, the caller synchronises before it drops the buffers (and drops
    /// a graph captured from this before them).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        rows: u64,
        k: u64,
        m: u64,
        w: &DeviceMemory,
        a: &DeviceMemory,
        a_row: u64,
        c: &mut DeviceMemory,
        accumulate: bool,
    ) -> Result<()> {
        let [w_elements, a_elements, c_elements] = gemm_footprint(rows, k, m, a_row);
        let device = self._stream.context().ordinal();
        for (name, memory, elements) in [
            ("W", w, w_elements),
            ("A", a, a_elements),
            ("C", &*c, c_elements),
        ] {
            if memory.device() != device {
                bail!(
                    "GEMM operand {name} is on GPU {} but the cuBLAS handle on GPU {device}",
                    memory.device()
                );
            }
            if elements * 2 > memory.bytes() as u64 {
                bail!(
                    "GEMM operand {name} needs {elements} bf16 elements but holds {} bytes",
                    memory.bytes()
                );
            }
        }
        if a_row < k {
            bail!("GEMM input row of {a_row} elements is shorter than k = {k}");
        }
        // SAFETY: the sizes and the GPU are checked above; the borrows keep the buffers
        // allocated while this queues, and the caller's synchronisation covers the rest.
        unsafe { self.gemm_bf16(rows, k, m, w.ptr(), a.ptr(), a_row, c.ptr(), accumulate) }
    }

    /// [`Blas::gemm`] on raw addresses.
    ///
    /// # Safety
    /// `w`, `a` and `c` must be device addresses of this handle's context holding at least
    /// k*m, rows*a_row and rows*m bf16 elements, alive until the queued work has run.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_bf16(
        &self,
        rows: u64,
        k: u64,
        m: u64,
        w: u64,
        a: u64,
        a_row: u64,
        c: u64,
        accumulate: bool,
    ) -> Result<()> {
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let int = |v: u64| {
            i32::try_from(v)
                .map_err(|e| HarnessError::Failed(format!("a GEMM dimension over 2^31: {e}")))
        };
        let bf16 = sys::cudaDataType::CUDA_R_16BF;
        // SAFETY: the caller's promise about the buffers; alpha and beta live on this frame,
        // which cuBLAS reads before returning (host pointer mode).
        unsafe {
            result::gemm_ex(
                self.handle,
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_N,
                int(m)?,
                int(rows)?,
                int(k)?,
                (&alpha as *const f32).cast::<c_void>(),
                w as *const c_void,
                bf16,
                int(m)?,
                a as *const c_void,
                bf16,
                int(a_row)?,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                bf16,
                int(m)?,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .context("cublasGemmEx failed")
    }
}

/// The bf16 elements [`Blas::gemm`] reads of W and A and writes of C: the last row of the
/// strided A needs only its own k columns.
pub fn gemm_footprint(rows: u64, k: u64, m: u64, a_row: u64) -> [u64; 3] {
    let a = if rows == 0 || k == 0 {
        0
    } else {
        (rows - 1) * a_row + k
    };
    [k * m, a, rows * m]
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and used no more.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
