//! The text of `tpar doctor`: what the harness's examination of a machine found.

use tpar::memory::human_bytes;
use tpar_harness::doctor::Report;

use crate::{ranks, size, Table};

/// `tpar doctor`: GPUs and versions, the link matrix, the checks, links measured, the memory
/// tpar reserves, and what runs at each size and why.
pub fn doctor(r: &Report) -> String {
    let t = &r.topology;
    let mut out = format!(
        "tpar doctor: {} ({})\ndriver {}, CUDA {}, NCCL {}\n\n",
        t.description,
        r.source,
        t.driver_version.as_deref().unwrap_or("?"),
        t.cuda_version.as_deref().unwrap_or("?"),
        t.nccl_version.as_deref().unwrap_or("not found"),
    );
    let mut gpus = Table::new(&["GPU", "name", "CC", "memory", "PCIe", "NUMA"], 2);
    for g in &t.gpus {
        gpus.push(vec![
            g.index.to_string(),
            g.name.clone(),
            g.compute_capability.clone().unwrap_or_default(),
            human_bytes(g.memory_bytes),
            match (g.pcie_gen, g.pcie_width) {
                (Some(gen), Some(w)) => format!("Gen{gen} x{w}"),
                _ => "?".into(),
            },
            g.numa_node.map_or("?".into(), |n| n.to_string()),
        ]);
    }
    out.push_str(&gpus.render());
    out.push_str("\n\nLinks (path; P2P r = reads, w = writes):\n");
    let header: Vec<String> = std::iter::once(String::new())
        .chain(t.gpus.iter().map(|g| format!("GPU{}", g.index)))
        .collect();
    let header_refs: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut matrix = Table::new(&header_refs, 1);
    for a in &t.gpus {
        let mut row = vec![format!("GPU{}", a.index)];
        for b in &t.gpus {
            row.push(match t.link(a.index, b.index) {
                _ if a.index == b.index => "X".into(),
                Some(l) => format!(
                    "{} {}{}",
                    l.path.label(),
                    if l.p2p_read { "r" } else { "-" },
                    if l.p2p_write { "w" } else { "-" }
                ),
                None => "?".into(),
            });
        }
        matrix.push(row);
    }
    out.push_str(&matrix.render());
    if !r.checks.is_empty() {
        // A described machine's checks are of its description, not of this host.
        let what = if r.source.starts_with("file ") {
            "Checks of the described machine"
        } else {
            "Checks on this machine"
        };
        out.push_str(&format!("\n\n{what}:\n"));
        let mut c = Table::new(&["check", "result"], 2);
        for check in &r.checks {
            c.push(vec![
                check.name.clone(),
                format!(
                    "{}: {}",
                    if check.ok { "ok" } else { "FAILED" },
                    check.detail
                ),
            ]);
        }
        out.push_str(&c.render());
    }
    if let Some(links) = &r.links {
        out.push_str(&format!(
            "\n\nLinks measured, each alone ({} per copy):\n",
            human_bytes(links.bytes_per_copy as u64)
        ));
        let mut t = Table::new(&["from", "to", "push GB/s", "pull GB/s", "latency us"], 2);
        for l in &links.links {
            t.push(vec![
                format!("GPU{}", l.a),
                format!("GPU{}", l.b),
                format!("{:.1}", l.push_gbps),
                format!("{:.1}", l.pull_gbps),
                format!("{:.2}", l.latency_us),
            ]);
        }
        out.push_str(&t.render());
        out.push_str(&format!(
            "\nall links at once, per GPU: push {:.1} GB/s, pull {:.1} GB/s{}",
            links.all_push_gbps,
            links.all_pull_gbps,
            if links.all_push_gbps < 0.5 * links.all_pull_gbps {
                " (writes collapse while reads hold: tpar reads its peers)"
            } else {
                ""
            }
        ));
    }
    out.push_str(&machine_text(r));
    let m = &r.memory_per_rank;
    let ranks = ranks(r.world_size);
    out.push_str(&format!(
        "\n\nMemory tpar reserves per rank with {ranks}: {} device (buffers {} + kernels {}; with an NCCL of its own, `nccl=own`, about {} more, an estimate), {} pinned host, {} shared host (host-staged inboxes); {} in all.\n",
        human_bytes(m.device_bytes),
        human_bytes(m.device_buffer_bytes),
        human_bytes(m.module_bytes),
        human_bytes(tpar::backend::nccl::estimated_footprint(r.world_size, |k| std::env::var(k).ok())),
        human_bytes(m.pinned_host_bytes),
        human_bytes(m.shared_host_bytes),
        human_bytes(m.allocated_bytes()),
    ));
    out.push_str(&format!(
        "\nWhat runs, {ranks}, {} ({}{}):\n",
        r.dtype,
        r.class.describe(),
        r.tuning_table
            .as_ref()
            .map_or(String::new(), |p| format!("; tuning table {p}"))
    ));
    if let Some(t) = &r.ignored_tuning_table {
        out.push_str(&format!(
            "(tuning table {} not read: it timed other kernels, {}, than this build's, {}; `tpar tune` measures this build)\n",
            t.path,
            if t.kernels.is_empty() { "unnamed (written before tables named them)" } else { t.kernels.as_str() },
            t.this_build
        ));
    }
    let modelled = r.decisions.iter().any(|s| s.model_us.is_some());
    let header: &[&str] = if modelled {
        &["size", "algorithm", "model us", "why"]
    } else {
        &["size", "algorithm", "why"]
    };
    let mut p = Table::new(header, header.len());
    for s in &r.decisions {
        let mut row = vec![
            size(s.bytes),
            s.choice.map_or("NONE".into(), |c| c.to_string()),
        ];
        if modelled {
            row.push(s.model_us.map_or("-".into(), |us| format!("{us:.1}")));
        }
        row.push(s.reason.clone());
        p.push(row);
    }
    out.push_str(&p.render());
    if modelled {
        out.push_str("\n(model us: tpar's fabric model of this machine, not a measurement; `tpar bench` and `tpar tune` measure)");
    }
    if !r.ok {
        out.push_str("\n\ntpar cannot work as asked here: see the FAILED checks or the sizes with no algorithm above.");
    }
    out
}

/// The machine's class, its islands and the fan-out figures the model uses, one line each.
fn machine_text(r: &Report) -> String {
    let mut text = format!(
        "\n\nMachine class: {} ({}); islands: {}",
        r.class.name(),
        r.class.describe(),
        r.islands_text()
    );
    if let Some(bytes) = r.islands_all_units_up_to {
        text.push_str(&match bytes {
            0 => "\nIslands exchange: by ranges at every size (three steps)".to_owned(),
            b => format!(
                "\nIslands exchange: all units up to {} (two steps), by ranges above (three)",
                human_bytes(b)
            ),
        });
    }
    if r.class.is_pcie() {
        text.push_str(&format!("\nWrite fan-out: {}", r.collapse.source));
    }
    text.push('\n');
    text
}
