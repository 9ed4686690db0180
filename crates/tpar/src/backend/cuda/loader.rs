//! Loading tpar's kernels into a GPU's primary context: each kernel file compiled by NVRTC
//! (or read from the disk cache) for the device's architecture, loaded once per process and
//! GPU, every function looked up once by its [`KernelId`], with what loading took from free device memory and how
//! many blocks of the most demanding kernel fit on one SM (the co-residency bound's input).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::CudaContext;

use super::driver::{self, Function, Module};
use super::kernels::{self, KernelId, THREADS};
use super::nvrtc;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The kernels loaded into one device's primary context.
pub(crate) struct KernelSet {
    pub(super) _modules: Vec<Module>,
    /// Every kernel, looked up once at load, at its [`KernelId::index`].
    pub(super) functions: [Function; KernelId::COUNT],
    /// Blocks of `THREADS` threads of the most demanding kernel that fit on one SM.
    pub(super) blocks_per_sm: u32,
    pub(super) sm_count: u32,
    /// Drop in free device memory measured around loading the modules (code, constants,
    /// local-memory reservation): what the kernels cost this GPU's context, once per process.
    pub(super) module_bytes: u64,
    /// Launch with programmatic dependent launch ([`driver::pdl_supported`]).
    pub(super) pdl: bool,
    /// Clusters of the fused cluster kernels the GPU holds at once, by block size and cluster
    /// size ([`KernelSet::active_clusters`]); all 0 below compute capability 9.0.
    active_clusters: [[u32; MAX_CLUSTER as usize + 1]; CLUSTER_BLOCK_THREADS.len()],
}

/// The largest thread block cluster tpar launches: H100's and H200's non-portable limit (8 is
/// portable to every GPU with clusters; a larger size the GPU cannot run counts 0 clusters).
pub(super) const MAX_CLUSTER: u32 = 16;
/// The block sizes the fused cluster kernels run with (fused.rs, `fused_block_threads`).
const CLUSTER_BLOCK_THREADS: [u32; 3] = [128, 256, THREADS];

/// Free device memory of the current context's GPU, or None where the driver cannot say.
fn free_device_memory(ctx: &Arc<CudaContext>) -> Option<u64> {
    ctx.bind_to_thread().ok()?;
    cudarc::driver::result::mem_get_info()
        .ok()
        .map(|(free, _)| free as u64)
}

/// Runs `work` and returns what it returned with the drop in `ctx`'s GPU's free memory around
/// it (0 where the driver cannot say): how tpar measures what loading kernels and NCCL take.
pub(crate) fn free_memory_taken_by<T>(
    ctx: &Arc<CudaContext>,
    work: impl FnOnce() -> T,
) -> (T, u64) {
    let before = free_device_memory(ctx);
    let value = work();
    let taken = match (before, free_device_memory(ctx)) {
        (Some(before), Some(after)) => before.saturating_sub(after),
        _ => 0,
    };
    (value, taken)
}

impl KernelSet {
    pub(crate) fn get(&self, kernel: KernelId) -> Function {
        self.functions[kernel.index()]
    }

    /// How many clusters of `cluster` blocks of `threads` threads of a fused cluster kernel
    /// the GPU holds at once: 0 where it has no clusters, or not of that shape.
    pub(crate) fn active_clusters(&self, threads: u32, cluster: u32) -> u32 {
        let Some(row) = CLUSTER_BLOCK_THREADS.iter().position(|&t| t == threads) else {
            return 0;
        };
        self.active_clusters[row]
            .get(cluster as usize)
            .copied()
            .unwrap_or(0)
    }
}

