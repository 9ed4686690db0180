//! A transformer's shape, read from a Hugging Face `config.json`: layers, hidden size, heads,
//! KV heads, head dim, MLP size, vocabulary, the MLA (DeepSeek) and MoE fields where present,
//! and the bytes per weight (`torch_dtype`, or the checkpoint's `quantization_config`: fp8,
//! int8, 4-bit). A field that is there but not a whole number, or a dtype or quantization tpar
//! does not know, is refused with its name rather than read as absent. From it: parameters, weight bytes per rank, KV-cache bytes per token per rank, and
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
    /// Bytes per stored weight: 2 for bf16/fp16, 1 for fp8 and int8 checkpoints, 0.5 for
    /// 4-bit ones.
    pub weight_bytes: f64,
    /// Bytes per activation element (`torch_dtype`): what the allreduces carry.
    pub activation_bytes: u64,
    pub mla: Option<Mla>,
    pub moe: Option<Moe>,
    /// What the plan should say about how the config was read (the weight format and where it
    /// came from; a multimodal config's language model).
    pub notes: Vec<String>,
}

/// The fields of one section of a config (the top level, or a multimodal config's
/// `text_config`), read with messages that name the file, the section and the field.
struct Fields<'a> {
    v: &'a Value,
    name: &'a str,
    /// "" for the top level, "text_config." inside it.
    section: &'static str,
}

impl Fields<'_> {
    fn err(&self, key: &str, what: String) -> Error {
        Error::InvalidArgument(format!(
            "{}: config.json's `{}{key}` {what}",
            self.name, self.section
        ))
    }

    /// A whole number >= 0, or `None` when absent or null; anything else (a negative or
    /// fractional number, a string) is refused rather than read as absent.
    fn opt(&self, key: &str) -> Result<Option<u64>> {
        self.whole(key, 0)
    }

    /// A whole number >= 1 that must be there.
    fn need(&self, key: &str) -> Result<u64> {
        self.whole(key, 1)?.ok_or_else(|| {
            let hint = if self.section.is_empty() {
                ""
            } else {
                "; a multimodal config may leave the language model's fields to transformers' defaults: give that model's own config.json"
            };
            self.err(key, format!("is missing (a whole number >= 1){hint}"))
        })
    }

    fn whole(&self, key: &str, min: u64) -> Result<Option<u64>> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(value) => match value.as_u64() {
                Some(n) if n >= min => Ok(Some(n)),
                _ => Err(self.err(
                    key,
                    format!("is {value}; it must be a whole number >= {min}"),
                )),
            },
        }
    }

    fn text(&self, key: &str) -> Option<&str> {
        self.v.get(key).and_then(Value::as_str)
    }
}

/// Bytes per stored weight and per activation element, and how they were found.
struct Precision {
    weight_bytes: f64,
    activation_bytes: u64,
    /// How the weight bytes were found ("bf16 (torch_dtype)", "fp8 (quantization_config ...)").
    weights: String,
}

/// The `torch_dtype` (or, from transformers 4.56, `dtype`) names tpar reads: bytes per
/// weight, and whether it is an 8-bit storage type (activations then run in bf16).
fn dtype_bytes(name: &str) -> Option<(f64, bool)> {
    Some(match name.strip_prefix("torch.").unwrap_or(name) {
        "float32" | "float" | "fp32" => (4.0, false),
        "float16" | "half" | "fp16" | "bfloat16" | "bf16" => (2.0, false),
        "float8_e4m3fn" | "float8_e4m3" | "float8_e4m3fnuz" | "float8_e5m2" | "float8_e5m2fnuz"
        | "fp8" | "int8" | "uint8" => (1.0, true),
        _ => return None,
    })
}

