//! Run-time compilation of tpar's kernels with NVRTC, to CUBIN for one architecture, cached on
//! disk under a key of source hash, architecture and NVRTC version. Needs no GPU: CI compiles
//! every kernel for every supported architecture with the `nvidia-cuda-nvrtc` wheel.
//!
//! NVRTC is found the way the dynamic loader finds libraries (`LD_LIBRARY_PATH`, the system
//! cache), or else loaded by path from the first of [`nvrtc_search_dirs`] (where a CUDA
//! toolkit or the pip wheel usually puts it) that has it; see [`crate::environment`].

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys::{self, nvrtcResult};

use crate::error::{Error, Result};

/// Whether libnvrtc can be loaded: from the loader's path, or else from the first of
/// [`nvrtc_search_dirs`] that has it (loaded there once, for the whole process).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    if unsafe { sys::is_culib_present() } {
        return true;
    }
    let files = ["libnvrtc.so.13", "libnvrtc.so.12"];
    crate::backend::libsearch::preload(&nvrtc_search_dirs(), &files).is_some()
        // SAFETY: as above.
        && unsafe { sys::is_culib_present() }
}

/// Folders that commonly hold libnvrtc.so.13 (or .12): `TPAR_NVRTC_DIR`, a CUDA toolkit's,
/// and the pip wheel's `nvidia/cu13/lib` or `nvidia/cuda_nvrtc/lib` (see
/// [`crate::backend::libsearch`]). Only folders that hold the library are returned.
pub fn nvrtc_search_dirs() -> Vec<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(dir) = std::env::var("TPAR_NVRTC_DIR") {
        candidates.push(dir.into());
    }
    candidates.extend(crate::backend::libsearch::cuda_toolkit_lib_dirs());
    for sp in crate::backend::libsearch::python_site_packages() {
        candidates.push(sp.join("nvidia/cu13/lib"));
        candidates.push(sp.join("nvidia/cuda_nvrtc/lib"));
    }
    crate::backend::libsearch::dirs_holding(
        candidates,
        &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    )
}

fn missing_nvrtc() -> Error {
    let dirs = nvrtc_search_dirs();
    let hint = if dirs.is_empty() {
        "install it with `pip install nvidia-cuda-nvrtc` or a CUDA toolkit".to_owned()
    } else {
        format!(
            "it is in {} but did not load from there: put that folder on LD_LIBRARY_PATH",
            dirs[0].display()
        )
    };
    Error::Compile(format!("NVRTC (libnvrtc.so) cannot be loaded; {hint}"))
}

