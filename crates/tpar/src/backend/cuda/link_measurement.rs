//! The measurement of the links between this process's GPUs (`tpar doctor`): for every pair, the bandwidth of
//! peer writes (push) and of peer reads (pull) on that link alone and the one-way latency of a
//! flag; then every GPU pushing to (and pulling from) every peer at once. On some PCIe switch
//! and root-complex layouts posted writes collapse to a fraction of the link while reads hold,
//! so whether tpar pushes or pulls is decided from this, not assumed (see `dispatch`).
//!
//! The result is kept in tpar's cache under the machine's fingerprint, where every communicator
//! of a later job finds it ([`LinkMeasurements::load`] at [`LinkMeasurements::path`]).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaStream};
use serde::{Deserialize, Serialize};

use super::driver::DeviceMemory;
use super::kernels::{KernelId, MAX_RANKS, THREADS};
use super::{context, enable_peer_access, kernel_set, KernelSet};
use crate::error::{Error, Result};
use crate::topology::Findings;
use crate::topology::Topology;

/// One link, measured alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkMeasurement {
    pub a: usize,
    pub b: usize,
    /// GPU `a` writing into `b`'s memory, GB/s.
    pub push_gbps: f64,
    /// GPU `a` reading `b`'s memory, GB/s.
    pub pull_gbps: f64,
    /// A flag written by one GPU and seen by the other, one way (half a round trip), us.
    pub latency_us: f64,
}

/// Every link of a group of GPUs, measured alone and all at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkMeasurements {
    pub devices: Vec<usize>,
    pub bytes_per_copy: usize,
    pub links: Vec<LinkMeasurement>,
    /// Every GPU writing into every peer at once: bytes each GPU sent per second, the mean
    /// over GPUs, GB/s.
    pub all_push_gbps: f64,
    /// Every GPU reading every peer at once, GB/s per GPU.
    pub all_pull_gbps: f64,
}

/// Mirrors `TparProbeArgs` in probe.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ProbeArgs {
    src: [u64; MAX_RANKS],
    dst: [u64; MAX_RANKS],
    vectors: u64,
    flag_out: u64,
    flag_in: u64,
    rounds: u64,
    timeout_ns: u64,
    result: u64,
    copies: u32,
    role: u32,
}

impl ProbeArgs {
    fn zeroed() -> ProbeArgs {
        ProbeArgs {
            src: [0; MAX_RANKS],
            dst: [0; MAX_RANKS],
            vectors: 0,
            flag_out: 0,
            flag_in: 0,
            rounds: 0,
            timeout_ns: 0,
            result: 0,
            copies: 1,
            role: 0,
        }
    }
}

struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Arc<KernelSet>,
    src: DeviceMemory,
    dst: DeviceMemory,
    /// [flag, result]
    words: DeviceMemory,
}

const PINGPONG_ROUNDS: u64 = 1000;
const COPY_BLOCKS_PER_SM: u32 = 2;

impl Gpu {
    /// Launches `copies` (source, destination) copies of `bytes` each on this GPU's stream.
    fn launch_copies(&self, pairs: &[(u64, u64)], bytes: usize) -> Result<()> {
        let mut args = ProbeArgs::zeroed();
        for (i, (s, d)) in pairs.iter().enumerate() {
            args.src[i] = *s;
            args.dst[i] = *d;
        }
        args.copies = pairs.len() as u32;
        args.vectors = (bytes / 16) as u64;
        let blocks = (self.kernels.sm_count * COPY_BLOCKS_PER_SM).max(args.copies);
        let blocks = blocks - blocks % args.copies;
        super::driver::bind(&self.ctx)?;
        // SAFETY: every pointer is a live device allocation of at least `bytes` (ours or a
        // peer's, reachable with peer access enabled); the argument block mirrors probe.cu.
        unsafe {
            self.kernels.get(KernelId::ProbeCopy).launch(
                blocks,
                THREADS,
                self.stream.cu_stream(),
                &args,
            )
        }
    }
}

fn cuda(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("link measurement: {what}: {e}"))
}

/// Times `launch` on every GPU of `gpus` at once (each on its own stream), and returns the
/// seconds each took (the median of `reps`, after one untimed run).
fn time_each(gpus: &[&Gpu], reps: usize, launch: impl Fn(usize) -> Result<()>) -> Result<Vec<f64>> {
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); gpus.len()];
    for rep in 0..=reps {
        let mut events = Vec::new();
        for (i, g) in gpus.iter().enumerate() {
            let start = g
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda("event"))?;
            launch(i)?;
            let end = g
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda("event"))?;
            events.push((start, end));
        }
        for (i, (g, (start, end))) in gpus.iter().zip(events).enumerate() {
            g.stream.synchronize().map_err(cuda("synchronise"))?;
            if rep > 0 {
                let ms = start.elapsed_ms(&end).map_err(cuda("elapsed"))?;
                samples[i].push(f64::from(ms) / 1e3);
            }
        }
    }
    Ok(samples
        .into_iter()
        .map(|mut s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect())
}

