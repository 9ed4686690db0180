//! The text of `tpar bench step`: one tensor-parallel pass timed with each way of reducing.

use tpar::memory::human_bytes;
use tpar_harness::reports::StepReport;

use crate::{name_with_runs, ranks, skipped_row, Table};

/// `tpar bench step`: what the pass holds, a row per way of reducing, and a note when ranks
/// share GPUs.
pub fn step(report: &StepReport) -> String {
    let mut table = Table::new(
        &[
            "allreduce",
            "norms",
            "pass p50 us",
            "pass p99 us",
            "communication us",
            "share",
            "per allreduce us",
        ],
        1,
    );
    for r in &report.results {
        if let Some(why) = &r.skipped {
            table.push(skipped_row(vec![r.reduce.clone()], 7, why));
            continue;
        }
        let name = name_with_runs(&r.reduce, r.runs.as_deref());
        let compute = r.reduce.starts_with("none");
        table.push(vec![
            name,
            r.norms.clone(),
            format!("{:.1}", r.pass_p50_us),
            format!("{:.1}", r.pass_p99_us),
            if compute {
                "-".into()
            } else {
                format!("{:.1}", r.communication_us)
            },
            if compute {
                "-".into()
            } else {
                format!("{:.1}%", 100.0 * r.communication_share)
            },
            if compute {
                "-".into()
            } else {
                format!("{:.2}", r.per_allreduce_us)
            },
        ]);
    }
    let sharing = if report.gpus < report.tp {
        format!(
            "\nnote: {} ranks share {} GPU(s): every rank's GEMMs run on the same GPU, so the pass is not a TP-{} machine's; the real use is one GPU per rank",
            report.tp, report.gpus, report.tp
        )
    } else {
        String::new()
    };
    format!(
        "tpar bench step: {}, TP {}, {} token(s) per pass, {} layers: {} GEMMs, {} allreduces of {} bf16 and {} residual add + RMSNorms per pass; {}, {} ({})\n{}{}",
        report.model,
        report.tp,
        report.tokens,
        report.layers,
        report.gemms_per_pass,
        report.allreduces_per_pass,
        human_bytes(report.allreduce_bytes),
        report.norms_per_pass,
        report.provenance.device,
        ranks(report.tp),
        report.mode,
        table.render(),
        sharing
    )
}
