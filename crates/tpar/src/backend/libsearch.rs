//! Where NVIDIA's libraries usually live on a machine: CUDA toolkits under /usr/local and
//! /opt, and the pip wheels (`nvidia-cuda-nvrtc`, `nvidia-nccl-cu13`) in any Python's
//! site-packages (virtual environments, pyenv, ~/.local). The dynamic loader does not look in
//! most of these places by itself. A host program can add the folders it knows of
//! ([`add_site_packages`]: the Python package adds its interpreter's `sys.path`).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Folders the host program named (see [`add_site_packages`]), searched first.
static ADDED_SITE_PACKAGES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Adds `dirs` (site-packages or other `sys.path` entries of the running program) to the
/// folders [`python_site_packages`] returns, ahead of the guessed ones, for this process.
pub fn add_site_packages(dirs: impl IntoIterator<Item = PathBuf>) {
    let mut added = ADDED_SITE_PACKAGES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for dir in dirs {
        if !added.contains(&dir) {
            added.push(dir);
        }
    }
}

/// `lib64` and `targets/x86_64-linux/lib` of `CUDA_HOME`, `CUDA_PATH` and every
/// `/usr/local/cuda*` and `/opt/cuda*`.
pub fn cuda_toolkit_lib_dirs() -> Vec<PathBuf> {
    let mut homes: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var(v).ok().map(PathBuf::from))
        .collect();
    for root in ["/usr/local", "/opt"] {
        for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with("cuda") {
                homes.push(entry.path());
            }
        }
    }
    homes
        .iter()
        .flat_map(|h| [h.join("lib64"), h.join("targets/x86_64-linux/lib")])
        .collect()
}

/// site-packages folders of the Pythons this machine likely uses: those the host program
/// added ([`add_site_packages`]), `PYTHONPATH`, `VIRTUAL_ENV`, and
/// `lib/python3*/site-packages` under /usr/local, /usr, /opt/* (and their `.venv`), ~/.local
/// and every pyenv version.
pub fn python_site_packages() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = ADDED_SITE_PACKAGES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    dirs.extend(
        std::env::var("PYTHONPATH")
            .unwrap_or_default()
            .split(':')
            .filter(|s| !s.is_empty())
            .map(PathBuf::from),
    );
    let mut prefixes: Vec<PathBuf> = vec!["/usr/local".into(), "/usr".into()];
    if let Ok(venv) = std::env::var("VIRTUAL_ENV") {
        prefixes.push(venv.into());
    }
    if let Ok(home) = std::env::var("HOME") {
        prefixes.push(Path::new(&home).join(".local"));
        for entry in std::fs::read_dir(Path::new(&home).join(".pyenv/versions"))
            .into_iter()
            .flatten()
            .flatten()
        {
            prefixes.push(entry.path());
        }
    }
    for entry in std::fs::read_dir("/opt").into_iter().flatten().flatten() {
        prefixes.push(entry.path());
        prefixes.push(entry.path().join(".venv"));
    }
    for prefix in prefixes {
        for entry in std::fs::read_dir(prefix.join("lib"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if entry.file_name().to_string_lossy().starts_with("python3") {
                dirs.push(entry.path().join("site-packages"));
                dirs.push(entry.path().join("dist-packages"));
            }
        }
    }
    dirs
}

/// The candidates (in order, without repeats) that hold one of `files`.
pub fn dirs_holding(candidates: impl IntoIterator<Item = PathBuf>, files: &[&str]) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = Vec::new();
    for dir in candidates {
        if files.iter().any(|f| dir.join(f).exists()) && !found.contains(&dir) {
            found.push(dir);
        }
    }
    found
}

/// Loads the first of `files` found in `dirs` globally and keeps it loaded, so that a later
/// `dlopen` of its soname (as cudarc does, by name only) finds it although its folder is not
/// on the loader's path. Returns the file loaded, if any.
pub fn preload(dirs: &[PathBuf], files: &[&str]) -> Option<PathBuf> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    for path in dirs
        .iter()
        .flat_map(|d| files.iter().map(move |f| d.join(f)))
    {
        if !path.exists() {
            continue;
        }
        // SAFETY: NVIDIA's libraries run no initialisers that depend on the caller; the handle
        // is leaked on purpose so that the library stays loaded for the process's lifetime.
        if let Ok(lib) = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) } {
            std::mem::forget(lib);
            return Some(path);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_folders_holding_the_file_are_kept() {
        let dir = std::env::temp_dir().join(format!("tpar-libsearch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libx.so.1"), b"").unwrap();
        let found = dirs_holding(
            [dir.clone(), "/nonexistent".into(), dir.clone()],
            &["libx.so.1"],
        );
        assert_eq!(found, vec![dir.clone()]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn added_folders_come_first_once() {
        let dir = PathBuf::from(format!("/nonexistent/tpar-added-{}", std::process::id()));
        assert!(!python_site_packages().contains(&dir));
        add_site_packages([dir.clone(), dir.clone()]);
        add_site_packages([dir.clone()]);
        let dirs = python_site_packages();
        assert_eq!(dirs.iter().filter(|d| **d == dir).count(), 1);
        // Ahead of PYTHONPATH and the guessed folders: among the added ones at the front.
        let added = ADDED_SITE_PACKAGES.lock().unwrap().len();
        assert!(dirs.iter().position(|d| *d == dir).unwrap() < added);
    }
}
