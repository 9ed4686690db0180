//! Transports that carry the [`crate::protocol`]. Each one implements the same algorithms with
//! the same schedules and summation order, so their results are interchangeable bit for bit
//! (the GPU in LL lines, the CPU in plain copies with its own layout).

pub mod cpu;
pub mod cuda;
pub mod libsearch;
pub mod machine;
pub mod nccl;

/// Whether this machine shows NVIDIA GPUs, read from the driver's /proc files so that nothing
/// is loaded: `Ok(count)`, or `Err(reason)` in words for the user.
pub fn visible_nvidia_gpus() -> Result<usize, String> {
    let dir = std::path::Path::new("/proc/driver/nvidia/gpus");
    match std::fs::read_dir(dir) {
        Ok(entries) => match entries.count() {
            0 => Err("the NVIDIA driver is loaded but reports no GPU".to_owned()),
            n => Ok(n),
        },
        Err(_) => Err(format!(
            "no NVIDIA driver is loaded ({} not found)",
            dir.display()
        )),
    }
}
