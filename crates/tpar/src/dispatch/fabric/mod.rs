//! The fabric model: how long each choice takes on a machine, from what it moves and over
//! which links. Pure: no backend, no files.
//!
//! Each of tpar's algorithms is its schedule ([`crate::protocol::schedule`]: the transfers of
//! each step, with their bytes and whether they are written, read or staged through host
//! memory). Each transfer takes a route through the machine: the GPU's own PCIe link, its
//! switch's uplink, the link between sockets, host memory, NVLink, or device memory when
//! both ranks share a GPU. A step lasts its slowest hop's latency, its wait and the polls of
//! its inbound streams, plus the most loaded resource's bytes over that resource's bandwidth.
//! On top of the links, the write fan-out rule (pcie-published.md, table A): when one source
//! (the GPUs under one switch, or a GPU without one) writes to GPUs behind two or more root
//! complexes at once, its writes share a collapsed bandwidth; reads do not collapse. NCCL is
//! its LL (and Simple, and on NVLink LL128) ring with NCCL's own cost constants.
//!
//! Parameters are physical and name their sources ([`params`]); what `tpar doctor` measured
//! on this machine ([`Findings`]) or what a topology file says was measured on the machine it
//! describes ([`crate::topology::Measured`]) replaces the defaults. The model is held against
//! every published table in CI (`published` tests below).

pub mod params;
#[cfg(test)]
mod published;

use serde::Serialize;

use crate::algorithm::{Algorithm, Choice, MAX_RANKS};
use crate::dtype::DType;
use crate::islands::Islands;
use crate::protocol::schedule::{self, Access, Step, Transfer};
use crate::topology::{Findings, Location, MachineClass, Topology};

/// What the model says of one choice for one message.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    pub choice: Choice,
    /// Modelled time of one call, us.
    pub us: f64,
    /// Some step writes from one source to GPUs behind two or more root complexes at once on
    /// a machine whose writes collapse that way.
    pub collapses: bool,
    /// Steps per launch (NCCL: ring steps).
    pub steps: usize,
}

/// Where the collapsed write bandwidth the model uses comes from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Collapse {
    /// Writes of one source fanned out over root complexes, in all, GB/s.
    pub fanout_write_gbps: f64,
    /// Reads of one reader from behind two or more root complexes at once, in all, GB/s.
    pub fanout_read_gbps: f64,
    /// Whether fanned-out writes fall below [`params::COLLAPSED_BELOW`] of fanned-out reads:
    /// writes collapse here (the asymmetry table A measured).
    pub collapses: bool,
    /// Fan-out counted by peer instead of by root complex: what was measured is every GPU
    /// writing to every peer at once, which collapsed on a tree the rule alone would not have
    /// flagged (an unread tree, or one whose layout hides the root complexes).
    pub by_peer: bool,
    /// Where the figure comes from, in words.
    pub source: String,
}

/// A machine and a group of ranks on it, as the model sees them.
pub struct Fabric<'a> {
    topology: &'a Topology,
    world_size: usize,
    gpu_of_rank: Vec<usize>,
    places: Vec<Location>,
    class: MachineClass,
    islands: Option<Islands>,
    cross_via_host: bool,
    link_gbps: Vec<f64>,
    socket_link_gbps: f64,
    collapse: Collapse,
    layout: Layout,
}

/// Indices of the resources a step loads, in one flat array: per GPU, per switch, per pair
/// of sockets and per socket.
struct Layout {
    gpus: usize,
    switches: usize,
    sockets: usize,
}

/// A resource transfers load, and the ones a route crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resource {
    /// A GPU's PCIe link toward the CPU (data leaving the GPU).
    Up(usize),
    /// The same link toward the GPU.
    Down(usize),
    /// Device memory of a GPU its ranks share.
    Local(usize),
    NvOut(usize),
    NvIn(usize),
    /// The collapsed writes (reads) of a GPU without a switch, fanned out over root complexes.
    FanoutWriteGpu(usize),
    FanoutReadGpu(usize),
    SwitchUp(usize),
    SwitchDown(usize),
    /// The same for the GPUs under one switch together.
    FanoutWriteSwitch(usize),
    FanoutReadSwitch(usize),
    /// The link from one socket to another.
    Socket(usize, usize),
    /// Host memory of a socket (pinned buffers).
    Host(usize),
}

