//! The CUDA driver calls tpar makes itself, each wrapped in a safe type or function: device
//! memory, host memory mapped into the GPU (allocated, or a shared-memory segment registered),
//! IPC handles, peer access, capture state, modules and kernel launches. With `nvrtc.rs`, the
//! CUDA FFI of the backend; `unsafe` elsewhere in it is only the unsafe constructors of
//! `span.rs` (raw addresses from other libraries), the raw-address entry points of `raw.rs`
//! built on them, and the kernel launch sites (`Function::launch`: the argument block must
//! mirror the kernel's). Contexts, streams, events and graphs come from cudarc's safe API.
//!
//! cudarc panics when a library is missing, so [`driver_present`] must be asked first; every
//! entry point of the backend does.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaStream};

use crate::error::{Error, Result};
use crate::sys::SharedSegment;

/// Whether libcuda can be loaded at all (an NVIDIA driver is installed).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { sys::is_culib_present() }
}

/// The UUIDs (32 hex digits) of the GPUs this process sees, in CUDA's ordinal order: after
/// CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, which NVML ignores. No context is created.
pub fn visible_gpu_uuids() -> Result<Vec<String>> {
    if !driver_present() {
        return Err(Error::Cuda("no NVIDIA driver".into()));
    }
    let failed = |e: cudarc::driver::DriverError| Error::Cuda(format!("listing GPUs: {e}"));
    cudarc::driver::result::init().map_err(failed)?;
    let count = cudarc::driver::result::device::get_count().map_err(failed)?;
    (0..count)
        .map(|ordinal| {
            let device = cudarc::driver::result::device::get(ordinal).map_err(failed)?;
            let uuid = cudarc::driver::result::device::get_uuid(device).map_err(failed)?;
            Ok(uuid_hex(&uuid))
        })
        .collect()
}

pub(crate) fn check(what: &str, result: CUresult) -> Result<()> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda(format!("{what} failed: {result:?}")))
    }
}

/// Makes `ctx` current on this thread (every raw call below needs it).
pub fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread()
        .map_err(|e| Error::Cuda(format!("cannot make the CUDA context current: {e}")))
}

pub fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: writes one int.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

pub fn attribute(ctx: &CudaContext, attribute: sys::CUdevice_attribute) -> Result<i32> {
    ctx.attribute(attribute)
        .map_err(|e| Error::Cuda(format!("cuDeviceGetAttribute({attribute:?}): {e}")))
}

/// The device's UUID as hex, to tell which ranks share a GPU.
pub fn device_uuid(ctx: &CudaContext) -> Result<String> {
    let uuid = ctx
        .uuid()
        .map_err(|e| Error::Cuda(format!("cuDeviceGetUuid: {e}")))?;
    Ok(uuid_hex(&uuid))
}

/// 32 lowercase hex digits: the form NVML's "GPU-xxxxxxxx-xxxx-..." reduces to.
fn uuid_hex(uuid: &sys::CUuuid) -> String {
    uuid.bytes
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect()
}

