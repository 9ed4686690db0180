//! The libc FFI of tpar (POSIX shared memory, file locks, process liveness and the parent-death
//! signal), wrapped in safe types: everything above it works with `&[AtomicU64]` and `Result`.
//! The other FFI modules are `backend::cuda::{driver, nvrtc}` (CUDA), `backend::nccl` (NCCL)
//! and `backend::libsearch` (loading a library by path).

use std::ffi::CString;
use std::io;
use std::process::Command;
use std::sync::atomic::AtomicU64;

use crate::error::{Error, Result};

/// A mapped POSIX shared-memory segment of whole 8-byte lines, created by this process
/// (and unlinked by it) or opened from a peer. The mapping lives until drop.
pub struct SharedSegment {
    name: String,
    ptr: *mut libc::c_void,
    len: usize,
    /// This process created the name and must unlink it (once).
    owns_name: bool,
}

// SAFETY: the mapping is only ever accessed through `&[AtomicU64]`, which is Sync.
unsafe impl Send for SharedSegment {}
// SAFETY: as above: shared access goes through `&[AtomicU64]` only.
unsafe impl Sync for SharedSegment {}

impl SharedSegment {
    /// Creates a new segment of `len` bytes, mode 0600, fully backed by memory now (so a full
    /// /dev/shm is an error here, not a SIGBUS later), zero-filled and mapped.
    pub fn create(name: &str, len: usize) -> Result<SharedSegment> {
        let cname = c_name(name)?;
        // SAFETY: cname is a valid NUL-terminated string.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600 as libc::mode_t,
            )
        };
        if fd < 0 {
            return Err(shm_error(name, "create", io::Error::last_os_error(), ""));
        }
        let mut segment = SharedSegment {
            name: name.to_owned(),
            ptr: std::ptr::null_mut(),
            len,
            owns_name: true,
        };
        // From here on, dropping `segment` unlinks the name.
        // SAFETY: fd is an open descriptor we own.
        let rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        if rc != 0 {
            let err = io::Error::from_raw_os_error(rc);
            // SAFETY: fd is open.
            unsafe { libc::close(fd) };
            let hint = if rc == libc::ENOSPC {
                format!(
                    " (needs {} of /dev/shm; enlarge it, e.g. docker --shm-size, or lower the chunk size)",
                    crate::memory::human_bytes(len as u64)
                )
            } else {
                String::new()
            };
            return Err(shm_error(name, "reserve memory for", err, &hint));
        }
        let mapped = map(fd, len);
        // SAFETY: fd is open; the mapping (if any) stays valid after close. Keeping it open
        // would leak one descriptor per communicator.
        unsafe { libc::close(fd) };
        segment.ptr = mapped.map_err(|e| shm_error(name, "map", e, ""))?;
        Ok(segment)
    }

    /// Opens and maps a peer's segment. Refuses one that is not private to this user.
    pub fn open(name: &str) -> Result<SharedSegment> {
        let cname = c_name(name)?;
        // SAFETY: cname is a valid NUL-terminated string.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(shm_error(name, "open", io::Error::last_os_error(), ""));
        }
        // SAFETY: `stat` is plain data; fstat fills it for the open fd.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and `st` is a valid, writable stat struct.
        let rc = unsafe { libc::fstat(fd, &mut st) };
        let checked = if rc != 0 {
            Err(shm_error(name, "stat", io::Error::last_os_error(), ""))
        } else if st.st_uid != effective_uid() || st.st_mode & 0o077 != 0 {
            Err(Error::ForeignJob {
                what: format!(
                    "shared memory {name} (owner uid {}, mode {:o})",
                    st.st_uid,
                    st.st_mode & 0o777
                ),
            })
        } else {
            map(fd, st.st_size as usize).map_err(|e| shm_error(name, "map", e, ""))
        };
        // SAFETY: fd is open; the mapping (if any) stays valid after close.
        unsafe { libc::close(fd) };
        Ok(SharedSegment {
            name: name.to_owned(),
            ptr: checked?,
            len: st.st_size as usize,
            owns_name: false,
        })
    }

    /// Removes the name so nothing is left in /dev/shm; mappings stay valid.
    pub fn unlink(&mut self) {
        if std::mem::take(&mut self.owns_name) {
            if let Ok(cname) = c_name(&self.name) {
                // SAFETY: valid C string; failure (already gone) is harmless.
                unsafe { libc::shm_unlink(cname.as_ptr()) };
            }
        }
    }

    pub fn lines(&self) -> &[AtomicU64] {
        // SAFETY: the mapping is page-aligned, `len` bytes long and lives as long as `self`;
        // AtomicU64 has the size and alignment of u64 and tolerates concurrent writers.
        unsafe { std::slice::from_raw_parts(self.ptr as *const AtomicU64, self.len / 8) }
    }

    /// The 8-byte word at byte `offset` (a multiple of 8): a flag.
    pub fn word(&self, offset: usize) -> &AtomicU64 {
        debug_assert_eq!(offset % 8, 0);
        &self.lines()[offset / 8]
    }

    /// Bytes `range` of the mapping. Panics when the range is not inside it.
    ///
    /// Other processes write this memory while it is mapped. What keeps them apart from these
    /// reads is the callers' protocol: a writer stores a range, then a flag with release
    /// ordering; a reader loads the flag with acquire ordering before it reads, and no writer
    /// touches the range again until the readers have said they are done (the CPU backend's
    /// epochs). A peer that breaks the protocol can make this process read wrong numbers; it
    /// cannot make it read outside the mapping. Within this process the borrow rules hold as
    /// usual: writes go through `&mut self`.
    pub fn bytes(&self, range: std::ops::Range<usize>) -> &[u8] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range outside the segment"
        );
        // SAFETY: the range is inside the live mapping (checked above); the mapping lives as
        // long as `self`; writers in this process need `&mut self`, and other processes keep
        // off the range by the protocol described above.
        unsafe { std::slice::from_raw_parts((self.ptr as *const u8).add(range.start), range.len()) }
    }

    /// Bytes `range` of the mapping, writable (the protocol of [`SharedSegment::bytes`] keeps
    /// other processes' readers off the range while it is written).
    pub fn bytes_mut(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range outside the segment"
        );
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference into the mapping
        // in this process while it lives.
        unsafe {
            std::slice::from_raw_parts_mut((self.ptr as *mut u8).add(range.start), range.len())
        }
    }

    /// Copies `data` into the mapping at byte `offset`.
    pub fn write(&mut self, offset: usize, data: &[u8]) {
        self.bytes_mut(offset..offset + data.len())
            .copy_from_slice(data);
    }

    /// Start of the mapping, for registering it with the GPU driver.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }

    /// The segment's name in /dev/shm (as `open` takes it).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len_bytes(&self) -> usize {
        self.len
    }
}