/// What a resource is, for its bandwidth.
enum Kind {
    GpuLink(usize),
    Local,
    Nvlink,
    FanoutWrite,
    FanoutRead,
    SwitchLink(usize),
    SocketLink,
    HostMemory,
}

const PER_GPU: usize = 7;
const PER_SWITCH: usize = 4;

impl Layout {
    fn len(&self) -> usize {
        self.gpus * PER_GPU + self.switches * PER_SWITCH + self.sockets * (self.sockets + 1)
    }

    fn index(&self, r: Resource) -> usize {
        let (g, s, k) = (self.gpus, self.switches, self.sockets);
        let switches = PER_GPU * g;
        let sockets = switches + PER_SWITCH * s;
        match r {
            Resource::Up(i) => i,
            Resource::Down(i) => g + i,
            Resource::Local(i) => 2 * g + i,
            Resource::NvOut(i) => 3 * g + i,
            Resource::NvIn(i) => 4 * g + i,
            Resource::FanoutWriteGpu(i) => 5 * g + i,
            Resource::FanoutReadGpu(i) => 6 * g + i,
            Resource::SwitchUp(i) => switches + i,
            Resource::SwitchDown(i) => switches + s + i,
            Resource::FanoutWriteSwitch(i) => switches + 2 * s + i,
            Resource::FanoutReadSwitch(i) => switches + 3 * s + i,
            Resource::Socket(a, b) => sockets + a * k + b,
            Resource::Host(i) => sockets + k * k + i,
        }
    }

    fn kind(&self, index: usize) -> Kind {
        let (g, s, k) = (self.gpus, self.switches, self.sockets);
        let switches = PER_GPU * g;
        let sockets = switches + PER_SWITCH * s;
        match index {
            i if i < 2 * g => Kind::GpuLink(i % g),
            i if i < 3 * g => Kind::Local,
            i if i < 5 * g => Kind::Nvlink,
            i if i < 6 * g => Kind::FanoutWrite,
            i if i < switches => Kind::FanoutRead,
            i if i < switches + 2 * s => Kind::SwitchLink((i - switches) % s),
            i if i < switches + 3 * s => Kind::FanoutWrite,
            i if i < sockets => Kind::FanoutRead,
            i if i < sockets + k * k => Kind::SocketLink,
            _ => Kind::HostMemory,
        }
    }
}

/// A transfer's way through the machine: its latency and the resources its bytes load.
struct Route {
    latency_us: f64,
    resources: [Option<Resource>; 7],
}

impl<'a> Fabric<'a> {
    /// The machine `topology` with `world_size` ranks placed round-robin, and what was
    /// measured on it (`findings`: `tpar doctor`'s link measurement).
    pub fn new(topology: &'a Topology, world_size: usize, findings: Option<&Findings>) -> Self {
        let gpu_of_rank = topology.placement(world_size);
        Self::for_gpus(topology, &gpu_of_rank, findings)
    }

    /// As [`Fabric::new`] with rank r on GPU `gpu_of_rank[r]`.
    pub fn for_gpus(
        topology: &'a Topology,
        gpu_of_rank: &[usize],
        findings: Option<&Findings>,
    ) -> Self {
        let places = topology.locations();
        let measured = topology.measured.as_ref();
        let link_gbps: Vec<f64> = topology
            .gpus
            .iter()
            .map(|g| {
                measured
                    .and_then(|m| m.link_gbps)
                    .unwrap_or_else(|| params::pcie_gbps(g.pcie_gen, g.pcie_width))
            })
            .collect();
        let slowest_link = link_gbps.iter().copied().fold(f64::INFINITY, f64::min);
        let collapse = collapse(topology, findings, slowest_link);
        let islands = topology.islands_for_gpus(gpu_of_rank);
        let cross_via_host = islands
            .as_ref()
            .is_some_and(|i| topology.exchange_via_host(gpu_of_rank, i));
        let layout = Layout {
            gpus: topology.gpus.len().max(1),
            switches: places
                .iter()
                .filter_map(|p| p.switch)
                .max()
                .map_or(1, |m| m + 1),
            sockets: places.iter().map(|p| p.socket).max().map_or(1, |m| m + 1),
        };
        Fabric {
            topology,
            world_size: gpu_of_rank.len(),
            gpu_of_rank: gpu_of_rank.to_vec(),
            class: topology.class_of_gpus(gpu_of_rank),
            places,
            islands,
            cross_via_host,
            link_gbps,
            socket_link_gbps: measured
                .and_then(|m| m.socket_link_gbps)
                .unwrap_or(params::SOCKET_LINK_GBPS),
            collapse,
            layout,
        }
    }