/// Device memory from cuMemAlloc (not a pool: IPC needs it), zeroed, freed on drop.
pub struct DeviceMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceMemory {
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceMemory> {
        bind(ctx)?;
        let mut ptr = 0;
        // SAFETY: the context is current; ptr receives the allocation.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, bytes.max(1))
        })
        .map_err(|e| {
            Error::Cuda(format!(
                "{e} ({} of device memory)",
                crate::memory::human_bytes(bytes as u64)
            ))
        })?;
        let memory = DeviceMemory {
            ctx: ctx.clone(),
            ptr,
            bytes,
        };
        // SAFETY: ptr is ours and `bytes` long.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) })?;
        // The memset runs on the legacy stream, which the communicators' non-blocking streams
        // do not wait for: a kernel could otherwise read a freed buffer's old lines, whose
        // tags may match a new group's first epochs.
        ctx.synchronize()
            .map_err(|e| Error::Cuda(format!("synchronise after zeroing: {e}")))?;
        Ok(memory)
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The ordinal of the GPU this memory is on.
    pub fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    pub fn upload(&self, data: &[u8]) -> Result<()> {
        assert!(
            data.len() <= self.bytes,
            "upload larger than the allocation"
        );
        bind(&self.ctx)?;
        // SAFETY: copies data.len() bytes into our allocation (synchronous).
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr, data.as_ptr() as *const c_void, data.len())
        })?;
        // From pageable memory the copy may still be in flight when cuMemcpyHtoD returns, and
        // the communicators' streams do not wait for the legacy stream: finish it here.
        self.ctx
            .synchronize()
            .map_err(|e| Error::Cuda(format!("synchronise after upload: {e}")))
    }

    pub fn download(&self, out: &mut [u8]) -> Result<()> {
        assert!(
            out.len() <= self.bytes,
            "download larger than the allocation"
        );
        bind(&self.ctx)?;
        // SAFETY: copies out.len() bytes from our allocation (synchronous; waits for the
        // legacy default stream, not for other streams: callers synchronise first).
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, self.ptr, out.len())
        })
    }

    /// Fills the allocation with `byte` (to poison outputs before a check) and waits for it:
    /// the memset runs on the legacy stream, which the communicators' streams do not wait for.
    pub fn fill(&self, byte: u8) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: our allocation.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.ptr, byte, self.bytes)
        })?;
        self.ctx
            .synchronize()
            .map_err(|e| Error::Cuda(format!("synchronise after memset: {e}")))
    }

    /// A handle another process can open with [`IpcMapping::open`].
    pub fn ipc_handle(&self) -> Result<[u8; 64]> {
        bind(&self.ctx)?;
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: ptr is a cuMemAlloc allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, self.ptr)
        })?;
        Ok(handle.reserved.map(|c| c as u8))
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: frees our allocation once.
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// A peer process's device memory opened from its IPC handle; closed on drop.
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl IpcMapping {
    pub fn open(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<IpcMapping> {
        bind(ctx)?;
        let handle = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr = 0;
        // SAFETY: opens a handle exported by a peer; ptr receives the mapping.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(IpcMapping {
            ctx: ctx.clone(),
            ptr,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: closes our mapping once.
            unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// Pinned host memory mapped into every GPU (the error word lives here): the host reads it
/// without synchronising, the GPU writes it over PCIe.
pub struct MappedHostMemory {
    ctx: Arc<CudaContext>,
    host: *mut c_void,
    device: sys::CUdeviceptr,
    bytes: usize,
}

// SAFETY: the host pointer is only read and written with volatile u64 accesses.
unsafe impl Send for MappedHostMemory {}
// SAFETY: as for Send: every access to the host pointer is a volatile u64 access.
unsafe impl Sync for MappedHostMemory {}

impl MappedHostMemory {
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<MappedHostMemory> {
        bind(ctx)?;
        let mut host = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: host receives a pinned allocation of `bytes`.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut host, bytes, flags)
        })?;
        // SAFETY: host points to `bytes` writable bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut device = 0;
        // SAFETY: host is a DEVICEMAP allocation.
        let got = check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
        });
        let memory = MappedHostMemory {
            ctx: ctx.clone(),
            host,
            device,
            bytes,
        };
        got.map(|_| memory)
    }

    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn read_u64(&self, index: usize) -> u64 {
        assert!((index + 1) * 8 <= self.bytes);
        // SAFETY: in bounds; the GPU may write it concurrently, hence volatile.
        unsafe { std::ptr::read_volatile((self.host as *const u64).add(index)) }
    }

    pub fn write_u64(&self, index: usize, value: u64) {
        assert!((index + 1) * 8 <= self.bytes);
        // SAFETY: in bounds.
        unsafe { std::ptr::write_volatile((self.host as *mut u64).add(index), value) }
    }
}