/// Bits per weight of a `quantization_config`, as the engines load it: fp8 methods (`fp8`,
/// `fbgemm_fp8`, `w8a8_fp8`, ModelOpt FP8), int8 (`w8a8_int8`), GPTQ / AWQ / AutoRound by
/// their `bits`, bitsandbytes by `load_in_8bit` / `load_in_4bit`, compressed-tensors by its
/// groups' `weights.num_bits`, MXFP4 and NVFP4. `Err` names what is not understood.
fn quantized_bits(q: &Value) -> std::result::Result<(f64, String), String> {
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_ascii_lowercase();
    let bits_field = |key: &str| q.get(key).and_then(Value::as_u64);
    let said = |bits: f64, how: &str| Ok((bits, format!("quantization_config {how}")));
    match method.as_str() {
        m if m.contains("fp8") => said(8.0, &format!("quant_method {m}")),
        "w8a8_int8" | "int8" => said(8.0, &format!("quant_method {method}")),
        "mxfp4" => said(4.0, "quant_method mxfp4"),
        "gptq" | "awq" | "auto-round" | "autoround" | "gptq_marlin" | "awq_marlin" => {
            match bits_field("bits") {
                Some(b @ 2..=8) => said(b as f64, &format!("quant_method {method}, bits {b}")),
                _ => Err(format!("quant_method {method} without `bits` 2 to 8")),
            }
        }
        "bitsandbytes" => {
            let flag = |key: &str| q.get(key).and_then(Value::as_bool) == Some(true);
            if flag("load_in_8bit") {
                said(8.0, "bitsandbytes load_in_8bit")
            } else if flag("load_in_4bit") {
                said(4.0, "bitsandbytes load_in_4bit")
            } else {
                Err("bitsandbytes without load_in_8bit or load_in_4bit".into())
            }
        }
        "compressed-tensors" => {
            let bits = q
                .get("config_groups")
                .and_then(Value::as_object)
                .into_iter()
                .flat_map(|groups| groups.values())
                .filter_map(|g| g.pointer("/weights/num_bits").and_then(Value::as_u64))
                .max();
            match bits {
                Some(b @ 2..=16) => said(b as f64, &format!("compressed-tensors, {b}-bit weights")),
                _ => Err("compressed-tensors without config_groups.*.weights.num_bits".into()),
            }
        }
        "modelopt" => {
            let algo = q
                .get("quant_algo")
                .or_else(|| q.pointer("/quantization/quant_algo"))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_ascii_uppercase();
            match algo.as_str() {
                a if a.starts_with("FP8") => said(8.0, "modelopt FP8"),
                a if a.starts_with("NVFP4") => said(4.0, "modelopt NVFP4"),
                a => Err(format!("modelopt with quant_algo '{a}'")),
            }
        }
        "" => Err("no quant_method".into()),
        m => Err(format!("quant_method '{m}'")),
    }
}

impl Precision {
    /// From `torch_dtype` (or `dtype`) and `quantization_config`, in `text` (the section with
    /// the model's fields) or else the top level.
    fn read(top: &Fields, text: &Fields) -> Result<Precision> {
        let dtype_key = ["torch_dtype", "dtype"];
        let found = [text, top]
            .into_iter()
            .flat_map(|f| dtype_key.map(|k| (f, k)))
            .find_map(|(f, k)| f.text(k).map(|name| (f, k, name)));
        let (dtype_weight, eight_bit, mut weights) = match found {
            None => (2.0, false, "bf16 (no torch_dtype: assumed)".to_owned()),
            Some((f, key, name)) => {
                let (bytes, eight_bit) = dtype_bytes(name).ok_or_else(|| {
                    f.err(
                        key,
                        format!(
                            "is '{name}', not a dtype tpar knows: float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8"
                        ),
                    )
                })?;
                (bytes, eight_bit, format!("{name} ({}{key})", f.section))
            }
        };
        let mut weight_bytes = dtype_weight;
        let quantization = [text, top]
            .into_iter()
            .find_map(|f| f.v.get("quantization_config").map(|q| (f, q)));
        if let Some((f, q)) = quantization {
            let (bits, how) = quantized_bits(q).map_err(|what| {
                f.err(
                    "quantization_config",
                    format!("has {what}: tpar cannot tell the bytes per weight; tpar plan reads fp8, int8, GPTQ/AWQ bits, bitsandbytes, compressed-tensors, MXFP4 and NVFP4"),
                )
            })?;
            weight_bytes = bits / 8.0;
            weights = format!("{bits} bits per weight ({how})");
        }
        Ok(Precision {
            weight_bytes,
            // An 8-bit storage dtype is not what engines compute in: they run bf16.
            activation_bytes: if eight_bit { 2 } else { dtype_weight as u64 },
            weights: if eight_bit && quantization.is_none() {
                format!("{weights}; activations bf16")
            } else {
                weights
            },
        })
    }
}

/// A model config file that cannot be read, or not read as a model.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("cannot read {path}")]
    Unreadable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Model(#[from] Error),
}

