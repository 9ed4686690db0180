//! NCCL behind tpar's call, for large messages and whatever tpar has no better path for.
//! Loaded at run time, never linked: `TPAR_NCCL_LIBRARY` (a path) if set, else pip's
//! `nvidia/nccl/lib/libnccl.so.2` in any site-packages, else `libnccl.so.2` / `libnccl.so` where
//! the loader finds them. Communicators are created through tpar's rendezvous (rank 0's unique
//! id travels in a record) or, for ranks of one process, with `ncclCommInitAll`. All of NCCL's
//! FFI is in this file (a communicator lent by an engine arrives as a [`BorrowedNccl`], whose
//! unsafe constructor carries its owner's promise); its allreduce takes checked operands and a
//! cudarc stream, so calling it needs no `unsafe`.

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaStream;
use libloading::Library;

use crate::backend::cuda::span::Operands;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::rendezvous::{from_hex, to_hex, Rendezvous};

type NcclResult = c_int;
type NcclComm = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// The loaded library and the entry points tpar uses.
pub struct Nccl {
    _library: Library,
    path: PathBuf,
    version: c_int,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut NcclComm, c_int, UniqueId, c_int) -> NcclResult,
    comm_init_all: unsafe extern "C" fn(*mut NcclComm, c_int, *const c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(NcclComm) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult,
    comm_count: unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult,
    comm_user_rank: unsafe extern "C" fn(NcclComm, *mut c_int) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        NcclComm,
        *mut c_void,
    ) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

// SAFETY: NCCL's entry points are callable from any thread; the library stays loaded.
unsafe impl Send for Nccl {}
// SAFETY: as above; the table of entry points is never written after loading.
unsafe impl Sync for Nccl {}

/// Where to look for NCCL, in order.
pub fn candidates() -> Vec<PathBuf> {
    if let Ok(path) = std::env::var("TPAR_NCCL_LIBRARY") {
        return vec![path.into()];
    }
    let mut paths: Vec<PathBuf> = crate::backend::libsearch::python_site_packages()
        .into_iter()
        .map(|sp| sp.join("nvidia/nccl/lib/libnccl.so.2"))
        .filter(|p| p.exists())
        .collect();
    paths.extend([
        "libnccl.so.2".into(),
        "libnccl.so".into(),
        "/usr/lib/x86_64-linux-gnu/libnccl.so".into(),
    ]);
    paths
}

impl Nccl {
    /// The process-wide NCCL, loaded on first use; the error lists what was tried.
    pub fn load() -> Result<Arc<Nccl>> {
        static LOADED: OnceLock<std::result::Result<Arc<Nccl>, String>> = OnceLock::new();
        LOADED
            .get_or_init(|| {
                let mut tried = Vec::new();
                for path in candidates() {
                    // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
                    match unsafe { Library::new(&path) } {
                        Ok(library) => return Nccl::bind(library, path).map(Arc::new).map_err(|e| e.to_string()),
                        Err(e) => tried.push(format!("{}: {e}", path.display())),
                    }
                }
                Err(format!(
                    "NCCL cannot be loaded (tried {}); install it (pip install nvidia-nccl-cu13) or set TPAR_NCCL_LIBRARY to libnccl.so.2",
                    tried.join("; ")
                ))
            })
            .clone()
            .map_err(Error::Unsupported)
    }

