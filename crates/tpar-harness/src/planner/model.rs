//! A transformer's shape, read from a Hugging Face `config.json`: layers, hidden size, heads,
//! KV heads, head dim, MLP size, vocabulary, and the MLA (DeepSeek) and MoE fields where
//! present. From it: parameters, weight bytes per rank, KV-cache bytes per token per rank, and
//! the allreduces of one forward pass.

use serde_json::Value;

use tpar::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct Mla {
    pub kv_lora_rank: u64,
    pub qk_rope_head_dim: u64,
    pub qk_nope_head_dim: u64,
    pub v_head_dim: u64,
    pub q_lora_rank: Option<u64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    pub routed_experts: u64,
    pub experts_per_token: u64,
    pub shared_experts: u64,
    pub moe_intermediate: u64,
    /// The first layers keep a dense MLP (`first_k_dense_replace`).
    pub dense_layers: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelShape {
    pub name: String,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub tied_embeddings: bool,
    /// Bytes per stored weight: 2 for bf16/fp16, 1 for fp8-quantised checkpoints.
    pub weight_bytes: f64,
    /// Bytes per activation element (`torch_dtype`): what the allreduces carry.
    pub activation_bytes: u64,
    pub mla: Option<Mla>,
    pub moe: Option<Moe>,
}

fn field(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

impl ModelShape {
    pub fn from_config_json(text: &str, name: &str) -> Result<ModelShape> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("{name}: not JSON: {e}")))?;
        let need = |key: &str| {
            field(&v, key).ok_or_else(|| {
                Error::InvalidArgument(format!("{name}: config.json has no integer `{key}`"))
            })
        };
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let dtype_bytes = match v
            .get("torch_dtype")
            .and_then(Value::as_str)
            .unwrap_or("bfloat16")
        {
            "float32" => 4,
            _ => 2,
        };
        let fp8 = v
            .get("quantization_config")
            .and_then(|q| q.get("quant_method"))
            .and_then(Value::as_str)
            .is_some_and(|m| m.contains("fp8"));
        let mla = field(&v, "kv_lora_rank").map(|kv_lora_rank| Mla {
            kv_lora_rank,
            qk_rope_head_dim: field(&v, "qk_rope_head_dim").unwrap_or(64),
            qk_nope_head_dim: field(&v, "qk_nope_head_dim").unwrap_or(128),
            v_head_dim: field(&v, "v_head_dim").unwrap_or(128),
            q_lora_rank: field(&v, "q_lora_rank"),
        });
        let moe = field(&v, "n_routed_experts")
            .or_else(|| field(&v, "num_local_experts"))
            .map(|routed_experts| Moe {
                routed_experts,
                experts_per_token: field(&v, "num_experts_per_tok").unwrap_or(1),
                shared_experts: field(&v, "n_shared_experts").unwrap_or(0),
                moe_intermediate: field(&v, "moe_intermediate_size")
                    .or_else(|| field(&v, "intermediate_size"))
                    .unwrap_or(0),
                dense_layers: field(&v, "first_k_dense_replace").unwrap_or(0),
            });
        let shape = ModelShape {
            name: name.to_owned(),
            layers: need("num_hidden_layers")?,
            hidden,
            heads,
            kv_heads: field(&v, "num_key_value_heads").unwrap_or(heads),
            head_dim: field(&v, "head_dim").unwrap_or(hidden / heads.max(1)),
            intermediate: field(&v, "intermediate_size").unwrap_or(4 * hidden),
            vocab: need("vocab_size")?,
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            weight_bytes: if fp8 { 1.0 } else { dtype_bytes as f64 },
            activation_bytes: dtype_bytes,
            mla,
            moe,
        };
        shape.check_sizes()?;
        Ok(shape)
    }

    /// Refuses a shape no engine could load: a zero dimension makes every figure 0 ("0 tokens
    /// of 0 bytes") instead of an answer.
    fn check_sizes(&self) -> Result<()> {
        let dims = [
            ("num_hidden_layers", self.layers),
            ("hidden_size", self.hidden),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab),
        ];
        for (key, value) in dims {
            if value == 0 {
                return Err(Error::InvalidArgument(format!(
                    "{}: config.json has `{key}` 0; every dimension must be at least 1",
                    self.name
                )));
            }
        }
        if self.kv_heads > self.heads {
            return Err(Error::InvalidArgument(format!(
                "{}: config.json has more key/value heads ({}) than attention heads ({})",
                self.name, self.kv_heads, self.heads
            )));
        }
        Ok(())
    }

    /// Refuses a TP size the engines refuse (vLLM and SGLang alike): attention heads must split
    /// evenly over the ranks, and key/value heads must either split evenly (more heads than
    /// ranks) or be replicated evenly (fewer heads: the TP size a multiple of them). MLA keeps
    /// one latent per rank, so only the attention heads count there.
    pub fn check_tp(&self, tp: u64) -> Result<()> {
        if tp == 0 {
            return Err(Error::InvalidArgument("TP size must be at least 1".into()));
        }
        if self.heads % tp != 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: {} attention heads do not divide over TP {tp}; engines refuse it: pick a TP that divides {}",
                self.name, self.heads, self.heads
            )));
        }
        if self.mla.is_none() {
            let splits = if self.kv_heads >= tp {
                self.kv_heads % tp == 0
            } else {
                tp % self.kv_heads == 0
            };
            if !splits {
                return Err(Error::InvalidArgument(format!(
                    "{}: {} key/value heads do not divide over TP {tp} (nor does TP {tp} replicate them evenly); engines refuse it: pick a TP that divides {} or a multiple of it",
                    self.name, self.kv_heads, self.kv_heads
                )));
            }
        }
        Ok(())
    }

    fn attention_parameters(&self) -> u64 {
        let h = self.hidden;
        match &self.mla {
            Some(m) => {
                let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
                let q = match m.q_lora_rank {
                    Some(r) => h * r + r * self.heads * qk,
                    None => h * self.heads * qk,
                };
                let kv = h * (m.kv_lora_rank + m.qk_rope_head_dim)
                    + m.kv_lora_rank * self.heads * (m.qk_nope_head_dim + m.v_head_dim);
                q + kv + self.heads * m.v_head_dim * h
            }
            None => {
                let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
                h * q + 2 * h * kv + q * h
            }
        }
    }

    /// MLP parameters of `layer`, and of them the ones one token uses.
    fn mlp_parameters(&self, layer: u64) -> (u64, u64) {
        let h = self.hidden;
        match &self.moe {
            Some(m) if layer >= m.dense_layers => {
                let expert = 3 * h * m.moe_intermediate;
                let total = (m.routed_experts + m.shared_experts) * expert + h * m.routed_experts;
                let active =
                    (m.experts_per_token + m.shared_experts) * expert + h * m.routed_experts;
                (total, active)
            }
            _ => (3 * h * self.intermediate, 3 * h * self.intermediate),
        }
    }

    fn embedding_parameters(&self) -> u64 {
        self.vocab * self.hidden * if self.tied_embeddings { 1 } else { 2 }
    }

    /// Every parameter (norms left out: they are a rounding error).
    pub fn parameters(&self) -> u64 {
        self.embedding_parameters()
            + (0..self.layers)
                .map(|l| self.attention_parameters() + self.mlp_parameters(l).0)
                .sum::<u64>()
    }

    /// The parameters one token reads (MoE: its experts only).
    pub fn active_parameters(&self) -> u64 {
        self.embedding_parameters()
            + (0..self.layers)
                .map(|l| self.attention_parameters() + self.mlp_parameters(l).1)
                .sum::<u64>()
    }

    /// Weight bytes each of `tp` ranks holds (an even split; engines replicate little else).
    pub fn weight_bytes_per_rank(&self, tp: u64) -> f64 {
        self.parameters() as f64 * self.weight_bytes / tp.max(1) as f64
    }

    /// KV-cache bytes one token takes on one rank, with `kv_bytes` per element. MLA keeps one
    /// latent (kv_lora_rank + rope dims) per layer on every rank (SGLang: MLATokenToKVPool);
    /// other models keep K and V of their share of the KV heads, at least one head per rank
    /// (heads are replicated when there are fewer than ranks; SGLang: MHATokenToKVPool).
    pub fn kv_bytes_per_token(&self, tp: u64, kv_bytes: u64) -> u64 {
        match &self.mla {
            Some(m) => (m.kv_lora_rank + m.qk_rope_head_dim) * self.layers * kv_bytes,
            None => {
                2 * self.kv_heads.div_ceil(tp.max(1)).max(1)
                    * self.head_dim
                    * self.layers
                    * kv_bytes
            }
        }
    }

    /// Allreduces in one forward pass of a tensor-parallel model: after attention and after the
    /// MLP of every layer.
    pub fn allreduces_per_forward(&self) -> u64 {
        2 * self.layers
    }

    /// Bytes of each of those allreduces for `tokens` tokens.
    pub fn allreduce_bytes(&self, tokens: u64) -> u64 {
        tokens * self.hidden * self.activation_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::MODEL_FIXTURES;

    fn fixture(name: &str) -> ModelShape {
        ModelShape::from_config_json(MODEL_FIXTURES.iter().find(|f| f.0 == name).unwrap().1, name)
            .unwrap()
    }

    #[test]
    fn tp_sizes_the_engines_refuse_are_refused() {
        let llama = fixture("llama-3.1-70b"); // 64 heads, 8 KV heads
        for tp in [1, 2, 4, 8, 16, 32, 64] {
            llama.check_tp(tp).unwrap();
        }
        assert!(llama
            .check_tp(3)
            .unwrap_err()
            .to_string()
            .contains("64 attention heads"));
        let mut odd = llama.clone();
        odd.heads = 48; // 48 heads over 6 ranks split, but 8 KV heads neither split nor replicate
        let err = odd.check_tp(6).unwrap_err().to_string();
        assert!(err.contains("8 key/value heads"), "{err}");
        let mut mla = fixture("deepseek-v3");
        mla.kv_heads = 128;
        mla.check_tp(8).unwrap();
    }

    #[test]
    fn a_zero_dimension_is_refused() {
        let text = MODEL_FIXTURES
            .iter()
            .find(|f| f.0 == "llama-3.1-70b")
            .unwrap()
            .1;
        let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
        v["hidden_size"] = 0.into();
        let err = ModelShape::from_config_json(&v.to_string(), "zero")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`hidden_size` 0"), "{err}");
    }

    #[test]
    fn parameter_counts_match_the_published_sizes() {
        let llama = fixture("llama-3.1-70b");
        assert!(
            (llama.parameters() as f64 / 1e9 - 70.6).abs() < 0.3,
            "{}",
            llama.parameters()
        );
        let ds = fixture("deepseek-v3");
        assert!(
            (ds.parameters() as f64 / 1e9 - 671.0).abs() < 2.0,
            "{}",
            ds.parameters()
        );
        // 37B activated per token, as DeepSeek reports.
        assert!(
            (ds.active_parameters() as f64 / 1e9 - 37.5).abs() < 1.5,
            "{}",
            ds.active_parameters()
        );
        assert_eq!(ds.weight_bytes, 1.0, "fp8 checkpoint");
        assert_eq!(llama.weight_bytes, 2.0);
    }

    #[test]
    fn kv_bytes_follow_the_attention_kind() {
        let llama = fixture("llama-3.1-70b");
        // 8 KV heads over 8 ranks: 1 head each, K and V, 128 dims, 80 layers, bf16.
        assert_eq!(llama.kv_bytes_per_token(8, 2), 2 * 128 * 80 * 2);
        // Over 16 ranks the heads are replicated: still one per rank.
        assert_eq!(
            llama.kv_bytes_per_token(16, 2),
            llama.kv_bytes_per_token(8, 2)
        );
        let ds = fixture("deepseek-v3");
        assert_eq!(ds.kv_bytes_per_token(8, 2), (512 + 64) * 61 * 2);
        assert_eq!(ds.allreduces_per_forward(), 122);
        assert_eq!(ds.allreduce_bytes(3), 3 * 7168 * 2);
    }

    #[test]
    fn a_config_without_a_needed_field_names_it() {
        let err = ModelShape::from_config_json("{\"hidden_size\": 8}", "x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_attention_heads"), "{err}");
    }
}
