//! The measurement of the links between this process's GPUs (`tpar doctor`): for every pair, the bandwidth of
//! peer writes (push) and of peer reads (pull) on that link alone and the one-way latency of a
//! flag; then every GPU pushing to (and pulling from) every peer at once. On some PCIe switch
//! and root-complex layouts posted writes collapse to a fraction of the link while reads hold,
//! so whether tpar pushes or pulls is decided from this, not assumed (see `dispatch`).
//!
//! Then the fan-out (pcie-published.md, table A): one GPU writing to (and reading from) one
//! peer alone, then to peers behind two or more CPU root complexes at once. Where writes fall
//! and reads hold, posted writes collapse under fan-out on this machine; the collapse factor
//! goes to the fabric model (`dispatch::fabric`) through the findings. Which peers to use and
//! the arithmetic are plain functions ([`fanout_peers`], [`fanout_from_seconds`]), tested
//! without a GPU.
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
use crate::topology::{Fanout, Findings, Location, Topology};

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
    /// One GPU's writes and reads to one peer alone and fanned out over root complexes.
    #[serde(default)]
    pub fanout: Option<FanoutMeasurement>,
    /// Why the fan-out was not measured (every peer behind one root complex, one GPU).
    #[serde(default)]
    pub fanout_skipped: Option<String>,
}

/// One GPU's peer writes and reads: to one peer alone, then to peers behind two or more root
/// complexes at once (the pattern whose writes collapse on some PCIe fabrics).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FanoutMeasurement {
    /// The GPU that writes and reads (a CUDA ordinal).
    pub source: usize,
    /// The peers written to at once, each behind another root complex (CUDA ordinals); the
    /// first is also the one peer measured alone.
    pub peers: Vec<usize>,
    pub bandwidth: Fanout,
}

impl FanoutMeasurement {
    /// How many times slower writes are fanned out than alone (1: no collapse).
    pub fn write_collapse(&self) -> f64 {
        self.bandwidth.write_collapse()
    }
}

/// The peers a fan-out measurement from `source` writes to: outside the source's switch, one
/// per root complex (the first GPU of each, in order), at most [`MAX_FANOUT_PEERS`]. `places`
/// is indexed by device. An error says why there is no fan-out to measure.
pub fn fanout_peers(
    places: &[Location],
    devices: &[usize],
    source: usize,
) -> std::result::Result<Vec<usize>, String> {
    if devices.len() < 2 {
        return Err(format!(
            "{} GPU(s) here; the fan-out needs a GPU and peers behind two or more root complexes",
            devices.len()
        ));
    }
    let Some(from) = places.get(source) else {
        return Err(format!("GPU {source} is not in the topology"));
    };
    let mut peers: Vec<usize> = Vec::new();
    let mut complexes: Vec<usize> = Vec::new();
    for &d in devices {
        let Some(at) = places.get(d) else { continue };
        let same_switch = from.switch.is_some() && at.switch == from.switch;
        if d == source || same_switch || complexes.contains(&at.root_complex) {
            continue;
        }
        complexes.push(at.root_complex);
        peers.push(d);
        if peers.len() == MAX_FANOUT_PEERS {
            break;
        }
    }
    if peers.len() < 2 {
        return Err(format!(
            "the peers of GPU {source} outside its switch are behind {} root complex(es): no write from it fans out over two or more, so none can collapse that way",
            peers.len()
        ));
    }
    Ok(peers)
}

/// The most peers a fan-out writes to at once (table A measured 2 and 3 root complexes).
pub const MAX_FANOUT_PEERS: usize = 3;