    pub fn class(&self) -> MachineClass {
        self.class
    }

    /// The islands the islands algorithms are modelled on (`None` above [`MAX_RANKS`]).
    pub fn islands(&self) -> Option<Islands> {
        self.islands
    }

    /// Whether the islands' exchange goes through host memory.
    pub fn cross_via_host(&self) -> bool {
        self.cross_via_host
    }

    pub fn collapse(&self) -> &Collapse {
        &self.collapse
    }

    /// The model's estimate of `choice` for one call of `bytes` of `dtype`; `None` where it
    /// cannot be modelled (tpar above [`MAX_RANKS`] ranks, NCCL with ranks sharing a GPU, a
    /// machine without GPUs).
    pub fn estimate(&self, choice: Choice, dtype: DType, bytes: u64) -> Option<Estimate> {
        if self.places.is_empty() {
            return None;
        }
        match choice {
            Choice::Nccl => self.nccl(bytes),
            Choice::Tpar(algorithm) => self.tpar(algorithm, dtype, bytes),
        }
    }

    /// Every choice the model can cost, fastest first (ties in [`Choice::ALL`]'s order).
    pub fn rank(&self, dtype: DType, bytes: u64) -> Vec<Estimate> {
        let mut all: Vec<Estimate> = Choice::ALL
            .into_iter()
            .filter_map(|c| self.estimate(c, dtype, bytes))
            .collect();
        all.sort_by(|a, b| a.us.total_cmp(&b.us));
        all
    }

    fn tpar(&self, algorithm: Algorithm, dtype: DType, bytes: u64) -> Option<Estimate> {
        let n = self.world_size;
        if n == 0 || n > MAX_RANKS {
            return None;
        }
        // The PCIe-fabric algorithms exist to keep writes from fanning out where they collapse;
        // on NVLink and on one GPU nothing collapses and they only add steps. Measured on one
        // H200 with 8 ranks sharing it (2026-12-02, bench/results/2026-12-02-h200-s6-primitives):
        // staged 9.7 and islands (4+4) 9.6 us at 4 KiB against one-shot's 4.9, the ring 100.7
        // us at 1 MiB against two-shot's 49.2, where this model costed them below one-shot.
        // So they are not costed there, and auto never runs them there. (Since a ring launch
        // carries n chunks, 2026-12-06, one H200, bench/results/2026-12-06-s12 call 1: f32
        // 37.6 us at 1 MiB against two-shot's 45.0, but bf16 59.8 against 45.4, its f32
        // partials being twice the data: `tpar tune` measures it where it pays.)
        if is_pcie_fabric_algorithm(algorithm)
            && matches!(self.class(), MachineClass::OneGpu | MachineClass::Nvlink)
        {
            return None;
        }
        let islands = match algorithm {
            Algorithm::Islands | Algorithm::IslandsPull => self.islands?,
            _ => Islands::single(n),
        };
        // The schedule at one unit: which transfers it makes, whatever the size.
        let shape = schedule::steps(algorithm, &islands, dtype, 8 * n, self.cross_via_host);
        if !shape
            .iter()
            .flat_map(|s| s.transfers.iter())
            .all(|t| self.reachable(t))
        {
            return None;
        }
        // The islands algorithm runs its all-units form on the launches the model bounds it
        // to (what the CUDA communicator does with the same bound).
        let all_units_up_to = if algorithm == Algorithm::Islands {
            self.islands_all_units_launch_max_bytes(dtype)
        } else {
            0
        };
        let launch = |payload: u64| -> (f64, bool, usize) {
            let steps = if payload > 0 && payload as usize <= all_units_up_to {
                schedule::islands_all_units(&islands, dtype, payload as usize, self.cross_via_host)
            } else {
                schedule::steps(
                    algorithm,
                    &islands,
                    dtype,
                    payload as usize,
                    self.cross_via_host,
                )
            };
            let (us, collapses) = self.launch_us(&steps);
            (us, collapses, steps.len())
        };
        // A call is cut into launches as the CUDA communicator cuts it.
        let chunk = (schedule::launch_units(
            algorithm,
            &islands,
            dtype,
            params::CHUNK_BYTES as usize / schedule::UNIT_BYTES,
        ) * schedule::UNIT_BYTES) as u64;
        let (full, rest) = (bytes / chunk, bytes % chunk);
        let mut us = 0.0;
        let mut collapses = false;
        let mut steps = 0;
        if full > 0 {
            let (t, c, s) = launch(chunk);
            us += full as f64 * t;
            collapses |= c;
            steps = s;
        }
        if rest > 0 || full == 0 {
            let (t, c, s) = launch(rest);
            us += t;
            collapses |= c;
            steps = steps.max(s);
        }
        Some(Estimate {
            choice: Choice::Tpar(algorithm),
            us,
            collapses,
            steps,
        })
    }

