//! The set-up of a process that will use tpar on CUDA, the same for every entry: the `tpar`
//! command runs [`prepare`] first thing, the Python package when it is imported.
//!
//! - `CUDA_DEVICE_MAX_CONNECTIONS` is set to 32 unless the user set it: the driver's default
//!   of 8 hardware queues serialises the streams of more than 8 ranks sharing one GPU (the
//!   command's threads mode, `tpar bench -n 16` on one GPU). The driver reads it when the
//!   process's first CUDA context is made, so this must run before any CUDA call.
//! - NVRTC is found where it is installed, without `LD_LIBRARY_PATH`: a CUDA toolkit under
//!   /usr/local or /opt, `TPAR_NVRTC_DIR`, or pip's `nvidia-cuda-nvrtc` wheel in any
//!   site-packages the program names (`site_packages`, e.g. Python's `sys.path`) or that
//!   [`crate::backend::libsearch`] knows of. It is loaded from there by path when first
//!   needed ([`crate::backend::cuda::nvrtc::nvrtc_present`]); its own `$ORIGIN` run path
//!   finds its builtins beside it.
//!
//! [`Environment::now`] says what a process has: what `tpar doctor` and Python's
//! `tpar.environment()` report.

use std::path::PathBuf;

use crate::backend::cuda::nvrtc;
use crate::backend::libsearch;

/// The variable the CUDA driver reads for its number of hardware queues per device.
pub const MAX_CONNECTIONS_VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";

/// tpar's value for [`MAX_CONNECTIONS_VAR`] when the user has not set it.
pub const DEFAULT_MAX_CONNECTIONS: &str = "32";

/// Prepares this process: sets [`MAX_CONNECTIONS_VAR`] unless it is set, and adds
/// `site_packages` (folders of the running program that may hold NVIDIA's pip wheels) to
/// where NVRTC, NCCL and cuBLAS are looked for. Run it before the first CUDA call, while the
/// process has one thread (it changes the environment); running it again only adds folders.
pub fn prepare(site_packages: impl IntoIterator<Item = PathBuf>) {
    if std::env::var_os(MAX_CONNECTIONS_VAR).is_none() {
        std::env::set_var(MAX_CONNECTIONS_VAR, DEFAULT_MAX_CONNECTIONS);
    }
    libsearch::add_site_packages(site_packages);
}

/// What this process has for CUDA: the environment it runs with and where NVRTC comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Environment {
    /// [`MAX_CONNECTIONS_VAR`] as the process has it (tpar's default unless the user set it).
    pub cuda_device_max_connections: Option<String>,
    /// NVRTC's version, `13.0`, or why it cannot be loaded.
    pub nvrtc: Result<String, String>,
    /// The libnvrtc file this process has loaded (from `/proc/self/maps`), if any.
    pub nvrtc_file: Option<PathBuf>,
    /// The folders that hold NVRTC, in the order they are tried after the loader's path.
    pub nvrtc_search_dirs: Vec<PathBuf>,
}

impl Environment {
    /// Reads the environment now; loads NVRTC if it can be found (as the first compile would).
    pub fn now() -> Environment {
        let nvrtc = nvrtc::nvrtc_version()
            .map(|(major, minor)| format!("{major}.{minor}"))
            .map_err(|e| e.to_string());
        Environment {
            cuda_device_max_connections: std::env::var(MAX_CONNECTIONS_VAR).ok(),
            nvrtc,
            nvrtc_file: loaded_file("libnvrtc.so"),
            nvrtc_search_dirs: nvrtc::nvrtc_search_dirs(),
        }
    }
}

/// The file this process has mapped whose name starts with `stem` (`libnvrtc.so` matches
/// `libnvrtc.so.13`, not `libnvrtc-builtins.so.13.0`), from `/proc/self/maps`.
fn loaded_file(stem: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(PathBuf::from)
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(stem))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepare_sets_the_queue_count_and_keeps_the_users() {
        // Tests share the process environment: only this one touches the variable.
        std::env::remove_var(MAX_CONNECTIONS_VAR);
        prepare([]);
        assert_eq!(
            std::env::var(MAX_CONNECTIONS_VAR).as_deref(),
            Ok(DEFAULT_MAX_CONNECTIONS)
        );
        std::env::set_var(MAX_CONNECTIONS_VAR, "4");
        prepare([]);
        assert_eq!(std::env::var(MAX_CONNECTIONS_VAR).as_deref(), Ok("4"));
        assert_eq!(
            Environment::now().cuda_device_max_connections.as_deref(),
            Some("4")
        );
    }

    #[test]
    fn a_loaded_file_is_found_by_its_name() {
        // Every Rust test binary links libc dynamically; no file is named like this.
        let libc = loaded_file("libc.so").expect("libc is mapped");
        assert!(libc.is_absolute(), "{libc:?}");
        assert_eq!(loaded_file("libtpar-no-such-library.so"), None);
    }

    #[test]
    fn nvrtc_is_loaded_from_a_folder_it_reports() {
        let env = Environment::now();
        match (&env.nvrtc, &env.nvrtc_file) {
            (Ok(version), Some(file)) => {
                assert!(version.starts_with("1"), "{version}");
                assert!(file.to_string_lossy().contains("libnvrtc.so"), "{file:?}");
            }
            (Ok(version), None) => panic!("NVRTC {version} loaded but no libnvrtc mapped"),
            (Err(why), _) => {
                assert!(
                    std::env::var("TPAR_REQUIRE_NVRTC").is_err(),
                    "TPAR_REQUIRE_NVRTC is set but {why}"
                );
                assert!(why.contains("NVRTC"), "{why}");
                eprintln!("SKIPPED nvrtc_is_loaded_from_a_folder_it_reports: {why}");
            }
        }
    }
}