fn check(what: &str, result: nvrtcResult) -> Result<()> {
    if result == nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::Compile(format!("{what} failed: {result:?}")))
    }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(missing_nvrtc());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    check("nvrtcVersion", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

/// Compiles `source` (with `headers` as includable files) to CUBIN for `sm_<arch>`.
pub fn compile_cubin(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    arch: u32,
) -> Result<Vec<u8>> {
    if !nvrtc_present() {
        return Err(missing_nvrtc());
    }
    let c = |s: &str| CString::new(s).expect("sources have no NUL");
    let (c_source, c_name) = (c(source), c(name));
    let header_sources: Vec<CString> = headers.iter().map(|(_, s)| c(s)).collect();
    let header_names: Vec<CString> = headers.iter().map(|(n, _)| c(n)).collect();
    let header_ptrs: Vec<*const c_char> = header_sources.iter().map(|s| s.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();
    let options: Vec<CString> = [
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".to_owned(),
        "--fmad=false".to_owned(), // sums must round exactly as the CPU reference does
        "-default-device".to_owned(),
    ]
    .into_iter()
    .chain(extra_defines())
    .map(|o| c(&o))
    .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|s| s.as_ptr()).collect();

    let mut program = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live CString; counts match the arrays.
    check("nvrtcCreateProgram", unsafe {
        sys::nvrtcCreateProgram(
            &mut program,
            c_source.as_ptr(),
            c_name.as_ptr(),
            headers.len() as i32,
            header_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    })?;
    let result = (|| {
        // SAFETY: program is live; the options array is valid for the call.
        let compiled = unsafe {
            sys::nvrtcCompileProgram(program, option_ptrs.len() as i32, option_ptrs.as_ptr())
        };
        if compiled != nvrtcResult::NVRTC_SUCCESS {
            return Err(Error::Compile(format!(
                "{name} for sm_{arch}: {compiled:?}\n{}",
                program_log(program)
            )));
        }
        let mut size = 0;
        // SAFETY: program compiled.
        check("nvrtcGetCUBINSize", unsafe {
            sys::nvrtcGetCUBINSize(program, &mut size)
        })?;
        let mut cubin = vec![0u8; size];
        // SAFETY: cubin has `size` bytes.
        check("nvrtcGetCUBIN", unsafe {
            sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr() as *mut c_char)
        })?;
        Ok(cubin)
    })();
    // SAFETY: destroys the program once.
    unsafe { sys::nvrtcDestroyProgram(&mut program) };
    result
}

fn program_log(program: sys::nvrtcProgram) -> String {
    let mut size = 0;
    // SAFETY: program is live.
    if unsafe { sys::nvrtcGetProgramLogSize(program, &mut size) } != nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    let mut log = vec![0 as c_char; size.max(1)];
    // SAFETY: log has `size` bytes.
    unsafe { sys::nvrtcGetProgramLog(program, log.as_mut_ptr()) };
    // SAFETY: NVRTC NUL-terminates the log.
    unsafe { CStr::from_ptr(log.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Extra `-D` options for experiments with the kernels' tuning macros, from
/// `TPAR_KERNEL_DEFINES` (whitespace-separated); part of the cache key.
pub(super) fn extra_defines() -> Vec<String> {
    std::env::var("TPAR_KERNEL_DEFINES")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

pub use crate::cache::cache_root;

/// [`compile_cubin`] through the disk cache.
pub fn cached_cubin(
    name: &str,
    source: &str,
    headers: &[(&str, &str)],
    arch: u32,
) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc_version()?;
    let defines = extra_defines().join(" ");
    let hash = crate::hash::fnv1a_texts(
        std::iter::once(source)
            .chain(headers.iter().flat_map(|(n, s)| [*n, *s]))
            .chain([defines.as_str()]),
    );
    let stem = name.trim_end_matches(".cu");
    let path = cache_root().join("kernels").join(format!(
        "{stem}-{hash:016x}-sm{arch}-nvrtc{major}.{minor}.cubin"
    ));
    if let Ok(cubin) = std::fs::read(&path) {
        if !cubin.is_empty() {
            return Ok(cubin);
        }
    }
    let cubin = compile_cubin(name, source, headers, arch)?;
    // A cache that cannot be written only costs a compile next time.
    if std::fs::create_dir_all(path.parent().expect("has a parent")).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(cubin)
}

/// [`cached_cubin`] for every file of `sources`, in their order, compiled side by side on up to
/// as many threads as the machine has cores (NVRTC compiles different programs concurrently):
/// a GPU's first use compiles every file, which took 100 s one after the other on one H200
/// (2026-12-02) and then waits for the longest file alone (islands.cu: 38 s of the 81 s all
/// files took on 2 cores here; 17-21 s for everything on the H200 host while that file took
/// its slow paths as calls).
pub fn cached_cubins(
    sources: &[(&str, &str)],
    headers: &[(&str, &str)],
    arch: u32,
) -> Result<Vec<Vec<u8>>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    side_by_side(sources, threads, |(file, source)| {
        cached_cubin(file, source, headers, arch)
    })
}

/// `work` over every item on up to `threads` threads, the results in the items' order; the
/// first error (in that order) is the result.
pub(crate) fn side_by_side<I: Sync, T: Send>(
    items: &[I],
    threads: usize,
    work: impl Fn(&I) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let mut results: Vec<Option<Result<T>>> = (0..items.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.clamp(1, items.len().max(1)))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else {
                            return done;
                        };
                        done.push((i, work(item)));
                    }
                })
            })
            .collect();
        for worker in workers {
            let done = worker
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            for (i, result) in done {
                results[i] = Some(result);
            }
        }
    });
    results
        .into_iter()
        .map(|r| r.expect("every item taken by one thread"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_by_side_keeps_the_order_and_gives_the_first_error() {
        let items: Vec<u32> = (0..37).collect();
        for threads in [1, 2, 5, 64] {
            let squares = side_by_side(&items, threads, |&x| Ok(x * x)).unwrap();
            assert_eq!(squares, items.iter().map(|x| x * x).collect::<Vec<_>>());
            let failed = side_by_side(&items, threads, |&x| {
                if x % 10 == 7 {
                    Err(Error::Compile(format!("item {x}")))
                } else {
                    Ok(x)
                }
            });
            assert_eq!(
                failed.unwrap_err().to_string(),
                Error::Compile("item 7".into()).to_string()
            );
        }
        assert!(side_by_side(&[] as &[u32], 4, |&x| Ok(x))
            .unwrap()
            .is_empty());
    }
}