    fn bind(library: Library, path: PathBuf) -> Result<Nccl> {
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has the signature of NCCL's public header (nccl.h, 2.x),
                // and the pointer is only used while `library` (moved into Nccl) is loaded.
                *unsafe { library.get($name) }.map_err(|e| {
                    Error::Unsupported(format!(
                        "{} lacks {}: {e}",
                        path.display(),
                        String::from_utf8_lossy($name)
                    ))
                })?
            };
        }
        let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!(b"ncclGetVersion");
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { get_version(&mut version) };
        Ok(Nccl {
            get_error_string: sym!(b"ncclGetErrorString"),
            get_unique_id: sym!(b"ncclGetUniqueId"),
            comm_init_rank: sym!(b"ncclCommInitRank"),
            comm_init_all: sym!(b"ncclCommInitAll"),
            comm_destroy: sym!(b"ncclCommDestroy"),
            comm_get_async_error: sym!(b"ncclCommGetAsyncError"),
            comm_count: sym!(b"ncclCommCount"),
            comm_user_rank: sym!(b"ncclCommUserRank"),
            all_reduce: sym!(b"ncclAllReduce"),
            group_start: sym!(b"ncclGroupStart"),
            group_end: sym!(b"ncclGroupEnd"),
            _library: library,
            path,
            version,
        })
    }

    /// "2.28.3" (NCCL encodes versions as major*10000 + minor*100 + patch).
    pub fn version_string(&self) -> String {
        let v = self.version;
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    fn check(&self, what: &str, result: NcclResult) -> Result<()> {
        if result == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for every result code.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(result)) }.to_string_lossy();
        Err(Error::Cuda(format!("NCCL {what}: {text} (code {result})")))
    }

    /// Runs `body` between ncclGroupStart and ncclGroupEnd: one thread issuing calls for
    /// several ranks must group them, or the first call waits for the others forever.
    pub fn group<T>(&self, body: impl FnOnce() -> Result<T>) -> Result<T> {
        // SAFETY: plain calls without arguments.
        self.check("group start", unsafe { (self.group_start)() })?;
        let result = body();
        // SAFETY: a plain call without arguments, closing the group opened above.
        self.check("group end", unsafe { (self.group_end)() })?;
        result
    }
}

/// One rank's NCCL communicator.
pub struct NcclCommunicator {
    nccl: Arc<Nccl>,
    comm: NcclComm,
    rank: usize,
    world_size: usize,
    /// tpar created it and destroys it on drop; a borrowed one stays its owner's.
    owned: bool,
}

// SAFETY: an NCCL communicator may be used from another thread as long as calls on it are not
// concurrent, which `&mut`-free use from one owner at a time guarantees here.
unsafe impl Send for NcclCommunicator {}

fn datatype(dtype: DType) -> c_int {
    match dtype {
        DType::F16 => 6,
        DType::F32 => 7,
        DType::Bf16 => 9,
    }
}

/// A raw `ncclComm_t` lent to tpar by its owner (an engine's, torch's ProcessGroupNCCL's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BorrowedNccl(*mut c_void);

impl BorrowedNccl {
    /// # Safety
    /// `comm` is a live `ncclComm_t` of the library [`Nccl::load`] returns, and outlives every
    /// communicator built with it; its owner makes no call on it concurrently with tpar's.
    pub unsafe fn new(comm: *mut c_void) -> BorrowedNccl {
        BorrowedNccl(comm)
    }
}

// SAFETY: a plain handle, used under the promise of `BorrowedNccl::new`.
unsafe impl Send for BorrowedNccl {}
// SAFETY: as above; tpar only passes the handle to NCCL.
unsafe impl Sync for BorrowedNccl {}