/// Reads the model of a `config.json` file: a Hugging Face checkout names the model by its
/// folder, a renamed file by its stem.
pub fn load_config(config: &std::path::Path) -> std::result::Result<ModelShape, ConfigFileError> {
    let text = std::fs::read_to_string(config).map_err(|source| ConfigFileError::Unreadable {
        path: config.display().to_string(),
        source,
    })?;
    let stem = config.file_stem().map(|s| s.to_string_lossy().into_owned());
    let name = match stem.as_deref() {
        Some("config") | None => config
            .canonicalize()
            .ok()
            .and_then(|p| {
                p.parent()?
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| "model".to_owned()),
        Some(stem) => stem.to_owned(),
    };
    Ok(ModelShape::from_config_json(&text, &name)?)
}

impl ModelShape {
    /// Reads `text`, a Hugging Face `config.json`, as the model `name`. A multimodal config
    /// (Llava, Gemma 3, Mistral 3, Llama 4) keeps the language model in `text_config`: that is
    /// what tensor parallelism splits and what is read (the vision tower is left out, and
    /// [`ModelShape::notes`] says so).
    pub fn from_config_json(text: &str, name: &str) -> Result<ModelShape> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("{name}: not JSON: {e}")))?;
        if !v.is_object() {
            return Err(Error::InvalidArgument(format!(
                "{name}: config.json is not a JSON object"
            )));
        }
        let top = Fields {
            v: &v,
            name,
            section: "",
        };
        let mut notes = Vec::new();
        let f = match v.get("text_config") {
            Some(inner) if v.get("hidden_size").is_none() => {
                if !inner.is_object() {
                    return Err(top.err("text_config", "is not an object".into()));
                }
                notes.push(
                    "the language model of a multimodal config (text_config); its vision tower's weights are not counted".to_owned(),
                );
                Fields {
                    v: inner,
                    name,
                    section: "text_config.",
                }
            }
            _ => Fields {
                v: &v,
                name,
                section: "",
            },
        };
        let hidden = f.need("hidden_size")?;
        let heads = f.need("num_attention_heads")?;
        let precision = Precision::read(&top, &f)?;
        notes.push(format!("weights: {}", precision.weights));
        let mla = f.opt("kv_lora_rank")?.map(|kv_lora_rank| -> Result<Mla> {
            Ok(Mla {
                kv_lora_rank,
                qk_rope_head_dim: f.opt("qk_rope_head_dim")?.unwrap_or(64),
                qk_nope_head_dim: f.opt("qk_nope_head_dim")?.unwrap_or(128),
                v_head_dim: f.opt("v_head_dim")?.unwrap_or(128),
                q_lora_rank: f.opt("q_lora_rank")?,
            })
        });
        let mla = mla.transpose()?;
        let routed = match f.opt("n_routed_experts")? {
            Some(n) => Some(n),
            None => f.opt("num_local_experts")?,
        };
        let moe = routed
            .map(|routed_experts| -> Result<Moe> {
                Ok(Moe {
                    routed_experts,
                    experts_per_token: f.opt("num_experts_per_tok")?.unwrap_or(1),
                    shared_experts: f.opt("n_shared_experts")?.unwrap_or(0),
                    moe_intermediate: match f.opt("moe_intermediate_size")? {
                        Some(n) => n,
                        None => f.opt("intermediate_size")?.unwrap_or(0),
                    },
                    dense_layers: f.opt("first_k_dense_replace")?.unwrap_or(0),
                })
            })
            .transpose()?;
        let tied_embeddings = [&f, &top]
            .iter()
            .find_map(|s| s.v.get("tie_word_embeddings").and_then(Value::as_bool))
            .unwrap_or(false);
        let shape = ModelShape {
            name: name.to_owned(),
            layers: f.need("num_hidden_layers")?,
            hidden,
            heads,
            kv_heads: f.opt("num_key_value_heads")?.unwrap_or(heads),
            head_dim: f.opt("head_dim")?.unwrap_or(hidden / heads.max(1)),
            intermediate: f.opt("intermediate_size")?.unwrap_or(4 * hidden),
            vocab: f.need("vocab_size")?,
            tied_embeddings,
            weight_bytes: precision.weight_bytes,
            activation_bytes: precision.activation_bytes,
            mla,
            moe,
            notes,
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
        assert!(err.contains("`hidden_size` is 0"), "{err}");
        // An optional dimension of 0 passes the reading and is refused by the shape check.
        v["hidden_size"] = 8192.into();
        v["head_dim"] = 0.into();
        let err = ModelShape::from_config_json(&v.to_string(), "zero")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`head_dim` 0"), "{err}");
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

    fn llama_json() -> serde_json::Value {
        serde_json::from_str(
            MODEL_FIXTURES
                .iter()
                .find(|f| f.0 == "llama-3.1-70b")
                .unwrap()
                .1,
        )
        .unwrap()
    }

    fn read(v: &serde_json::Value) -> Result<ModelShape> {
        ModelShape::from_config_json(&v.to_string(), "m")
    }

    #[test]
    fn eight_bit_weights_take_one_byte_and_activations_stay_bf16() {
        for dtype in ["float8_e4m3fn", "float8_e4m3", "int8", "torch.float8_e5m2"] {
            let mut v = llama_json();
            v["torch_dtype"] = dtype.into();
            let m = read(&v).unwrap();
            assert_eq!((m.weight_bytes, m.activation_bytes), (1.0, 2), "{dtype}");
        }
        let mut v = llama_json();
        v.as_object_mut().unwrap().remove("torch_dtype");
        v["dtype"] = "float32".into();
        assert_eq!(
            read(&v).unwrap().weight_bytes,
            4.0,
            "transformers' newer `dtype` key"
        );
        let bf16 = read(&llama_json()).unwrap();
        let quantized = |q: serde_json::Value| {
            let mut v = llama_json();
            v["quantization_config"] = q;
            read(&v)
        };
        for (q, bytes) in [
            (serde_json::json!({"quant_method": "w8a8_int8"}), 1.0),
            (serde_json::json!({"quant_method": "fbgemm_fp8"}), 1.0),
            (serde_json::json!({"quant_method": "awq", "bits": 4}), 0.5),
            (serde_json::json!({"quant_method": "gptq", "bits": 8}), 1.0),
            (
                serde_json::json!({"quant_method": "bitsandbytes", "load_in_4bit": true}),
                0.5,
            ),
            (
                serde_json::json!({"quant_method": "compressed-tensors",
                    "config_groups": {"group_0": {"weights": {"num_bits": 8}}}}),
                1.0,
            ),
            (
                serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4"}),
                0.5,
            ),
        ] {
            let m = quantized(q.clone()).unwrap();
            assert_eq!(m.weight_bytes, bytes, "{q}");
            assert_eq!(m.activation_bytes, 2, "{q}");
            assert!(
                (m.weight_bytes_per_rank(8) * 2.0 / bytes - bf16.weight_bytes_per_rank(8)).abs()
                    < 1.0,
                "{q}"
            );
        }
        let err = quantized(serde_json::json!({"quant_method": "gptq"}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`quantization_config` has quant_method gptq without `bits`"),
            "{err}"
        );
        let err = quantized(serde_json::json!({"quant_method": "hqq"}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("'hqq'"), "{err}");
    }

    #[test]
    fn an_unknown_dtype_or_a_negative_size_is_refused_by_name() {
        let mut v = llama_json();
        v["torch_dtype"] = "banana".into();
        let err = read(&v).unwrap_err().to_string();
        assert!(
            err.contains("`torch_dtype` is 'banana', not a dtype tpar knows"),
            "{err}"
        );
        let mut v = llama_json();
        v["hidden_size"] = (-8192).into();
        let err = read(&v).unwrap_err().to_string();
        assert!(
            err.contains("`hidden_size` is -8192; it must be a whole number >= 1"),
            "{err}"
        );
        let mut v = llama_json();
        v["num_key_value_heads"] = 2.5.into();
        let err = read(&v).unwrap_err().to_string();
        assert!(err.contains("`num_key_value_heads` is 2.5"), "{err}");
        let mut v = llama_json();
        v["head_dim"] = serde_json::Value::Null;
        assert_eq!(read(&v).unwrap().head_dim, 128, "null is absent");
    }

    #[test]
    fn a_multimodal_config_is_read_from_its_text_config() {
        let text = llama_json();
        let llava = serde_json::json!({
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "torch_dtype": "bfloat16",
            "text_config": text,
            "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24},
        });
        let m = read(&llava).unwrap();
        assert_eq!(
            m,
            ModelShape {
                notes: m.notes.clone(),
                ..read(&llama_json()).unwrap()
            }
        );
        assert!(m.notes[0].contains("text_config"), "{:?}", m.notes);
        let bare = serde_json::json!({"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 32064}});
        let err = read(&bare).unwrap_err().to_string();
        assert!(
            err.contains("`text_config.hidden_size` is missing"),
            "{err}"
        );
    }

    #[test]
    fn a_config_without_a_needed_field_names_it() {
        let err = ModelShape::from_config_json("{\"hidden_size\": 8}", "x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_attention_heads"), "{err}");
    }
}