    /// One kernel launch of `steps`, us, and whether a step collapses.
    fn launch_us(&self, steps: &[Step]) -> (f64, bool) {
        steps
            .iter()
            .map(|step| self.step_us(step))
            .fold((params::CALL_US, false), |(us, c), (t, d)| (us + t, c || d))
    }

    /// Whether the machine can make `t` at all: through host memory always; between two GPUs
    /// only with peer writes (reads) between them.
    fn reachable(&self, t: &Transfer) -> bool {
        let (a, b) = (self.gpu_of_rank[t.from], self.gpu_of_rank[t.to]);
        t.via_host
            || a == b
            || self.topology.link(a, b).is_some_and(|l| match t.access {
                Access::Write => l.p2p_write,
                Access::Read => l.p2p_read,
            })
    }

    /// The largest call, in bytes of `dtype`, up to which the islands algorithm should take
    /// its all-units form ([`schedule::islands_all_units`]): the form saves a step and sends
    /// each island's partial to every member of the other islands instead of once. On one GPU
    /// and on NVLink the bytes between islands cost next to nothing: every size (one H200, 8
    /// ranks sharing it, 4+4: faster at every size from 4 to 64 KiB, bench/README.md "Eighth
    /// session"). On a PCIe fabric, the largest power of two from 4 KiB to 1 MiB up to which the
    /// model costs it no slower than the ranges form (0 where it is slower at 4 KiB already).
    pub fn islands_all_units_max_bytes(&self, dtype: DType) -> usize {
        if matches!(self.class(), MachineClass::OneGpu | MachineClass::Nvlink) {
            return usize::MAX;
        }
        let Some(islands) = self.islands.filter(|i| i.count() >= 2) else {
            return 0;
        };
        let mut fits = 0;
        for bytes in (12..=20).map(|p| 1usize << p) {
            let ranges = schedule::steps(
                Algorithm::Islands,
                &islands,
                dtype,
                bytes,
                self.cross_via_host,
            );
            let all = schedule::islands_all_units(&islands, dtype, bytes, self.cross_via_host);
            if self.launch_us(&all).0 > self.launch_us(&ranges).0 {
                break;
            }
            fits = bytes;
        }
        fits
    }

    /// [`Fabric::islands_all_units_max_bytes`] within one launch of the all-units form: the
    /// largest call that takes it (0 where there are no islands or the model never chooses it).
    pub fn islands_all_units_launch_max_bytes(&self, dtype: DType) -> usize {
        if self.islands.is_none_or(|i| i.count() < 2) {
            return 0;
        }
        self.islands_all_units_max_bytes(dtype)
            .min(schedule::partials_fitting(
                params::CHUNK_BYTES as usize,
                dtype,
            ))
    }

    /// The time of a plain push of `bytes` (no LL tags: the data, then a flag) from every rank
    /// to every other at once: the "flat push custom allreduce" of the published tables D and
    /// E, which tpar's one-shot schedule describes with half its bytes.
    pub fn flat_push(&self, bytes: u64) -> Estimate {
        let islands = Islands::single(self.world_size.clamp(1, MAX_RANKS));
        let mut steps = schedule::steps(
            Algorithm::OneShot,
            &islands,
            DType::F32,
            bytes as usize,
            false,
        );
        for t in steps.iter_mut().flat_map(|s| s.transfers.iter_mut()) {
            t.bytes /= 2;
        }
        let (us, collapses) = self.launch_us(&steps);
        Estimate {
            choice: Choice::Tpar(Algorithm::OneShot),
            us,
            collapses,
            steps: steps.len(),
        }
    }

    /// Bandwidth of `transfers` running at once (one step), GB/s of their bytes in all, and
    /// whether they collapse: for holding the bandwidth tables.
    pub fn concurrent_gbps(&self, transfers: &[Transfer]) -> (f64, bool) {
        let step = Step {
            transfers: transfers.to_vec(),
        };
        let (load, collapses) = self.bandwidth_us(&step);
        let bytes: u64 = transfers.iter().map(|t| t.bytes).sum();
        (bytes as f64 / (load * 1e3), collapses)
    }