impl NcclCommunicator {
    /// Every rank in this process, rank r on GPU `devices[r]`. NCCL needs a GPU per rank.
    pub fn new_local_group(devices: &[usize]) -> Result<Vec<NcclCommunicator>> {
        let nccl = Nccl::load()?;
        let mut seen = HashSet::new();
        if let Some(d) = devices.iter().find(|d| !seen.insert(**d)) {
            return Err(Error::Unsupported(format!(
                "NCCL needs one GPU per rank, and {} ranks would share GPU {d}",
                devices.iter().filter(|x| *x == d).count()
            )));
        }
        let ids: Vec<c_int> = devices.iter().map(|d| *d as c_int).collect();
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: comms has room for one communicator per device in `ids`.
        nccl.check("ncclCommInitAll", unsafe {
            (nccl.comm_init_all)(comms.as_mut_ptr(), ids.len() as c_int, ids.as_ptr())
        })?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| NcclCommunicator {
                nccl: nccl.clone(),
                comm,
                rank,
                world_size: devices.len(),
                owned: true,
            })
            .collect())
    }

    /// This process's rank of the job behind `rendezvous`, on the current CUDA device (make the
    /// rank's context current first).
    pub fn new(rendezvous: &Rendezvous, timeout: std::time::Duration) -> Result<NcclCommunicator> {
        Self::new_named(rendezvous, &rendezvous.next_instance(), timeout)
    }

    /// [`NcclCommunicator::new`] with the records named by `instance` (a communicator's own
    /// name from the rendezvous, so a lazily created NCCL does not take a creation number).
    pub(crate) fn new_named(
        rendezvous: &Rendezvous,
        instance: &str,
        timeout: std::time::Duration,
    ) -> Result<NcclCommunicator> {
        let nccl = Nccl::load()?;
        let key = format!("nccl-{instance}");
        if rendezvous.rank() == 0 {
            let mut id = UniqueId { internal: [0; 128] };
            // SAFETY: fills the id.
            nccl.check("ncclGetUniqueId", unsafe { (nccl.get_unique_id)(&mut id) })?;
            rendezvous.publish(&key, &Some(to_hex(&id.internal.map(|c| c as u8))))?;
        } else {
            rendezvous.publish(&key, &None::<String>)?;
        }
        let ids: Vec<Option<String>> = rendezvous.gather(&key, timeout)?;
        let hex = ids[0]
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("rank 0 published no NCCL id".into()))?;
        let bytes = from_hex::<128>(hex)
            .ok_or_else(|| Error::InvalidArgument("malformed NCCL id from rank 0".into()))?;
        let id = UniqueId {
            internal: bytes.map(|b| b as c_char),
        };
        let mut comm = std::ptr::null_mut();
        // SAFETY: comm receives the communicator; the id is rank 0's.
        nccl.check("ncclCommInitRank", unsafe {
            (nccl.comm_init_rank)(
                &mut comm,
                rendezvous.world_size() as c_int,
                id,
                rendezvous.rank() as c_int,
            )
        })?;
        Ok(NcclCommunicator {
            nccl,
            comm,
            rank: rendezvous.rank(),
            world_size: rendezvous.world_size(),
            owned: true,
        })
    }

    /// Uses an NCCL communicator someone else created (an engine's, torch's ProcessGroupNCCL's)
    /// for tpar's NCCL calls; tpar never destroys it. It must span the same ranks in the same
    /// order (checked: its size and this rank's place in it) and come from the NCCL library
    /// tpar loads (set `TPAR_NCCL_LIBRARY` to the engine's libnccl.so.2 if they differ).
    pub fn borrow(
        borrowed: BorrowedNccl,
        rank: usize,
        world_size: usize,
    ) -> Result<NcclCommunicator> {
        let comm = borrowed.0;
        if comm.is_null() {
            return Err(Error::InvalidArgument(
                "a null NCCL communicator was given to borrow".into(),
            ));
        }
        let nccl = Nccl::load()?;
        let (mut count, mut user_rank) = (0, 0);
        // SAFETY: `BorrowedNccl::new`'s promise that `comm` is live; each call writes one int.
        nccl.check("ncclCommCount", unsafe {
            (nccl.comm_count)(comm, &mut count)
        })?;
        // SAFETY: as above; the call writes one int.
        nccl.check("ncclCommUserRank", unsafe {
            (nccl.comm_user_rank)(comm, &mut user_rank)
        })?;
        if (count as usize, user_rank as usize) != (world_size, rank) {
            return Err(Error::InvalidArgument(format!(
                "the borrowed NCCL communicator has {count} ranks with this process as rank {user_rank}, but this tpar group has {world_size} with this process as rank {rank}; borrow the communicator of the same group"
            )));
        }
        Ok(NcclCommunicator {
            nccl,
            comm,
            rank,
            world_size,
            owned: false,
        })
    }

    /// Whether tpar created this communicator (and counts and destroys it).
    pub fn is_owned(&self) -> bool {
        self.owned
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn nccl(&self) -> &Arc<Nccl> {
        &self.nccl
    }

    /// Queues an NCCL sum allreduce of checked `operands` on `stream`.
    pub(crate) fn all_reduce(&self, operands: &Operands, stream: &CudaStream) -> Result<()> {
        // SAFETY: checked operands are device memory of this rank's GPU valid for the call's
        // work; the stream is live (cudarc's type) and the communicator is ours.
        let rc = unsafe {
            (self.nccl.all_reduce)(
                operands.input() as *const c_void,
                operands.output() as *mut c_void,
                operands.count(),
                datatype(operands.dtype()),
                0,
                self.comm,
                stream.cu_stream() as *mut c_void,
            )
        };
        self.nccl.check("ncclAllReduce", rc)
    }

    /// NCCL's asynchronous error, if any.
    pub fn check(&self) -> Result<()> {
        let mut state = 0;
        // SAFETY: writes one int for a live communicator.
        self.nccl.check("ncclCommGetAsyncError", unsafe {
            (self.nccl.comm_get_async_error)(self.comm, &mut state)
        })?;
        self.nccl.check("asynchronous error", state)
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: destroys our communicator once.
            unsafe { (self.nccl.comm_destroy)(self.comm) };
        }
    }
}

