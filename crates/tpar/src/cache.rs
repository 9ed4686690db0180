//! Where tpar keeps what it measured or built on this machine: one directory (the cache root)
//! holding compiled kernels (`kernels/`), tuning tables (`tuning/`) and link measurements
//! (`probe/`). Kept below every other layer so that the dispatcher (tuning tables) and the
//! backends (kernels, link measurements) find the same place without importing each other.

use std::path::{Path, PathBuf};

/// The variable that moves tpar's cache.
pub const ENV_CACHE_DIR: &str = "TPAR_CACHE_DIR";

/// tpar's cache: `TPAR_CACHE_DIR`, else `$XDG_CACHE_HOME/tpar`, else `~/.cache/tpar`.
/// Compiled kernels go in `kernels/`, tuning tables in `tuning/`.
pub fn cache_root() -> PathBuf {
    if let Ok(dir) = std::env::var(ENV_CACHE_DIR) {
        return dir.into();
    }
    std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(|_| std::env::temp_dir())
        .join("tpar")
}
