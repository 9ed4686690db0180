//! Accounting of every byte a communicator allocates, so an engine can subtract it before it
//! sizes its KV cache.

/// Memory held by one rank's communicator, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryFootprint {
    /// GPU memory allocated by this rank.
    pub device_bytes: u64,
    /// Pinned (page-locked) host memory allocated by this rank.
    pub pinned_host_bytes: u64,
    /// Shared host memory (/dev/shm) allocated by this rank.
    pub shared_host_bytes: u64,
    /// Peers' memory mapped into this rank: address space, not new memory.
    pub peer_mapped_bytes: u64,
    /// The parts of `device_bytes`: tpar's own buffers (inboxes, state)...
    #[serde(default)]
    pub device_buffer_bytes: u64,
    /// ...the drop in free device memory measured around loading tpar's kernels into this
    /// GPU's context (modules, their local memory), shared by every communicator of this
    /// process on that GPU (count it once when adding communicators up)...
    #[serde(default)]
    pub module_bytes: u64,
    /// ...and the NCCL communicator tpar created itself (`nccl=own`), measured as the drop in
    /// free device memory around its initialisation and around its calls (NCCL connects peers
    /// and allocates their buffers at the first calls that need them); 0 with `none`, borrowed,
    /// or before the first call planned for NCCL created it.
    #[serde(default)]
    pub nccl_bytes: u64,
    /// True where `nccl_bytes` is an estimate from NCCL's settings (a plan made before
    /// anything was allocated), not a measurement.
    #[serde(default)]
    pub nccl_estimated: bool,
}

impl std::ops::Add for MemoryFootprint {
    type Output = MemoryFootprint;

    /// Two footprints together (the parts add; an estimate in either makes an estimate).
    fn add(self, o: MemoryFootprint) -> MemoryFootprint {
        MemoryFootprint {
            device_bytes: self.device_bytes + o.device_bytes,
            pinned_host_bytes: self.pinned_host_bytes + o.pinned_host_bytes,
            shared_host_bytes: self.shared_host_bytes + o.shared_host_bytes,
            peer_mapped_bytes: self.peer_mapped_bytes + o.peer_mapped_bytes,
            device_buffer_bytes: self.device_buffer_bytes + o.device_buffer_bytes,
            module_bytes: self.module_bytes + o.module_bytes,
            nccl_bytes: self.nccl_bytes + o.nccl_bytes,
            nccl_estimated: self.nccl_estimated || o.nccl_estimated,
        }
    }
}

impl MemoryFootprint {
    /// Bytes this rank takes from the machine (everything but peer mappings).
    pub fn allocated_bytes(&self) -> u64 {
        self.device_bytes + self.pinned_host_bytes + self.shared_host_bytes
    }
}

/// `1536` -> `"1.5 KiB"`: binary units, as sizes are given on the command line.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_uses_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(4096), "4 KiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(8 << 20), "8 MiB");
    }

    #[test]
    fn allocated_excludes_peer_mappings() {
        let m = MemoryFootprint {
            device_bytes: 1,
            pinned_host_bytes: 2,
            shared_host_bytes: 4,
            peer_mapped_bytes: 100,
            ..MemoryFootprint::default()
        };
        assert_eq!(m.allocated_bytes(), 7);
    }
}
