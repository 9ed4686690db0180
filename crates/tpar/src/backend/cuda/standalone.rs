//! Allreduce kernels launched on buffers of their own, outside a communicator: the ladder of
//! `anatomy.cu` and the one-shot bf16 kernel, for `tpar bench --anatomy`, which times each
//! piece of one call. The kernels are loaded here from the crate's own sources (so each is
//! known to take `TparArgs`), the buffers allocated and sized here, and the argument block
//! built from them: the launch is this module's one `unsafe`, and its callers need none.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::driver::{DeviceMemory, Function, MappedHostMemory, Module};
use super::kernels::{self, KernelArgs, MAX_BLOCKS, MAX_RANKS, THREADS};
use super::nvrtc;
use crate::algorithm::Algorithm;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::protocol::layout::InboxLayout;

/// A bf16 allreduce kernel of the crate's sources that takes `TparArgs`.
#[derive(Clone, Copy)]
pub struct StandaloneKernel(Function);

impl StandaloneKernel {
    /// Blocks of `threads` threads that fit on one multiprocessor at once.
    pub fn max_blocks_per_sm(&self, threads: u32) -> Result<u32> {
        self.0.max_blocks_per_sm(threads)
    }
}

/// The ladder's kernels (`tpar_anatomy_<rung>`) and the one-shot bf16 kernel, with the
/// modules that hold them.
pub struct StandaloneKernels {
    pub ladder: Vec<StandaloneKernel>,
    pub production: StandaloneKernel,
    _modules: Vec<Module>,
}

impl StandaloneKernels {
    /// Compiles (through the disk cache) and loads the kernels for `ctx`'s GPU.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<StandaloneKernels> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| Error::Cuda(format!("compute capability: {e}")))?;
        let arch = (major * 10 + minor) as u32;
        let headers = kernels::HEADERS;
        let load = |(file, source): (&str, &str)| -> Result<Module> {
            let cubin = nvrtc::cached_cubin(file, source, &headers, arch)?;
            Module::load(ctx, &cubin)
        };
        let ladder_module = load(kernels::ANATOMY_SOURCE)?;
        let (push_file, push_name) =
            kernels::kernel_for(Algorithm::OneShot, DType::Bf16).expect("one-shot has a kernel");
        let push_source = kernels::SOURCES
            .iter()
            .find(|(f, _)| *f == push_file)
            .ok_or_else(|| Error::Cuda(format!("no kernel source {push_file}")))?;
        let push_module = load(*push_source)?;
        let ladder = kernels::ANATOMY_KERNELS
            .iter()
            .map(|name| Ok(StandaloneKernel(ladder_module.function(name)?)))
            .collect::<Result<Vec<_>>>()?;
        let production = StandaloneKernel(push_module.function(&push_name)?);
        Ok(StandaloneKernels {
            ladder,
            production,
            _modules: vec![ladder_module, push_module],
        })
    }
}

/// One rank's buffers on the shared GPU.
struct RankMemory {
    inbox: DeviceMemory,
    state: DeviceMemory,
    error: MappedHostMemory,
    input: DeviceMemory,
    output: DeviceMemory,
}

/// Every rank's buffers for calls of up to `max_bytes`, all on `ctx`'s GPU (ranks as
/// streams of one process).
pub struct StandaloneRanks {
    device: usize,
    ranks: Vec<RankMemory>,
    layout: InboxLayout,
    max_bytes: usize,
}