/// NCCL's default simple-protocol buffer per channel and peer (`NCCL_BUFFSIZE`).
const DEFAULT_BUFFSIZE: u64 = 4 << 20;
/// Free device memory one NCCL communicator took at world size 1 (H200, NCCL 2.28; DESIGN.md):
/// its device code and fixed structures, which do not grow with peers.
const MEASURED_FIXED_BYTES: u64 = 488 << 20;

/// An estimate, before anything is allocated, of the device memory an NCCL communicator of
/// `world_size` ranks takes on each rank: the fixed part measured on one machine plus, per
/// peer and channel, the send and receive buffers of the simple, LL128 and LL protocols, from
/// `NCCL_BUFFSIZE` (default 4 MiB), `NCCL_LL128_BUFFSIZE` (about 4.6 MiB), `NCCL_LL_BUFFSIZE`
/// (256 KiB) and `NCCL_MAX_NCHANNELS` (else 2 channels per peer, NCCL's usual count over PCIe).
/// `lookup` reads the variables (the environment, or a test's map). An estimate, and called one.
pub fn estimated_footprint(world_size: usize, lookup: impl Fn(&str) -> Option<String>) -> u64 {
    let var = |name: &str, default: u64| {
        lookup(name)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(default)
    };
    let per_channel = var("NCCL_BUFFSIZE", DEFAULT_BUFFSIZE)
        + var("NCCL_LL128_BUFFSIZE", 4_718_592)
        + var("NCCL_LL_BUFFSIZE", 256 << 10);
    let channels = var("NCCL_MAX_NCHANNELS", 2).max(1);
    let peers = world_size.saturating_sub(1) as u64;
    MEASURED_FIXED_BYTES + peers * channels * 2 * per_channel
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_what_was_tried() {
        // On a machine without NCCL (CI) loading fails with the list; with NCCL it loads.
        match Nccl::load() {
            Ok(n) => assert!(n.version_string().starts_with('2')),
            Err(e) => assert!(e.to_string().contains("TPAR_NCCL_LIBRARY"), "{e}"),
        }
    }

    #[test]
    fn the_nccl_estimate_grows_with_peers_and_its_settings() {
        let none = |_: &str| None;
        assert_eq!(estimated_footprint(1, none), MEASURED_FIXED_BYTES);
        let two = estimated_footprint(2, none);
        let eight = estimated_footprint(8, none);
        assert!(two > MEASURED_FIXED_BYTES && eight > two);
        let small =
            estimated_footprint(8, |k: &str| (k == "NCCL_BUFFSIZE").then(|| "65536".into()));
        assert!(small < eight, "{small} vs {eight}");
    }

    #[test]
    fn dtypes_map_to_nccl_codes() {
        assert_eq!(datatype(DType::F32), 7);
        assert_eq!(datatype(DType::F16), 6);
        assert_eq!(datatype(DType::Bf16), 9);
    }
}