    /// One step's time, us, and whether it collapses. tpar's hops through host memory
    /// (host-staged, the islands' exchange without P2P) pay [`params::TPAR_HOST_EXTRA_US`].
    fn step_us(&self, step: &Step) -> (f64, bool) {
        let mut latency: f64 = 0.0;
        let mut inbound = vec![(0usize, 0.0f64); self.world_size];
        for t in &step.transfers {
            let route = self.route(t);
            let hop = route.latency_us;
            // A peer read is a round trip for the flag that says the data is there and another
            // for the data, and each stream read costs a round trip to poll; through host
            // memory the hop already holds the round trips, and a poll is one host read.
            let (hop, poll) = match (t.via_host, t.access) {
                (true, Access::Write) => (hop + params::TPAR_HOST_EXTRA_US, params::INBOUND_US),
                (true, Access::Read) => (hop + params::TPAR_HOST_EXTRA_US, params::HOST_READ_US),
                (false, Access::Write) => (hop, params::INBOUND_US),
                (false, Access::Read) => (4.0 * hop, 2.0 * hop),
            };
            latency = latency.max(hop);
            let slot = &mut inbound[t.to];
            slot.0 += 1;
            slot.1 += poll;
        }
        let polls = inbound.iter().map(|i| i.1).fold(0.0, f64::max);
        let (load, collapses) = self.bandwidth_us(step);
        (latency + params::STEP_US + polls + load, collapses)
    }

    /// The most loaded resource's bytes over its bandwidth, us, and whether a source's writes
    /// fan out over root complexes on a machine where that collapses.
    fn bandwidth_us(&self, step: &Step) -> (f64, bool) {
        let mut load = vec![0.0f64; self.layout.len()];
        for t in &step.transfers {
            let route = self.route(t);
            for r in route.resources.iter().flatten() {
                load[self.layout.index(*r)] += t.bytes as f64;
            }
        }
        let mut collapses = false;
        for (source, bytes, access) in self.fanned_out(step) {
            load[self.layout.index(source)] += bytes;
            collapses |= access == Access::Write && self.collapse.collapses;
        }
        let mut worst: f64 = 0.0;
        for (i, bytes) in load.iter().enumerate() {
            if *bytes > 0.0 {
                worst = worst.max(bytes / (self.bandwidth_of(i) * 1e3));
            }
        }
        (worst, collapses)
    }

    /// The sources (a switch, or a GPU without one) whose P2P writes in `step` go to GPUs
    /// behind two or more root complexes, with the bytes of those writes; and the readers
    /// (the same) that read from behind two or more at once.
    fn fanned_out(&self, step: &Step) -> Vec<(Resource, f64, Access)> {
        let mut sources: Vec<(Resource, Vec<usize>, f64, Access)> = Vec::new();
        for t in &step.transfers {
            if t.via_host {
                continue;
            }
            let (a, b) = (self.gpu_of_rank[t.from], self.gpu_of_rank[t.to]);
            if a == b || self.topology.link(a, b).is_some_and(|l| l.nvlink) {
                continue;
            }
            // The side that issues the transfer, and the side across the fabric.
            let (mine, theirs) = match t.access {
                Access::Write => (a, b),
                Access::Read => (b, a),
            };
            let (pm, pt) = (self.places[mine], self.places[theirs]);
            let source = match (pm.switch, t.access) {
                (Some(s), _) if pt.switch == Some(s) => continue,
                (Some(s), Access::Write) => Resource::FanoutWriteSwitch(s),
                (Some(s), Access::Read) => Resource::FanoutReadSwitch(s),
                (None, Access::Write) => Resource::FanoutWriteGpu(mine),
                (None, Access::Read) => Resource::FanoutReadGpu(mine),
            };
            let behind = if self.collapse.by_peer {
                theirs
            } else {
                pt.root_complex
            };
            match sources.iter_mut().find(|x| x.0 == source) {
                Some((_, complexes, bytes, _)) => {
                    if !complexes.contains(&behind) {
                        complexes.push(behind);
                    }
                    *bytes += t.bytes as f64;
                }
                None => sources.push((source, vec![behind], t.bytes as f64, t.access)),
            }
        }
        sources
            .into_iter()
            .filter(|x| x.1.len() >= 2)
            .map(|(s, _, bytes, access)| (s, bytes, access))
            .collect()
    }