/// The bandwidths of a fan-out measurement from its times: `bytes` to one peer alone (written,
/// read), then `bytes` to each of `peers` peers at once (written, read), in seconds.
pub fn fanout_from_seconds(
    bytes: usize,
    peers: usize,
    pair_write_s: f64,
    pair_read_s: f64,
    fanout_write_s: f64,
    fanout_read_s: f64,
) -> Fanout {
    let gbps = |b: f64, s: f64| b / s.max(1e-12) / 1e9;
    let total = (bytes * peers) as f64;
    Fanout {
        pair_write_gbps: gbps(bytes as f64, pair_write_s),
        pair_read_gbps: gbps(bytes as f64, pair_read_s),
        fanout_write_gbps: gbps(total, fanout_write_s),
        fanout_read_gbps: gbps(total, fanout_read_s),
    }
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
/// with copies of `bytes` (a multiple of 16), then the fan-out from the first device over the
/// root complexes `places` (indexed by device) say the peers are behind. Errors say why (no
/// P2P between some pair: then the device-memory algorithms cannot run there at all, and
/// host-staged is what remains).
pub fn measure_links(
    devices: &[usize],
    places: &[Location],
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
    let (fanout, fanout_skipped) = match fanout_peers(places, devices, devices[0]) {
        Ok(peers) => (Some(measure_fanout(&gpus, devices, &peers, bytes)?), None),
        Err(why) => (None, Some(why)),
    };
    Ok(LinkMeasurements {
        devices: devices.to_vec(),
        bytes_per_copy: bytes,
        links,
        all_push_gbps: mean(&push_all),
        all_pull_gbps: mean(&pull_all),
        fanout,
        fanout_skipped,
    })
}

/// The fan-out from `devices[0]` (`gpus[0]`) to `peers` (device ordinals among `devices`):
/// `bytes` to the first peer alone, then `bytes` to every peer at once, written then read.
fn measure_fanout(
    gpus: &[Gpu],
    devices: &[usize],
    peers: &[usize],
    bytes: usize,
) -> Result<FanoutMeasurement> {
    let source = &gpus[0];
    let index = |d: usize| {
        devices
            .iter()
            .position(|&x| x == d)
            .expect("a measured device")
    };
    let peer_gpus: Vec<&Gpu> = peers.iter().map(|&d| &gpus[index(d)]).collect();
    let writes = |to: &[&Gpu]| -> Vec<(u64, u64)> {
        to.iter().map(|p| (source.src.ptr(), p.dst.ptr())).collect()
    };
    let reads = |from: &[&Gpu]| -> Vec<(u64, u64)> {
        from.iter()
            .map(|p| (p.src.ptr(), source.dst.ptr()))
            .collect()
    };
    let time = |pairs: Vec<(u64, u64)>| -> Result<f64> {
        Ok(time_each(&[source], 3, |_| source.launch_copies(&pairs, bytes))?[0])
    };
    let pair_write = time(writes(&peer_gpus[..1]))?;
    let pair_read = time(reads(&peer_gpus[..1]))?;
    let fanout_write = time(writes(&peer_gpus))?;
    let fanout_read = time(reads(&peer_gpus))?;
    Ok(FanoutMeasurement {
        source: devices[0],
        peers: peers.to_vec(),
        bandwidth: fanout_from_seconds(
            bytes,
            peers.len(),
            pair_write,
            pair_read,
            fanout_write,
            fanout_read,
        ),
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
            fanout: self.fanout.as_ref().map(|f| f.bandwidth.clone()),
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
            fanout: Some(FanoutMeasurement {
                source: 0,
                peers: vec![1, 2],
                bandwidth: Fanout {
                    pair_write_gbps: 52.5,
                    pair_read_gbps: 53.5,
                    fanout_write_gbps: 13.5,
                    fanout_read_gbps: 53.0,
                },
            }),
            fanout_skipped: None,
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
        assert!(p.fanout.is_some_and(|f| f.write_collapse() > 3.0));
        // A file kept before the fan-out was measured still loads.
        std::fs::write(
            &path,
            r#"{"devices":[0,1],"bytes_per_copy":16,"links":[],"all_push_gbps":1.0,"all_pull_gbps":1.0}"#,
        )
        .unwrap();
        assert!(LinkMeasurements::load(&path).is_some_and(|m| m.fanout.is_none()));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_fan_out_bandwidths_and_collapse_come_from_the_times() {
        // 1 MiB alone in 20 us each way; to 2 peers at once, written in 155 us, read in 40 us:
        // table A's shape (about 52 alone, 13.5 written fanned out, reads held).
        let f = fanout_from_seconds(1 << 20, 2, 20e-6, 20e-6, 155e-6, 40e-6);
        assert!((f.pair_write_gbps - 52.43).abs() < 0.01, "{f:?}");
        assert!((f.fanout_write_gbps - 13.53).abs() < 0.01, "{f:?}");
        assert!((f.fanout_read_gbps - 52.43).abs() < 0.01, "{f:?}");
        assert!((f.write_collapse() - 3.875).abs() < 0.01);
        assert!((f.read_collapse() - 1.0).abs() < 0.01);
    }

    #[test]
    fn fan_out_peers_are_one_per_root_complex_outside_the_source_switch() {
        let load = |name: &str| Topology::fixture(name).unwrap();
        let all = |t: &Topology| (0..t.gpus.len()).collect::<Vec<_>>();
        // 16 GPUs under four switches on four root complexes: GPU 0 fans out to the first GPU
        // of three other switches.
        let a = load("16x-rtx-pro-6000-4switch");
        assert_eq!(
            fanout_peers(&a.locations(), &all(&a), 0),
            Ok(vec![4, 8, 12])
        );
        // Two switches, one per socket: everything outside GPU 0's switch is behind one root
        // complex, so nothing fans out.
        let two = load("8x-rtx-pro-6000-pcie-2switch");
        let why = fanout_peers(&two.locations(), &all(&two), 0).unwrap_err();
        assert!(why.contains("behind 1 root complex"), "{why}");
        // One GPU: said so.
        let why = fanout_peers(&two.locations(), &[0], 0).unwrap_err();
        assert!(why.contains("1 GPU(s) here"), "{why}");
        // Every GPU on its own root complex, two sockets: the next GPUs, one each.
        let d = load("8x-rtx-pro-6000-2socket-broadcom");
        assert_eq!(fanout_peers(&d.locations(), &all(&d), 0), Ok(vec![1, 2, 3]));
    }
}