/// [`KernelSet::active_clusters`]' table, with every cluster kernel allowed clusters above 8
/// where the driver lets it. The small-block kernel is asked for its block sizes and the
/// whole-block one for [`THREADS`] (one dtype's for all: they take the same resources).
fn active_clusters_of(
    functions: &[Function],
    major: i32,
) -> [[u32; MAX_CLUSTER as usize + 1]; CLUSTER_BLOCK_THREADS.len()] {
    let mut table = [[0; MAX_CLUSTER as usize + 1]; CLUSTER_BLOCK_THREADS.len()];
    if major < 9 {
        return table;
    }
    let clustered = KernelId::ALL.into_iter().filter_map(KernelId::in_clusters);
    // Where the driver refuses sizes above 8, those stay 0 and the portable ones are asked.
    let non_portable = clustered
        .map(|kernel| functions[kernel.index()].allow_non_portable_clusters())
        .all(|set| set.is_ok());
    for (row, &threads) in CLUSTER_BLOCK_THREADS.iter().enumerate() {
        let kernel = if threads < THREADS {
            KernelId::FusedOneShotSmallClusters(DType::Bf16)
        } else {
            KernelId::FusedOneShotClusters(DType::Bf16)
        };
        for cluster in 2..=MAX_CLUSTER {
            if cluster > 8 && !non_portable {
                break;
            }
            // A size the GPU cannot run is an error from the query: it counts 0.
            table[row][cluster as usize] = functions[kernel.index()]
                .max_active_clusters(threads, cluster)
                .unwrap_or(0);
        }
    }
    table
}

pub(crate) fn kernel_set(ctx: &Arc<CudaContext>) -> Result<Arc<KernelSet>> {
    static LOADED: OnceLock<Mutex<HashMap<usize, Arc<KernelSet>>>> = OnceLock::new();
    let mut loaded = LOADED
        .get_or_init(Default::default)
        .lock()
        .expect("kernel cache lock");
    if let Some(set) = loaded.get(&ctx.ordinal()) {
        return Ok(set.clone());
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| Error::Cuda(format!("cannot read the compute capability: {e}")))?;
    if major < 8 {
        return Err(Error::Unsupported(format!(
            "GPU {} has compute capability {major}.{minor}; tpar's kernels need 8.0 (Ampere) or newer",
            ctx.ordinal()
        )));
    }
    let arch = (major * 10 + minor) as u32;
    // Compiled (or read from the disk cache) before measuring: only the load takes GPU memory.
    let cubins = nvrtc::cached_cubins(&kernels::SOURCES, &kernels::HEADERS, arch)?;
    // The window holds the function lookups too. On one H200 (2026-12-01) it measured 2.0 MiB
    // with them inside and 0 with the module loads alone: with lazy module loading, the
    // driver's default, a kernel's code likely reaches the GPU when its function is fetched.
    let (loaded_modules, module_bytes) = free_memory_taken_by(ctx, || -> Result<_> {
        let modules = cubins
            .iter()
            .map(|cubin| Module::load(ctx, cubin))
            .collect::<Result<Vec<_>>>()?;
        let mut blocks_per_sm = u32::MAX;
        let mut functions = Vec::with_capacity(KernelId::COUNT);
        for kernel in KernelId::ALL {
            let file = kernels::SOURCES
                .iter()
                .position(|(file, _)| *file == kernel.file())
                .ok_or_else(|| {
                    Error::Cuda(format!(
                        "{kernel:?} is defined in {}, which is not among the kernel sources",
                        kernel.file()
                    ))
                })?;
            let f = modules[file].function(kernel.name())?;
            if kernel.spins() {
                blocks_per_sm = blocks_per_sm.min(f.max_blocks_per_sm(THREADS)?);
            }
            functions.push(f);
        }
        let functions: [Function; KernelId::COUNT] = functions
            .try_into()
            .unwrap_or_else(|_| unreachable!("one function per key"));
        Ok((modules, functions, blocks_per_sm))
    });
    let (modules, functions, blocks_per_sm) = loaded_modules?;
    let sm_count = driver::attribute(
        ctx,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )? as u32;
    let active_clusters = active_clusters_of(&functions, major);
    let set = Arc::new(KernelSet {
        _modules: modules,
        functions,
        active_clusters,
        blocks_per_sm,
        sm_count,
        module_bytes,
        pdl: driver::pdl_supported(ctx),
    });
    loaded.insert(ctx.ordinal(), set.clone());
    Ok(set)
}
