//! Whether speculative decoding pays on a machine, from the model's allreduces and the
//! allreduce latency at each size. A verify pass of `k` tokens (draft + 1) does
//! `2 x layers` allreduces of `k x hidden` elements; plain decoding does as many of one token.
//! The report behind tpar: 61 layers, 122 allreduces of ~42 KB at ~200 us each through NCCL,
//! ~24 ms of communication per pass, and speculation at 54.8 tok/s against 90 without it.

use serde::{Deserialize, Serialize};

use super::model::ModelShape;
use tpar::error::{Error, Result};

/// Allreduce latency as a function of message size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Latency {
    /// The same at every size, in microseconds.
    Flat(f64),
    /// Measured (bytes, us) points, ascending; between points the latency is interpolated in
    /// log-size, below and above the ends it is the end value.
    Table(Vec<(u64, f64)>),
}

impl Latency {
    pub fn at(&self, bytes: u64) -> f64 {
        match self {
            Latency::Flat(us) => *us,
            Latency::Table(points) => {
                let Some(first) = points.first() else {
                    return 0.0;
                };
                if bytes <= first.0 {
                    return first.1;
                }
                for pair in points.windows(2) {
                    let ((b0, t0), (b1, t1)) = (pair[0], pair[1]);
                    if bytes <= b1 {
                        let f = ((bytes as f64).ln() - (b0 as f64).ln())
                            / ((b1 as f64).ln() - (b0 as f64).ln());
                        return t0 + f * (t1 - t0);
                    }
                }
                points.last().expect("not empty").1
            }
        }
    }