impl Drop for MappedHostMemory {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: frees our allocation once.
            unsafe { sys::cuMemFreeHost(self.host) };
        }
    }
}

/// A shared-memory segment pinned and mapped into the GPU (host-staged inboxes): the
/// segment's own pages, so peers in other processes see the same bytes.
pub struct RegisteredSegment {
    ctx: Arc<CudaContext>,
    segment: SharedSegment,
    device: sys::CUdeviceptr,
}

impl RegisteredSegment {
    pub fn register(ctx: &Arc<CudaContext>, segment: SharedSegment) -> Result<RegisteredSegment> {
        bind(ctx)?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        let host = segment.as_ptr() as *mut c_void;
        // SAFETY: the mapping is page-aligned and `len_bytes` long, and outlives the
        // registration (we own the segment and unregister before dropping it).
        check("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(host, segment.len_bytes(), flags)
        })?;
        let mut device = 0;
        // SAFETY: the range was just registered with DEVICEMAP.
        let got = check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0)
        });
        let registered = RegisteredSegment {
            ctx: ctx.clone(),
            segment,
            device,
        };
        got.map(|_| registered)
    }

    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    pub fn segment(&self) -> &SharedSegment {
        &self.segment
    }

    pub fn segment_mut(&mut self) -> &mut SharedSegment {
        &mut self.segment
    }
}

impl Drop for RegisteredSegment {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: unregisters the range registered in `register`.
            unsafe { sys::cuMemHostUnregister(self.segment.as_ptr() as *mut c_void) };
        }
    }
}

/// A loaded module (CUBIN) and the functions looked up in it.
pub struct Module {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
}

/// A kernel of a loaded [`Module`].
#[derive(Clone, Copy)]
pub struct Function(sys::CUfunction);

// SAFETY: module and function handles are immutable and usable from any thread that has the
// context current; we bind before every use.
unsafe impl Send for Module {}
// SAFETY: as above; a module handle is never mutated after loading.
unsafe impl Sync for Module {}
// SAFETY: a function handle is immutable; callers bind the context before launching it.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Module {
    pub fn load(ctx: &Arc<CudaContext>, image: &[u8]) -> Result<Module> {
        bind(ctx)?;
        let mut module = std::ptr::null_mut();
        // SAFETY: the image is a CUBIN produced by NVRTC (cuModuleLoadData copies it).
        check("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void)
        })?;
        Ok(Module {
            ctx: ctx.clone(),
            module,
        })
    }

    pub fn function(&self, name: &str) -> Result<Function> {
        bind(&self.ctx)?;
        let cname = CString::new(name).expect("kernel names have no NUL");
        let mut f = std::ptr::null_mut();
        // SAFETY: looks a name up in our module.
        check(&format!("cuModuleGetFunction({name})"), unsafe {
            sys::cuModuleGetFunction(&mut f, self.module, cname.as_ptr())
        })?;
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: unloads our module once.
            unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

impl Function {
    /// Blocks of `threads` threads that fit on one multiprocessor at once.
    pub fn max_blocks_per_sm(&self, threads: u32) -> Result<u32> {
        let mut n = 0;
        // SAFETY: queries a loaded function.
        check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, self.0, threads as i32, 0)
        })?;
        Ok(n.max(0) as u32)
    }

    /// Launches the kernel with one argument, `args`, passed by value.
    ///
    /// # Safety
    /// `T` must be the `#[repr(C)]` mirror of the kernel's argument struct, and every device
    /// pointer in it valid for what the kernel does with it until the kernel completes.
    pub(crate) unsafe fn launch<T: Copy>(
        &self,
        grid: u32,
        threads: u32,
        stream: sys::CUstream,
        args: &T,
    ) -> Result<()> {
        let mut arg = *args;
        let mut params = [&mut arg as *mut T as *mut c_void];
        check(
            "cuLaunchKernel",
            sys::cuLaunchKernel(
                self.0,
                grid,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
        )
    }
}