/// Measures every link between `devices` (CUDA ordinals, at least two, all in this process)
/// with copies of `bytes` (a multiple of 16). Errors say why (no P2P between some pair: then
/// the device-memory algorithms cannot run there at all, and host-staged is what remains).
pub fn measure_links(
    devices: &[usize],
    bytes: usize,
    timeout: Duration,
) -> Result<LinkMeasurements> {
    if devices.len() < 2 || devices.len() > MAX_RANKS {
        return Err(Error::InvalidArgument(format!(
            "the link measurement needs 2 to {MAX_RANKS} GPUs, not {}",
            devices.len()
        )));
    }
    let bytes = bytes - bytes % 16;
    let contexts: Vec<Arc<CudaContext>> =
        devices.iter().map(|d| context(*d)).collect::<Result<_>>()?;
    enable_peer_access(&contexts).map_err(Error::Unsupported)?;
    let gpus: Vec<Gpu> = contexts
        .iter()
        .map(|ctx| {
            Ok(Gpu {
                ctx: ctx.clone(),
                stream: ctx.new_stream().map_err(cuda("stream"))?,
                kernels: kernel_set(ctx)?,
                src: DeviceMemory::zeroed(ctx, bytes)?,
                dst: DeviceMemory::zeroed(ctx, bytes)?,
                words: DeviceMemory::zeroed(ctx, 16)?,
            })
        })
        .collect::<Result<_>>()?;
    let gbps = |b: usize, secs: f64| b as f64 / secs / 1e9;

    let mut links = Vec::new();
    for a in 0..gpus.len() {
        for b in 0..gpus.len() {
            if a == b {
                continue;
            }
            let (ga, gb) = (&gpus[a], &gpus[b]);
            let push = time_each(&[ga], 3, |_| {
                ga.launch_copies(&[(ga.src.ptr(), gb.dst.ptr())], bytes)
            })?[0];
            let pull = time_each(&[ga], 3, |_| {
                ga.launch_copies(&[(gb.src.ptr(), ga.dst.ptr())], bytes)
            })?[0];
            let latency_us = if a < b {
                pingpong(ga, gb, timeout)?
            } else {
                links
                    .iter()
                    .find(|l: &&LinkMeasurement| l.a == b && l.b == a)
                    .map_or(0.0, |l| l.latency_us)
            };
            links.push(LinkMeasurement {
                a: devices[a],
                b: devices[b],
                push_gbps: gbps(bytes, push),
                pull_gbps: gbps(bytes, pull),
                latency_us,
            });
        }
    }

    // All at once: each GPU sends (or fetches) a slice of `bytes / n` to (from) every peer.
    let n = gpus.len();
    let slice = (bytes / n) - (bytes / n) % 16;
    let all: Vec<&Gpu> = gpus.iter().collect();
    let push_pairs = |a: usize| -> Vec<(u64, u64)> {
        (0..n)
            .filter(|&p| p != a)
            .map(|p| (gpus[a].src.ptr(), gpus[p].dst.ptr() + (a * slice) as u64))
            .collect()
    };
    let pull_pairs = |a: usize| -> Vec<(u64, u64)> {
        (0..n)
            .filter(|&p| p != a)
            .map(|p| {
                (
                    gpus[p].src.ptr() + (a * slice) as u64,
                    gpus[a].dst.ptr() + (p * slice) as u64,
                )
            })
            .collect()
    };
    let sent = slice * (n - 1);
    let push_all = time_each(&all, 3, |a| gpus[a].launch_copies(&push_pairs(a), slice))?;
    let pull_all = time_each(&all, 3, |a| gpus[a].launch_copies(&pull_pairs(a), slice))?;
    let mean = |t: &[f64]| t.iter().map(|s| gbps(sent, *s)).sum::<f64>() / t.len() as f64;
    Ok(LinkMeasurements {
        devices: devices.to_vec(),
        bytes_per_copy: bytes,
        links,
        all_push_gbps: mean(&push_all),
        all_pull_gbps: mean(&pull_all),
    })
}