    fn bandwidth_of(&self, index: usize) -> f64 {
        let gpu_link = |i: usize| self.link_gbps.get(i).copied().unwrap_or(53.0);
        match self.layout.kind(index) {
            Kind::GpuLink(g) => gpu_link(g),
            Kind::Local => params::LOCAL_GBPS,
            Kind::Nvlink => params::NVLINK_GBPS,
            Kind::FanoutWrite => self.collapse.fanout_write_gbps,
            Kind::FanoutRead => self.collapse.fanout_read_gbps,
            // A switch's uplink: as fast as the fastest GPU link under it.
            Kind::SwitchLink(switch) => self
                .places
                .iter()
                .enumerate()
                .filter(|(_, p)| p.switch == Some(switch))
                .map(|(gpu, _)| gpu_link(gpu))
                .fold(1.0, f64::max),
            Kind::SocketLink => self.socket_link_gbps,
            Kind::HostMemory => params::HOST_MEMORY_GBPS,
        }
    }

    /// The route of one transfer: its data flows from `t.from`'s GPU to `t.to`'s.
    fn route(&self, t: &Transfer) -> Route {
        let (a, b) = (self.gpu_of_rank[t.from], self.gpu_of_rank[t.to]);
        let (pa, pb) = (self.places[a], self.places[b]);
        let mut resources: [Option<Resource>; 7] = [None; 7];
        let mut k = 0;
        let mut add = |r: Resource| {
            resources[k] = Some(r);
            k += 1;
        };
        let cross_socket = pa.socket != pb.socket;
        if t.via_host {
            add(Resource::Up(a));
            if let Some(s) = pa.switch {
                add(Resource::SwitchUp(s));
            }
            add(Resource::Host(pb.socket));
            if cross_socket {
                add(Resource::Socket(pa.socket, pb.socket));
            }
            if let Some(s) = pb.switch {
                add(Resource::SwitchDown(s));
            }
            add(Resource::Down(b));
            let latency_us = params::HOST_HOP_US
                + if cross_socket {
                    params::CROSS_SOCKET_US
                } else {
                    0.0
                };
            return Route {
                latency_us,
                resources,
            };
        }
        if a == b {
            add(Resource::Local(a));
            return Route {
                latency_us: params::LOCAL_HOP_US,
                resources,
            };
        }
        let link = self.topology.link(a, b);
        if link.is_some_and(|l| l.nvlink) {
            add(Resource::NvOut(a));
            add(Resource::NvIn(b));
            return Route {
                latency_us: params::hop_us(crate::topology::PathClass::Nvlink),
                resources,
            };
        }
        add(Resource::Up(a));
        let same_switch = pa.switch.is_some() && pa.switch == pb.switch;
        if !same_switch {
            if let Some(s) = pa.switch {
                add(Resource::SwitchUp(s));
            }
            if cross_socket {
                add(Resource::Socket(pa.socket, pb.socket));
            }
            if let Some(s) = pb.switch {
                add(Resource::SwitchDown(s));
            }
        }
        add(Resource::Down(b));
        Route {
            latency_us: link.map_or(params::hop_us(crate::topology::PathClass::CrossNuma), |l| {
                params::hop_us(l.path)
            }),
            resources,
        }
    }