impl Drop for SharedSegment {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: ptr/len describe a mapping this value created and nobody else unmaps.
            unsafe { libc::munmap(self.ptr, self.len) };
        }
        self.unlink();
    }
}

fn c_name(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| Error::InvalidArgument(format!("shm name {name:?} has a NUL")))
}

fn shm_error(name: &str, what: &'static str, source: io::Error, hint: &str) -> Error {
    Error::SharedMemory {
        name: name.to_owned(),
        what,
        source,
        hint: hint.to_owned(),
    }
}

fn map(fd: libc::c_int, len: usize) -> io::Result<*mut libc::c_void> {
    // SAFETY: a fresh shared mapping of an open fd; the kernel validates len.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(ptr)
    }
}

/// Blocks until this process holds an exclusive advisory lock (flock) on `file`; released when
/// the file is closed.
pub fn lock_exclusive(file: &std::fs::File) -> io::Result<()> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: flock on a descriptor `file` keeps open for the duration of the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The CPU this thread runs on now (it may move at any time), where the OS says.
pub fn current_cpu() -> Option<usize> {
    // SAFETY: sched_getcpu takes no arguments and only reads the calling thread's state.
    let cpu = unsafe { libc::sched_getcpu() };
    usize::try_from(cpu).ok()
}

/// The CPUs this process may run on (its affinity mask, so a container's cpuset counts), in
/// ascending order; empty where the mask cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; zeroed is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this thread; the size is the set's own.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: cpu < CPU_SETSIZE, inside the set.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

/// Keeps the calling thread on `cpus` from now on (one CPU: and with it the memory it
/// allocates first, on that CPU's NUMA node).
pub fn set_allowed_cpus(cpus: &[usize]) -> io::Result<()> {
    if cpus.is_empty() || cpus.iter().any(|&c| c >= libc::CPU_SETSIZE as usize) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    // SAFETY: cpu_set_t is plain data; zeroed is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: cpu < CPU_SETSIZE (checked above); the set is ours.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: pid 0 is this thread; the size is the set's own.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

pub fn effective_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// What can be told about a process from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// Exited, killed, or a zombie waiting for its parent to reap it.
    Gone,
}

pub fn liveness(pid: u32) -> Liveness {
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return Liveness::Gone;
    }
    // A zombie still answers kill(0): look at its state.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => match stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim().chars().next())
        {
            Some('Z') | Some('X') => Liveness::Gone,
            _ => Liveness::Alive,
        },
        Err(_) => Liveness::Alive,
    }
}