/// One-way latency of a flag between `a` and `b`: `b` answers each of `a`'s writes.
fn pingpong(a: &Gpu, b: &Gpu, timeout: Duration) -> Result<f64> {
    for g in [a, b] {
        g.words.fill(0)?;
    }
    let args = |me: &Gpu, peer: &Gpu, role: u32| ProbeArgs {
        flag_out: peer.words.ptr(),
        flag_in: me.words.ptr(),
        rounds: PINGPONG_ROUNDS,
        timeout_ns: timeout.as_nanos() as u64,
        result: me.words.ptr() + 8,
        role,
        ..ProbeArgs::zeroed()
    };
    // The answering side starts first, so that it is waiting when the first flag arrives.
    for (me, peer, role) in [(b, a, 1), (a, b, 0)] {
        super::driver::bind(&me.ctx)?;
        // SAFETY: flags and result are live 16-byte allocations (peer access is enabled); the
        // kernel touches nothing else.
        unsafe {
            me.kernels.get(KernelId::ProbePingpong).launch(
                1,
                32,
                me.stream.cu_stream(),
                &args(me, peer, role),
            )?
        };
    }
    for g in [a, b] {
        g.stream.synchronize().map_err(cuda("synchronise"))?;
    }
    let mut word = [0u8; 16];
    a.words.download(&mut word)?;
    let ns = u64::from_le_bytes(word[8..16].try_into().expect("8 bytes"));
    if ns == u64::MAX {
        return Err(Error::Cuda(format!(
            "link measurement: a flag between GPU {} and GPU {} was not seen within {timeout:?}",
            a.ctx.ordinal(),
            b.ctx.ordinal()
        )));
    }
    Ok(ns as f64 / 1e3 / PINGPONG_ROUNDS as f64 / 2.0)
}

impl LinkMeasurements {
    /// What the dispatcher needs of it: the push and pull bandwidth with every link busy.
    pub fn to_findings(&self) -> Findings {
        Findings {
            failed: Vec::new(),
            push_gbps: Some(self.all_push_gbps),
            pull_gbps: Some(self.all_pull_gbps),
        }
    }

    /// Where the measurements of this machine are kept: `probe/` in tpar's cache (the folder
    /// keeps its name so that measurements saved before the rename are still found).
    pub fn path(topology: &Topology) -> std::path::PathBuf {
        super::nvrtc::cache_root()
            .join("probe")
            .join(format!("{}.json", topology.fingerprint()))
    }

    /// Writes it to `path` (atomically), normally [`LinkMeasurements::path`].
    pub fn save(&self, path: &std::path::Path) -> Result<()> {
        let text = serde_json::to_vec_pretty(self).expect("serialisable");
        crate::sys::write_file_atomically(path, &text, "cannot write the link measurements")
    }

    /// The measurements saved at `path`, if any (a file that does not parse is ignored with a
    /// warning: it is a cache).
    pub fn load(path: &std::path::Path) -> Option<LinkMeasurements> {
        let text = std::fs::read_to_string(path).ok()?;
        match serde_json::from_str(&text) {
            Ok(p) => Some(p),
            Err(e) => {
                log::warn!("ignoring the link measurements in {}: {e}", path.display());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_block_matches_the_kernel_struct() {
        // 2 x 16 pointers, 6 words, 2 u32: the layout probe.cu's TparProbeArgs has.
        assert_eq!(std::mem::size_of::<ProbeArgs>(), 2 * 16 * 8 + 6 * 8 + 2 * 4);
        let source = super::super::kernels::SOURCES
            .iter()
            .find(|s| s.0 == "probe.cu")
            .unwrap()
            .1;
        let fields = [
            "src[TPAR_MAX_RANKS]",
            "dst[TPAR_MAX_RANKS]",
            "vectors",
            "flag_out",
            "flag_in",
            "rounds",
            "timeout_ns",
            "result",
            "copies",
            "role",
        ];
        let mut at = 0;
        for f in fields {
            let found = source[at..]
                .find(f)
                .unwrap_or_else(|| panic!("{f} not in order"));
            at += found;
        }
    }

    #[test]
    fn saved_measurements_are_kept_per_machine_and_read_back() {
        let h200 = Topology::from_json(crate::topology::FIXTURES[0].1).unwrap();
        let other = Topology::from_json(crate::topology::FIXTURES[1].1).unwrap();
        assert_ne!(
            LinkMeasurements::path(&h200),
            LinkMeasurements::path(&other)
        );
        let dir = std::env::temp_dir().join(format!("tpar-probe-test-{}", std::process::id()));
        let path = dir.join("probe").join("x.json");
        let measured = LinkMeasurements {
            devices: vec![0, 1],
            bytes_per_copy: 1 << 20,
            links: vec![],
            all_push_gbps: 3.0,
            all_pull_gbps: 50.0,
        };
        measured.save(&path).unwrap();
        assert_eq!(LinkMeasurements::load(&path), Some(measured.clone()));
        std::fs::write(&path, "{").unwrap();
        assert_eq!(
            LinkMeasurements::load(&path),
            None,
            "a broken cache file is ignored"
        );
        let p = measured.to_findings();
        assert_eq!((p.push_gbps, p.pull_gbps), (Some(3.0), Some(50.0)));
        std::fs::remove_dir_all(&dir).ok();
    }
}