    /// NCCL's ring: LL, Simple and (on NVLink) LL128, the fastest of them, with NCCL's own
    /// constants and this machine's slowest ring hop and most loaded resource. NCCL uses P2P
    /// up to PXB paths and host shared memory beyond (pcie-published.md, table D's note).
    fn nccl(&self, bytes: u64) -> Option<Estimate> {
        let n = self.world_size;
        let mut gpus = self.gpu_of_rank.clone();
        gpus.sort_unstable();
        gpus.dedup();
        if n == 0 || gpus.len() != n {
            return None;
        }
        if n == 1 {
            return Some(Estimate {
                choice: Choice::Nccl,
                us: params::nccl::LL_BASE_US,
                collapses: false,
                steps: 0,
            });
        }
        // The ring in the machine's order: socket, root complex, switch, GPU.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&r| {
            let g = self.gpu_of_rank[r];
            let p = self.places[g];
            (p.socket, p.root_complex, p.switch, g)
        });
        let ring: Vec<Transfer> = (0..n)
            .map(|i| {
                let (from, to) = (order[i], order[(i + 1) % n]);
                let (a, b) = (self.gpu_of_rank[from], self.gpu_of_rank[to]);
                let p2p = self.topology.link(a, b).is_some_and(|l| {
                    l.nvlink
                        || (l.p2p_write
                            && l.p2p_read
                            && l.path <= crate::topology::PathClass::MultipleSwitches)
                });
                Transfer {
                    from,
                    to,
                    bytes: 1 << 20,
                    access: Access::Write,
                    via_host: !p2p,
                }
            })
            .collect();
        let hop = ring
            .iter()
            .map(|t| self.route(t).latency_us)
            .fold(0.0, f64::max);
        let (per_mib, _) = self.bandwidth_us(&Step {
            transfers: ring.clone(),
        });
        let nvlink = self.class == MachineClass::Nvlink;
        let steps = 2 * (n - 1);
        // Each rank's link carries 2(n-1)/n of the message (twice that in LL lines).
        let ring_bytes = steps as f64 / n as f64 * bytes as f64;
        let wire_us = |factor: f64| ring_bytes * factor / f64::from(1u32 << 20) * per_mib;
        let extra = if nvlink { 0.0 } else { hop };
        use params::nccl::*;
        let ll = LL_BASE_US
            + steps as f64
                * (if nvlink {
                    LL_STEP_NVLINK_US
                } else {
                    LL_STEP_PCIE_US
                } + extra)
            + wire_us(2.0);
        let simple = SIMPLE_BASE_US
            + steps as f64
                * (if nvlink {
                    SIMPLE_STEP_NVLINK_US
                } else {
                    SIMPLE_STEP_PCIE_US
                } + extra)
            + wire_us(1.0);
        let ll128 = if nvlink {
            LL128_BASE_US + steps as f64 * LL128_STEP_NVLINK_US + wire_us(1.0 / LL128_PAYLOAD)
        } else {
            f64::INFINITY
        };
        Some(Estimate {
            choice: Choice::Nccl,
            us: ll.min(simple).min(ll128),
            collapses: false,
            steps,
        })
    }
}

/// The fanned-out bandwidths to model with: what `tpar doctor` measured (the fan-out, else the
/// push and pull with every link busy), else what the topology file says was measured, else
/// the worst published for writes (reads at the link's bandwidth).
fn collapse(topology: &Topology, findings: Option<&Findings>, link_gbps: f64) -> Collapse {
    let link = if link_gbps.is_finite() {
        link_gbps
    } else {
        params::pcie_gbps(None, None)
    };
    let make = |write: f64, read: f64, source: String| Collapse {
        fanout_write_gbps: write,
        fanout_read_gbps: read,
        collapses: write < params::COLLAPSED_BELOW * read,
        by_peer: false,
        source,
    };
    let fanout = |f: &crate::topology::Fanout, whose: &str| {
        make(
            f.fanout_write_gbps,
            f.fanout_read_gbps,
            format!(
                "writes fanned out over root complexes {:.1} GB/s against {:.1} alone ({:.1}x), reads {:.1}: {whose}",
                f.fanout_write_gbps,
                f.pair_write_gbps,
                f.write_collapse(),
                f.fanout_read_gbps
            ),
        )
    };
    if let Some(f) = findings.and_then(|f| f.fanout.as_ref()) {
        return fanout(f, "measured here by tpar doctor");
    }
    if let Some((push, pull)) = findings.and_then(|f| Some((f.push_gbps?, f.pull_gbps?))) {
        let mut c = make(
            push,
            pull,
            format!(
                "every GPU to every peer at once, measured here by tpar doctor: push {push:.1}, pull {pull:.1} GB/s per GPU"
            ),
        );
        c.by_peer = c.collapses;
        return c;
    }
    if let Some(m) = &topology.measured {
        if let Some(f) = &m.fanout {
            return fanout(f, &m.source);
        }
    }
    make(
        params::FANOUT_WRITE_GBPS,
        link,
        format!(
            "not measured here: writes fanned out over root complexes assumed to collapse to {} GB/s (the worst published: table C of crates/tpar/fixtures/published) until `tpar doctor` measures them",
            params::FANOUT_WRITE_GBPS
        ),
    )
}