    /// The fastest correct result per size in a `tpar bench --json` file (any algorithm, NCCL
    /// included), which must have been measured on GPUs (the CUDA backend) with `world_size`
    /// ranks: another rank count or the CPU backend would plan one machine on another's
    /// latencies, so both are refused, naming the file's and the plan's.
    pub fn from_bench_json(text: &str, world_size: u64) -> Result<Latency> {
        let bad = |what: String| Error::InvalidArgument(what);
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not a bench JSON file: {e}")))?;
        let rows = v["results"]
            .as_array()
            .ok_or_else(|| bad("bench JSON has no `results`".into()))?;
        let (Some(backend), Some(ranks)) = (v["backend"].as_str(), v["world_size"].as_u64()) else {
            return Err(bad(
                "has no `backend` and `world_size`: not a file of `tpar bench --json` (bench step, --fused and --anatomy files hold other figures)".into(),
            ));
        };
        if backend != "cuda" || ranks != world_size {
            return Err(bad(format!(
                "was measured with {ranks} rank(s) on the {backend} backend, but the plan is for {world_size} rank(s) on GPUs (-n {world_size}); measure with `tpar bench --backend cuda -n {world_size} --json FILE`, or give --latency-us or --latency-topology"
            )));
        }
        let mut best: std::collections::BTreeMap<u64, f64> = Default::default();
        for r in rows {
            let (Some(bytes), Some(us)) = (r["bytes"].as_u64(), r["p50_us"].as_f64()) else {
                continue;
            };
            if r["correct"] != true || us <= 0.0 || !r["skipped"].is_null() || bytes == 0 {
                continue;
            }
            let e = best.entry(bytes).or_insert(us);
            *e = e.min(us);
        }
        if best.is_empty() {
            return Err(Error::InvalidArgument(
                "bench JSON has no correct, timed row above 0 bytes".into(),
            ));
        }
        Ok(Latency::Table(best.into_iter().collect()))
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpecInputs {
    /// Tokens a verify pass scores: draft tokens + 1.
    pub tokens_per_pass: u64,
    /// Tokens accepted per verify pass on average (acceptance length, including the bonus).
    pub acceptance: f64,
    /// Allreduce latency for the verify pass's sizes.
    pub latency: Latency,
    /// Allreduce latency for plain decoding (one token), if it differs (another path).
    pub plain_latency: Option<Latency>,
    /// Compute of one plain decode step, one verify pass, and the draft, in ms (no allreduce).
    pub plain_compute_ms: f64,
    pub verify_compute_ms: f64,
    pub draft_ms: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpecPlan {
    pub allreduces_per_pass: u64,
    pub verify_allreduce_bytes: u64,
    pub plain_allreduce_bytes: u64,
    pub verify_latency_us: f64,
    pub plain_latency_us: f64,
    pub comm_per_pass_ms: f64,
    pub comm_per_plain_step_ms: f64,
    pub comm_per_accepted_token_ms: f64,
    pub plain_tokens_per_s: f64,
    pub spec_tokens_per_s: f64,
    /// The verify-size allreduce latency at which speculation and plain decoding are equal
    /// (speculation wins below it); `None` when speculation loses even at zero latency.
    pub breakeven_latency_us: Option<f64>,
}

pub fn plan_spec(model: &ModelShape, i: &SpecInputs) -> SpecPlan {
    let n = model.allreduces_per_forward() as f64;
    let verify_bytes = model.allreduce_bytes(i.tokens_per_pass);
    let plain_bytes = model.allreduce_bytes(1);
    let verify_us = i.latency.at(verify_bytes);
    let plain_us = i
        .plain_latency
        .as_ref()
        .unwrap_or(&i.latency)
        .at(plain_bytes);
    let comm_pass = n * verify_us / 1e3;
    let comm_plain = n * plain_us / 1e3;
    let plain_step = i.plain_compute_ms + comm_plain;
    let spec_pass = i.verify_compute_ms + i.draft_ms + comm_pass;
    // acceptance / (verify + draft + n x) = 1 / plain_step  =>  x = (acceptance x plain_step - verify - draft) / n
    let breakeven_ms = (i.acceptance * plain_step - i.verify_compute_ms - i.draft_ms) / n;
    SpecPlan {
        allreduces_per_pass: model.allreduces_per_forward(),
        verify_allreduce_bytes: verify_bytes,
        plain_allreduce_bytes: plain_bytes,
        verify_latency_us: verify_us,
        plain_latency_us: plain_us,
        comm_per_pass_ms: comm_pass,
        comm_per_plain_step_ms: comm_plain,
        comm_per_accepted_token_ms: comm_pass / i.acceptance.max(1e-9),
        plain_tokens_per_s: 1e3 / plain_step,
        spec_tokens_per_s: 1e3 * i.acceptance / spec_pass,
        breakeven_latency_us: (breakeven_ms > 0.0).then_some(breakeven_ms * 1e3),
    }
}

/// Compute time of one forward pass of `tokens` tokens on one rank, from a roofline: the larger
/// of reading this rank's weights at `hbm_gbps` and its arithmetic at `tflops` (decode reads
/// every weight once; MoE reads the active experts' weights of the batch, approximated here by
/// the active parameters).
pub fn roofline_ms(model: &ModelShape, tp: u64, tokens: u64, tflops: f64, hbm_gbps: f64) -> f64 {
    let active = model.active_parameters() as f64 / tp.max(1) as f64;
    let bytes = active * model.weight_bytes;
    let flops = 2.0 * active * tokens as f64;
    (bytes / (hbm_gbps * 1e9)).max(flops / (tflops * 1e12)) * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::MODEL_FIXTURES;

    fn deepseek() -> ModelShape {
        ModelShape::from_config_json(MODEL_FIXTURES[1].1, "deepseek-v3").unwrap()
    }

    fn reported() -> SpecInputs {
        SpecInputs {
            tokens_per_pass: 3,
            acceptance: 2.0,
            latency: Latency::Flat(200.0),
            plain_latency: Some(Latency::Flat(25.0)),
            plain_compute_ms: 8.0,
            verify_compute_ms: 10.0,
            draft_ms: 5.0,
        }
    }

    #[test]
    fn the_reported_case_spends_24_ms_per_pass_and_speculation_loses() {
        let p = plan_spec(&deepseek(), &reported());
        assert_eq!(p.allreduces_per_pass, 122);
        assert_eq!(p.verify_allreduce_bytes, 3 * 7168 * 2); // 42 KiB
        assert!((p.comm_per_pass_ms - 24.4).abs() < 1e-9);
        assert!(p.spec_tokens_per_s < p.plain_tokens_per_s, "{p:?}");
        assert!(
            (p.plain_tokens_per_s - 90.5).abs() < 0.5 && (p.spec_tokens_per_s - 50.8).abs() < 0.5,
            "{p:?}"
        );
        // Speculation pays once the 42 KB allreduce is under ~58 us.
        let b = p.breakeven_latency_us.unwrap();
        assert!((b - 58.2).abs() < 0.5, "{b}");
        let fast = plan_spec(
            &deepseek(),
            &SpecInputs {
                latency: Latency::Flat(b * 0.9),
                ..reported()
            },
        );
        assert!(fast.spec_tokens_per_s > fast.plain_tokens_per_s);
    }

    #[test]
    fn a_bench_table_gives_the_latency_at_each_size() {
        let json = r#"{"backend": "cuda", "world_size": 4, "results": [
            {"bytes": 4096, "algo": "one-shot", "p50_us": 4.0, "correct": true},
            {"bytes": 4096, "algo": "nccl", "p50_us": 20.0, "correct": true},
            {"bytes": 65536, "algo": "one-shot", "p50_us": 8.0, "correct": true},
            {"bytes": 65536, "algo": "two-shot", "p50_us": 1.0, "correct": false}
        ]}"#;
        let l = Latency::from_bench_json(json, 4).unwrap();
        assert_eq!(l, Latency::Table(vec![(4096, 4.0), (65536, 8.0)]));
        assert_eq!(l.at(1024), 4.0);
        assert_eq!(l.at(1 << 20), 8.0);
        assert!((l.at(16384) - 6.0).abs() < 1e-9, "halfway in log-size");
        assert!(Latency::from_bench_json("{}", 4).is_err());
    }

    #[test]
    fn a_bench_file_of_another_world_size_or_backend_is_refused_naming_both() {
        let file = |backend: &str, ranks: u64| {
            format!(
                r#"{{"backend": "{backend}", "world_size": {ranks}, "results": [{{"bytes": 4096, "algo": "one-shot", "p50_us": 4.0, "correct": true}}]}}"#
            )
        };
        let err = Latency::from_bench_json(&file("cpu", 2), 8)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("2 rank(s) on the cpu backend, but the plan is for 8 rank(s) on GPUs"),
            "{err}"
        );
        let err = Latency::from_bench_json(&file("cuda", 2), 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("2 rank(s) on the cuda backend"), "{err}");
        assert!(Latency::from_bench_json(&file("cuda", 8), 8).is_ok());
        let step = r#"{"results": [{"bytes": 4096, "p50_us": 4.0, "correct": true}]}"#;
        let err = Latency::from_bench_json(step, 8).unwrap_err().to_string();
        assert!(err.contains("not a file of `tpar bench --json`"), "{err}");
    }

    #[test]
    fn the_roofline_is_bandwidth_bound_for_decode() {
        let ds = deepseek();
        // 37.5B active / 8 ranks x 1 byte at 1800 GB/s: about 2.6 ms.
        let ms = roofline_ms(&ds, 8, 1, 400.0, 1800.0);
        assert!((ms - 2.6).abs() < 0.2, "{ms}");
        assert!(
            roofline_ms(&ds, 8, 4096, 400.0, 1800.0) > ms,
            "large batches become compute bound"
        );
    }
}
