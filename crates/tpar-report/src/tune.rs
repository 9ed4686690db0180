//! The text of `tpar tune`: the fastest and runner-up choice at each size, the crossovers of
//! the table written, what was not measured, and where the table went.

use tpar_harness::cuda_bench::CudaRow;
use tpar_harness::reports::TuneReport;
use tpar_harness::tune::{crossovers, not_measured, podiums};

use crate::{size, Table};

/// `tpar tune` for `report`, measured at `sizes`; `heading` says the ranks, dtype and machine.
pub fn tune(report: &TuneReport, heading: &str, sizes: &[(u64, usize)]) -> String {
    let rows = &report.measurements;
    let mut t = Table::new(&["size", "fastest", "p50 us", "runner-up", "p50 us"], 2);
    for podium in podiums(rows, sizes) {
        let cell = |r: Option<&CudaRow>| {
            r.map_or(["-".to_owned(), "-".to_owned()], |r| {
                [r.algo.clone(), format!("{:.2}", r.p50_us)]
            })
        };
        let ([a, a_us], [b, b_us]) = (cell(podium.fastest), cell(podium.runner_up));
        t.push(vec![size(podium.bytes), a, a_us, b, b_us]);
    }
    let skipped = not_measured(rows);
    let mut text = format!(
        "tpar tune: {heading}\n{}\n\ncrossovers: {}\n{}wrote {}",
        t.render(),
        crossovers(&report.table),
        if skipped.is_empty() {
            String::new()
        } else {
            format!("not measured: {}\n", skipped.join("; "))
        },
        report.written_to
    );
    if let Some(fused) = &report.fused {
        text.push_str(&fused_text(fused));
    }
    text
}

/// The fused op against allreduce + norm per algorithm and token count, and where the table
/// went.
fn fused_text(fused: &tpar_harness::tune::FusedTuned) -> String {
    let mut t = Table::new(
        &[
            "algorithm",
            "tokens",
            "fused us",
            "allreduce + norm us",
            "runs",
        ],
        2,
    );
    for r in &fused.table.rows {
        t.push(vec![
            r.algorithm.to_string(),
            r.tokens.to_string(),
            format!("{:.2}", r.fused_us),
            format!("{:.2}", r.separate_us),
            if r.fused_us < r.separate_us {
                "fused".into()
            } else {
                "separate".into()
            },
        ]);
    }
    format!(
        "\n\nfused allreduce + residual + RMSNorm, hidden {}, {}:\n{}\n{}{}",
        fused.table.hidden,
        fused.table.dtype,
        t.render(),
        if fused.not_measured.is_empty() {
            String::new()
        } else {
            format!("not measured: {}\n", fused.not_measured.join("; "))
        },
        fused
            .written_to
            .as_ref()
            .map_or("no fused table written".to_owned(), |p| format!(
                "wrote {}",
                p.display()
            ))
    )
}