/// The algorithms built for PCIe fabrics whose posted writes collapse under fan-out: staged,
/// islands and the ring, push and pull.
pub fn is_pcie_fabric_algorithm(algorithm: Algorithm) -> bool {
    matches!(
        algorithm,
        Algorithm::Staged
            | Algorithm::StagedPull
            | Algorithm::Islands
            | Algorithm::IslandsPull
            | Algorithm::Ring
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::FIXTURES;

    fn fixture(name: &str) -> Topology {
        Topology::fixture(name).unwrap()
    }

    const KIB: u64 = 1024;

    #[test]
    fn every_choice_has_a_positive_estimate_that_grows_with_size() {
        for (name, _) in FIXTURES {
            let t = fixture(name);
            for n in [2, 4, 8, 12, 16] {
                let fabric = Fabric::new(&t, n, None);
                for choice in Choice::ALL {
                    let small = fabric.estimate(choice, DType::Bf16, 4 * KIB);
                    let large = fabric.estimate(choice, DType::Bf16, 64 << 20);
                    match (small, large) {
                        (Some(s), Some(l)) => {
                            assert!(
                                s.us > 0.0 && l.us > s.us,
                                "{name} n={n} {choice}: {s:?} {l:?}"
                            )
                        }
                        (None, None) => {}
                        other => panic!("{name} n={n} {choice}: {other:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn a_write_to_peers_behind_two_root_complexes_collapses_and_a_read_does_not() {
        let d = fixture("8x-rtx-pro-6000-2socket-broadcom");
        let fabric = Fabric::new(&d, 8, None);
        let one = fabric.estimate(Choice::Tpar(Algorithm::OneShot), DType::Bf16, 16 * KIB);
        assert!(one.unwrap().collapses);
        for algorithm in [
            Algorithm::Staged,
            Algorithm::StagedPull,
            Algorithm::Ring,
            Algorithm::OneShotPull,
            Algorithm::IslandsPull,
        ] {
            let e = fabric
                .estimate(Choice::Tpar(algorithm), DType::Bf16, 16 * KIB)
                .unwrap();
            assert!(!e.collapses, "{algorithm}: {e:?}");
        }
        // The two-switch machine: GPU 0's switch writes only to the other socket's root
        // complex, so one-shot fans out over one root complex and does not collapse.
        let pro = fixture("8x-rtx-pro-6000-pcie-2switch");
        let fabric = Fabric::new(&pro, 8, None);
        let one = fabric.estimate(Choice::Tpar(Algorithm::OneShot), DType::Bf16, 16 * KIB);
        assert!(!one.unwrap().collapses);
    }

    #[test]
    fn the_islands_all_units_form_is_bounded_where_bytes_between_islands_cost() {
        let print = std::env::var("TPAR_PRINT_MODEL").is_ok();
        for (name, _) in FIXTURES {
            let t = fixture(name);
            let fabric = Fabric::new(&t, 8.min(t.gpus.len()), None);
            let bound = fabric.islands_all_units_max_bytes(DType::Bf16);
            if print {
                eprintln!("{name}: {:?} all units up to {bound}", fabric.class());
            }
            match fabric.class() {
                MachineClass::OneGpu | MachineClass::Nvlink => {
                    assert_eq!(bound, usize::MAX, "{name}")
                }
                // A PCIe fabric: a bound the model chose, never past 1 MiB.
                _ => assert!(bound <= 1 << 20, "{name}: {bound}"),
            }
        }
        // On a PCIe fabric the bound is where the model's two forms cross: the all-units form
        // no slower at the bound, slower at the next size (or the bound is the largest tried).
        for (name, _) in FIXTURES {
            let t = fixture(name);
            let fabric = Fabric::new(&t, 8.min(t.gpus.len()), None);
            let (Some(islands), false) = (
                fabric.islands().filter(|i| i.count() >= 2),
                matches!(fabric.class(), MachineClass::OneGpu | MachineClass::Nvlink),
            ) else {
                continue;
            };
            let bound = fabric.islands_all_units_max_bytes(DType::Bf16);
            let cost = |all: bool, bytes: usize| {
                let steps = if all {
                    schedule::islands_all_units(&islands, DType::Bf16, bytes, fabric.cross_via_host)
                } else {
                    schedule::steps(
                        Algorithm::Islands,
                        &islands,
                        DType::Bf16,
                        bytes,
                        fabric.cross_via_host,
                    )
                };
                fabric.launch_us(&steps).0
            };
            if bound > 0 {
                assert!(cost(true, bound) <= cost(false, bound), "{name} at {bound}");
            }
            let next = if bound == 0 { 4096 } else { 2 * bound };
            if next <= 1 << 20 {
                assert!(cost(true, next) > cost(false, next), "{name} at {next}");
            }
        }
    }
}
