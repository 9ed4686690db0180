//! Arithmetic an operator needs before launching a tensor-parallel server: how much KV cache
//! the engine will get once weights, tpar's buffers and the rest are paid for ([`memory`]),
//! and whether speculative decoding pays with a given allreduce latency ([`spec`]). Both
//! start from a model's shape as its Hugging Face `config.json` gives it ([`model`]).

pub mod capacity;
pub mod latency_model;
pub mod memory;
pub mod model;
pub mod spec;
pub mod step;

/// Bytes per GiB. The engines count memory in GiB and print "GB"; tpar prints GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

/// `12.3 GiB`, with a sign.
pub fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / GIB)
}

/// Shipped model configs: (file stem, JSON).
pub const MODEL_FIXTURES: [(&str, &str); 2] = [
    (
        "llama-3.1-70b",
        include_str!("../../fixtures/models/llama-3.1-70b.json"),
    ),
    (
        "deepseek-v3",
        include_str!("../../fixtures/models/deepseek-v3.json"),
    ),
];