impl Function {
    /// [`Function::launch`], optionally with programmatic dependent launch: with `pdl` the
    /// kernel may start while the previous kernel on `stream` still runs (its
    /// `griddepcontrol.wait` holds it until that kernel's memory is visible), which hides
    /// most of the launch gap between consecutive allreduces in a stream or captured graph.
    ///
    /// # Safety
    /// As for [`Function::launch`]; with `pdl` the kernel must also execute
    /// `griddepcontrol.wait` before it touches memory the previous kernel may write.
    pub(crate) unsafe fn launch_ex<T: Copy>(
        &self,
        grid: u32,
        threads: u32,
        stream: sys::CUstream,
        args: &T,
        pdl: bool,
    ) -> Result<()> {
        if !pdl {
            return self.launch(grid, threads, stream, args);
        }
        self.launch_cluster(grid, threads, 1, stream, args, pdl)
    }

    /// [`Function::launch_ex`] in thread block clusters of `cluster` consecutive blocks where
    /// above 1 (compute capability 9.0 or newer; `grid` a multiple of `cluster`), through
    /// `cuLaunchKernelEx` with PDL where `pdl`.
    ///
    /// # Safety
    /// As for [`Function::launch_ex`]; the kernel must be one written for clusters of this size.
    pub(crate) unsafe fn launch_cluster<T: Copy>(
        &self,
        grid: u32,
        threads: u32,
        cluster: u32,
        stream: sys::CUstream,
        args: &T,
        pdl: bool,
    ) -> Result<()> {
        assert!(
            cluster >= 1 && grid % cluster == 0,
            "a grid of {grid} in clusters of {cluster}"
        );
        let mut arg = *args;
        let mut params = [&mut arg as *mut T as *mut c_void];
        let mut attributes = launch_attributes(pdl, cluster);
        // The config points into `attributes`, which live to the end of this function.
        let config = launch_config(grid, threads, stream, &mut attributes);
        check(
            "cuLaunchKernelEx",
            sys::cuLaunchKernelEx(&config, self.0, params.as_mut_ptr(), std::ptr::null_mut()),
        )
    }

    /// Lets the kernel run in clusters above the portable 8 blocks (16 on H100 and H200).
    pub(crate) fn allow_non_portable_clusters(&self) -> Result<()> {
        // SAFETY: sets an attribute of a loaded function.
        check(
            "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
            unsafe {
                sys::cuFuncSetAttribute(
                    self.0,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1,
                )
            },
        )
    }

    /// How many clusters of `cluster` blocks of `threads` threads the GPU holds at once (0
    /// where that size cannot run).
    pub(crate) fn max_active_clusters(&self, threads: u32, cluster: u32) -> Result<u32> {
        let mut attributes = launch_attributes(false, cluster);
        let config = launch_config(cluster, threads, std::ptr::null_mut(), &mut attributes);
        let mut n = 0;
        // SAFETY: queries a loaded function with a config that lives across the call.
        check("cuOccupancyMaxActiveClusters", unsafe {
            sys::cuOccupancyMaxActiveClusters(&mut n, self.0, &config)
        })?;
        Ok(n.max(0) as u32)
    }
}

/// The launch attributes of [`Function::launch_cluster`]: PDL and the cluster dimension, each
/// only where asked for (the array's unused tail is not passed).
fn launch_attributes(pdl: bool, cluster: u32) -> Vec<sys::CUlaunchAttribute> {
    let mut attributes = Vec::with_capacity(2);
    if pdl {
        // SAFETY: a zeroed attribute is valid plain data; we set the fields we use.
        let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attribute.id =
            sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attribute.value.programmaticStreamSerializationAllowed = 1;
        attributes.push(attribute);
    }
    if cluster > 1 {
        // SAFETY: as above.
        let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attribute.value.clusterDim.x = cluster;
        attribute.value.clusterDim.y = 1;
        attribute.value.clusterDim.z = 1;
        attributes.push(attribute);
    }
    attributes
}