/// Makes the child started by `command` receive SIGKILL when this process dies, so a launcher
/// that crashes leaves no ranks behind. The signal is armed in the child before anything else
/// (between fork and exec); a parent that died before that moment is caught by comparing the
/// child's parent with the launcher's pid, and the child exits at once.
pub fn kill_child_with_parent(command: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: getpid cannot fail.
    let launcher = unsafe { libc::getpid() };
    // SAFETY: prctl, getppid and _exit are async-signal-safe, which is all pre_exec requires.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// The signal (SIGINT, SIGTERM or SIGHUP) that asked this process to stop, 0 for none.
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn note_stop_signal(sig: libc::c_int) {
    // An atomic store is async-signal-safe; the launcher's wait loop acts on it.
    STOP_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
}

/// From now on SIGINT, SIGTERM and SIGHUP only set a flag ([`stop_signal`]) instead of killing
/// this process, so a launcher can stop its ranks and clean up first. Children get the default
/// actions back at exec.
pub fn catch_stop_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction with a handler that only stores to an atomic; sigaction
        // copies the struct.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = note_stop_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// The stop signal received since [`catch_stop_signals`], if any.
pub fn stop_signal() -> Option<i32> {
    match STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst) {
        0 => None,
        sig => Some(sig),
    }
}

/// Sends SIGTERM to `pid` (a rank of this job, asked to stop).
pub fn send_term(pid: u32) {
    // SAFETY: sending SIGTERM to a child we started.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
}

/// The owner of a file, without following a final symbolic link.
pub fn owner_uid(path: &std::path::Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).ok().map(|m| m.uid())
}

pub fn send_kill(pid: u32) {
    // SAFETY: sending SIGKILL to a child we started.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
}

pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Writes `bytes` to `path` so that a reader sees the old file or the whole new one, never a
/// part: a temporary file beside it, then a rename. Creates the folder.
pub(crate) fn write_file_atomically(
    path: &std::path::Path,
    bytes: &[u8],
    what: &'static str,
) -> crate::error::Result<()> {
    let io = |source| crate::error::Error::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(path.parent().expect("a file path has a parent")).map_err(io)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Free bytes for an unprivileged user on the file system holding `path` (statvfs), or
/// `None` where it cannot be read.
pub fn free_bytes(path: &std::path::Path) -> Option<u64> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we pass; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: the path is NUL-terminated and `st` is a valid, writable statvfs struct.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), &mut st) };
    if rc != 0 {
        return None;
    }
    (st.f_bavail as u64).checked_mul(st.f_frsize as u64)
}

/// Whether this process may create files in folder `dir` (access(2) with W_OK); a path with a
/// NUL byte is not writable.
pub fn dir_writable(dir: &std::path::Path) -> bool {
    let Ok(c_dir) = CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: access only reads the NUL-terminated path.
    unsafe { libc::access(c_dir.as_ptr(), libc::W_OK) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn segment_is_private_shared_and_unlinked_on_drop() {
        let name = format!("/tpar-test-sys-{}", std::process::id());
        let a = SharedSegment::create(&name, 4096).unwrap();
        let path = format!("/dev/shm{name}");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        let b = SharedSegment::open(&name).unwrap();
        a.lines()[3].store(42, Ordering::Release);
        assert_eq!(b.lines()[3].load(Ordering::Acquire), 42);
        assert_eq!(b.lines().len(), 512);
        drop(a);
        assert!(!std::path::Path::new(&path).exists());
        // The peer's mapping outlives the name.
        assert_eq!(b.lines()[3].load(Ordering::Acquire), 42);
        assert!(SharedSegment::open(&name).is_err());
    }

    #[test]
    fn create_refuses_an_existing_name() {
        let name = format!("/tpar-test-excl-{}", std::process::id());
        let _a = SharedSegment::create(&name, 4096).unwrap();
        assert!(matches!(
            SharedSegment::create(&name, 4096),
            Err(Error::SharedMemory { .. })
        ));
    }

    #[test]
    fn liveness_sees_this_process_and_not_a_reaped_child() {
        assert_eq!(liveness(std::process::id()), Liveness::Alive);
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(liveness(pid), Liveness::Gone);
    }

    #[test]
    fn an_unreaped_dead_child_counts_as_gone() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Wait until it has exited but do not reap it: a zombie.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while liveness(pid) == Liveness::Alive && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(liveness(pid), Liveness::Gone);
        child.wait().unwrap();
    }
}