impl StandaloneRanks {
    pub fn new(ctx: &Arc<CudaContext>, world_size: usize, max_bytes: usize) -> Result<Self> {
        if !(1..=MAX_RANKS).contains(&world_size) {
            return Err(Error::InvalidArgument(format!(
                "{world_size} ranks; give 1 to {MAX_RANKS}"
            )));
        }
        let layout = InboxLayout::new(world_size, max_bytes);
        let ranks = (0..world_size)
            .map(|_| {
                Ok(RankMemory {
                    inbox: DeviceMemory::zeroed(ctx, layout.total_bytes())?,
                    state: DeviceMemory::zeroed(ctx, 16)?,
                    error: MappedHostMemory::zeroed(ctx, 8)?,
                    input: DeviceMemory::zeroed(ctx, max_bytes)?,
                    output: DeviceMemory::zeroed(ctx, max_bytes)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(StandaloneRanks {
            device: ctx.ordinal(),
            ranks,
            layout,
            max_bytes,
        })
    }

    pub fn layout(&self) -> &InboxLayout {
        &self.layout
    }

    pub fn input(&self, rank: usize) -> &DeviceMemory {
        &self.ranks[rank].input
    }

    pub fn output(&self, rank: usize) -> &DeviceMemory {
        &self.ranks[rank].output
    }

    /// The error word rank `rank`'s kernels left (0: none).
    pub fn error_word(&self, rank: usize) -> u64 {
        self.ranks[rank].error.read_u64(0)
    }

    fn args(&self, rank: usize, bytes: usize) -> KernelArgs {
        let mut inboxes = [0u64; MAX_RANKS];
        for (slot, r) in inboxes.iter_mut().zip(&self.ranks) {
            *slot = r.inbox.ptr();
        }
        let m = &self.ranks[rank];
        KernelArgs {
            input: m.input.ptr(),
            output: m.output.ptr(),
            count: (bytes / 2) as u64,
            total_count: (bytes / 2) as u64,
            payload_lines: self.layout.payload_lines as u64,
            timeout_ns: 5_000_000_000,
            state: m.state.ptr(),
            error: m.error.device_ptr(),
            inboxes,
            recv_inboxes: [inboxes[rank]; MAX_RANKS],
            rank: rank as u32,
            world_size: self.ranks.len() as u32,
            chunk: 0,
            algo: u32::from(Algorithm::OneShot.code()),
            call_hash: kernels::call_hash(
                (bytes / 2) as u64,
                u32::from(DType::Bf16.code()),
                Algorithm::OneShot,
                0,
            ),
            flags: 0,
            islands: kernels::IslandTables::NONE,
        }
    }

    /// Queues `kernel` for rank `rank` on `stream`: an allreduce of `bytes` of bf16 from the
    /// rank's input into its output, on `grid` blocks of `block_threads` threads (a multiple
    /// of 32 up to THREADS; with programmatic dependent launch when `pdl`). Every rank must be
    /// launched alike, or the kernels wait for each other until their timeout; the caller
    /// synchronises before it drops these buffers (and drops a graph captured from this
    /// before them).
    pub fn launch(
        &self,
        kernel: StandaloneKernel,
        rank: usize,
        bytes: usize,
        (grid, block_threads): (u32, u32),
        pdl: bool,
        stream: &CudaStream,
    ) -> Result<()> {
        if rank >= self.ranks.len() || bytes > self.max_bytes || bytes % 2 != 0 {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} of {}, {bytes} bytes of bf16 (at most {}); pass a rank, and an even size, within the buffers",
                self.ranks.len(),
                self.max_bytes
            )));
        }
        if !(1..=MAX_BLOCKS).contains(&grid) {
            return Err(Error::InvalidArgument(format!(
                "a grid of {grid} blocks; give 1 to {MAX_BLOCKS}"
            )));
        }
        if block_threads == 0 || block_threads % 32 != 0 || block_threads > THREADS {
            return Err(Error::InvalidArgument(format!(
                "blocks of {block_threads} threads; give a multiple of 32 up to {THREADS}"
            )));
        }
        let on = stream.context().ordinal();
        if on != self.device {
            return Err(Error::InvalidArgument(format!(
                "the stream belongs to GPU {on} but the buffers are on GPU {}; use a stream of that GPU",
                self.device
            )));
        }
        // SAFETY: the kernel is one of the crate's own, which take TparArgs (loaded only by
        // StandaloneKernels::load); the argument block mirrors it and points into this
        // struct's buffers, sized above for `bytes`, whose inboxes were laid out for every
        // rank; `stream` is a live stream of their GPU.
        unsafe {
            kernel.0.launch_ex(
                grid,
                block_threads,
                stream.cu_stream(),
                &self.args(rank, bytes),
                pdl,
            )
        }
    }
}