/// A 1-D launch of `grid` blocks of `threads` with `attributes`, which must outlive its use.
fn launch_config(
    grid: u32,
    threads: u32,
    stream: sys::CUstream,
    attributes: &mut [sys::CUlaunchAttribute],
) -> sys::CUlaunchConfig {
    sys::CUlaunchConfig {
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: attributes.as_mut_ptr(),
        numAttrs: attributes.len() as u32,
    }
}

/// Whether programmatic dependent launch can be used on `ctx`'s GPU: compute capability 9.0
/// or newer (the kernels' `griddepcontrol` is compiled there only), a driver that captures it
/// into graphs (CUDA 12.4 or newer), and `TPAR_PDL` not set to `0`.
pub fn pdl_supported(ctx: &CudaContext) -> bool {
    if std::env::var("TPAR_PDL").is_ok_and(|v| v == "0") {
        return false;
    }
    let major = ctx.compute_capability().map_or(0, |(major, _)| major);
    major >= 9 && driver_version().is_ok_and(|v| v >= 12040)
}

/// Queues a copy of `bytes` from `src` to `dst` (device to device) on `stream`.
pub fn copy_device_async(
    dst: &DeviceMemory,
    src: &DeviceMemory,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    assert!(bytes <= dst.bytes && bytes <= src.bytes);
    bind(&dst.ctx)?;
    // SAFETY: both ranges lie inside our allocations; the stream is live.
    check("cuMemcpyDtoDAsync", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, bytes, stream.cu_stream())
    })
}

/// Queues a copy of `bytes` from device memory into mapped pinned host memory on `stream`.
pub fn copy_to_host_async(
    dst: &MappedHostMemory,
    src: &DeviceMemory,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    assert!(bytes <= dst.bytes && bytes <= src.bytes);
    bind(&src.ctx)?;
    // SAFETY: both ranges lie inside our allocations; the stream is live.
    check("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(dst.host, src.ptr, bytes, stream.cu_stream())
    })
}

/// Queues the copy of `bytes` from device address `src` to `dst` on `stream` (what an
/// allreduce of one rank is).
///
/// # Safety
/// `src` and `dst` must be device memory of `ctx`'s GPU, `bytes` long each, that stays valid
/// until the stream's work is done (checked operands are).
pub(crate) unsafe fn copy_device_addresses_async(
    ctx: &CudaContext,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: &CudaStream,
) -> Result<()> {
    bind(ctx)?;
    // SAFETY: the caller guarantees both ranges are device memory of this GPU valid for the
    // stream's work; the stream is live.
    check("cuMemcpyDtoDAsync", unsafe {
        sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream())
    })
}

/// `stream`'s capture status and, while capturing, the id of its capture
/// (`cuStreamGetCaptureInfo_v3`: CUDA 12.3 or newer; cudarc panics on a driver without it,
/// so callers check [`driver_version`] first).
pub fn capture_info(stream: &CudaStream) -> Result<(sys::CUstreamCaptureStatus, u64)> {
    bind(stream.context())?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: a live stream (cudarc's type) of the current context; the optional outputs
    // (graph, dependencies, edges, count) are null, which the driver accepts.
    check("cuStreamGetCaptureInfo", unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream.cu_stream(),
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    })?;
    Ok((status, id))
}

/// Whether `a`'s GPU can map `b`'s memory (P2P).
pub fn can_access_peer(a: &CudaContext, b: &CudaContext) -> Result<bool> {
    let mut can = 0;
    // SAFETY: queries two valid devices (cudarc's contexts hold them); writes one int.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device())
    })?;
    Ok(can != 0)
}

/// Lets kernels of `from`'s context access `to`'s memory; already enabled counts as done.
pub fn enable_peer_access(from: &CudaContext, to: &CudaContext) -> Result<()> {
    bind(from)?;
    // SAFETY: enables access from the current context (`from`) to a live context.
    let rc = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
    if rc == CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    check("cuCtxEnablePeerAccess", rc)
}
