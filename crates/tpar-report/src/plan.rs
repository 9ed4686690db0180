//! The text of `tpar plan`: the KV-cache memory plan with every term, and whether speculative
//! decoding pays at the allreduce latency given.

use tpar_harness::planner::capacity::{MemoryReport, SpecReport};
use tpar_harness::planner::{gib, GIB};

use crate::Table;

/// `tpar plan memory` for `engine` (its name as people write it: SGLang, vLLM).
pub fn memory(report: &MemoryReport, engine: &str) -> String {
    let (inputs, plan) = (&report.inputs, &report.plan);
    let mut t = Table::new(&["term", "GiB", "what"], 1).text_last();
    for term in &plan.terms {
        t.push(vec![
            term.name.clone(),
            format!("{:+.2}", term.bytes / GIB),
            term.note.clone(),
        ]);
    }
    let attention = if report.mla { "MLA latent" } else { "K and V" };
    format!(
        "tpar plan memory: {} ({:.1}B parameters, {:.1} GiB of weights per rank at TP {}), {} GPU of {}\n{}{}\n\nKV budget {} = {} tokens of {} bytes each ({attention}, {} bytes per element){}",
        report.model,
        report.parameters as f64 / 1e9,
        inputs.weights_bytes / GIB,
        report.tp,
        engine,
        gib(inputs.gpu_total_bytes),
        if report.notes.is_empty() {
            String::new()
        } else {
            format!("read from the config: {}\n", report.notes.join("; "))
        },
        t.render(),
        gib(plan.kv_budget_bytes),
        plan.kv_tokens,
        inputs.kv_bytes_per_token,
        report.kv_bytes,
        plan.problem.as_ref().map_or(String::new(), |p| format!("\n\nDOES NOT FIT: {p}"))
    )
}

/// `tpar plan spec-decode`.
pub fn spec(report: &SpecReport) -> String {
    let p = &report.plan;
    let verdict = if p.spec_tokens_per_s > p.plain_tokens_per_s {
        "speculation wins"
    } else {
        "speculation LOSES"
    };
    format!(
        "tpar plan spec-decode: {} at TP {}, {} tokens per verify pass, acceptance {}\n\
         allreduces per pass: {} of {} B (verify) / {} B (plain step)\n\
         allreduce latency: {:.1} us (verify size), {:.1} us (plain size)\n\
         communication: {:.2} ms per verify pass, {:.2} ms per accepted token, {:.2} ms per plain step\n\
         tokens/s: {:.1} with speculation, {:.1} without: {verdict}\n\
         break-even: {}\n{}",
        report.model,
        report.tp,
        report.inputs.tokens_per_pass,
        report.inputs.acceptance,
        p.allreduces_per_pass,
        p.verify_allreduce_bytes,
        p.plain_allreduce_bytes,
        p.verify_latency_us,
        p.plain_latency_us,
        p.comm_per_pass_ms,
        p.comm_per_accepted_token_ms,
        p.comm_per_plain_step_ms,
        p.spec_tokens_per_s,
        p.plain_tokens_per_s,
        p.breakeven_latency_us.map_or("speculation loses even with free allreduces (compute alone)".to_owned(), |us| format!(
            "speculation pays while the {} B allreduce takes under {us:.1} us",
            p.verify_allreduce_bytes
        )),
        if report.assumptions.is_empty() { String::new() } else { format!("assumed: {}", report.assumptions.join("; ")) }
    )
}
