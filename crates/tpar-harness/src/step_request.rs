//! What a `bench step` request settles before any GPU work: the model (a Hugging Face
//! `config.json`, named after its folder or file), the layers to time, the passes (the compute
//! alone, then each allreduce with each norm mode), whether ranks run as processes.

use std::path::Path;

use super::bench_step::{Norms, Reduce};
use crate::planner::model::ModelShape;
use tpar::algorithm::Selection;
use tpar::dispatch::Choice;

/// Why a request cannot be timed as given.
#[derive(Debug, thiserror::Error)]
pub enum StepRequestError {
    /// The config file cannot be read (a usage error: the path is wrong).
    #[error("cannot read --config {path}")]
    Unreadable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a model config tpar understands.
    #[error(transparent)]
    Model(#[from] tpar::Error),
    /// A count outside what the model or the pass allows; the message names the fix.
    #[error("{0}")]
    Invalid(String),
}

/// Reads the model of a `config.json` ([`crate::planner::model::load_config`]).
pub fn load_model(config: &Path) -> Result<ModelShape, StepRequestError> {
    use crate::planner::model::{load_config, ConfigFileError};
    load_config(config).map_err(|e| match e {
        ConfigFileError::Unreadable { path, source } => {
            StepRequestError::Unreadable { path, source }
        }
        ConfigFileError::Model(e) => StepRequestError::Model(e),
    })
}

/// The layers a pass holds: `requested`, or every layer of the model; refused outside
/// 1..=the model's layers. The counts of ranks, tokens and replays must be at least 1, and the
/// ranks a TP size the engines take for the model (`ModelShape::check_tp`).
pub fn layers(
    model: &ModelShape,
    requested: Option<u64>,
    [tp, tokens, replays]: [usize; 3],
) -> Result<u64, StepRequestError> {
    if tp == 0 || tokens == 0 || replays == 0 {
        return Err(StepRequestError::Invalid(
            "-n/--world-size, --tokens and --replays must be at least 1".into(),
        ));
    }
    // A TP size the engines refuse is refused here too, before any GPU is looked at.
    model.check_tp(tp as u64)?;
    let layers = requested.unwrap_or(model.layers);
    if layers == 0 || layers > model.layers {
        return Err(StepRequestError::Invalid(format!(
            "--layers {layers}: the model has {} layers; give 1 to {}",
            model.layers, model.layers
        )));
    }
    Ok(layers)
}

/// The passes to time: the compute alone first, then each allreduce with each norm mode;
/// NCCL has no fused form (its fused pass would be its separate one again).
pub fn reduces(allreduces: &[Selection], norms: &[Norms]) -> Vec<Reduce> {
    let mut reduces = vec![Reduce::Nothing];
    for &r in allreduces {
        for &n in norms {
            if n == Norms::Fused && r == Selection::Forced(Choice::Nccl) {
                continue;
            }
            reduces.push(Reduce::With(r, n));
        }
    }
    reduces
}

/// Whether ranks run as processes: when asked, or by default when every rank has a GPU of its
/// own (NCCL takes one process per rank).
pub fn processes(asked: bool, tp: usize, gpus: usize) -> bool {
    asked || (tp > 1 && gpus >= tp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::MODEL_FIXTURES;

    #[test]
    fn a_renamed_file_names_the_model_and_a_checkout_by_its_folder() {
        let dir = std::env::temp_dir().join(format!("tpar-step-request-{}", std::process::id()));
        let checkout = dir.join("Llama-3.1-70B");
        std::fs::create_dir_all(&checkout).unwrap();
        let (_, json) = MODEL_FIXTURES[0];
        std::fs::write(dir.join("mine.json"), json).unwrap();
        std::fs::write(checkout.join("config.json"), json).unwrap();
        assert_eq!(load_model(&dir.join("mine.json")).unwrap().name, "mine");
        let model = load_model(&checkout.join("config.json")).unwrap();
        assert_eq!(model.name, "Llama-3.1-70B");
        assert!(matches!(
            load_model(&dir.join("missing.json")),
            Err(StepRequestError::Unreadable { .. })
        ));
        std::fs::write(dir.join("bad.json"), "{").unwrap();
        assert!(matches!(
            load_model(&dir.join("bad.json")),
            Err(StepRequestError::Model(_))
        ));
        std::fs::remove_dir_all(dir).unwrap();

        assert_eq!(layers(&model, None, [2, 1, 1]).unwrap(), model.layers);
        assert_eq!(layers(&model, Some(3), [2, 1, 1]).unwrap(), 3);
        let too_many = layers(&model, Some(model.layers + 1), [2, 1, 1]).unwrap_err();
        assert!(too_many.to_string().contains("give 1 to"), "{too_many}");
        assert!(layers(&model, Some(0), [2, 1, 1]).is_err());
        assert!(layers(&model, None, [2, 0, 1]).is_err());
        // Llama-3.1-70B's 64 heads do not split over 3 ranks.
        let three = layers(&model, None, [3, 1, 1]).unwrap_err();
        assert!(
            three.to_string().contains("do not divide over TP 3"),
            "{three}"
        );
    }

    #[test]
    fn passes_start_with_the_compute_and_nccl_has_no_fused_pass() {
        let nccl = Selection::Forced(Choice::Nccl);
        let got = reduces(&[nccl, Selection::Auto], &[Norms::Separate, Norms::Fused]);
        assert_eq!(
            got,
            [
                Reduce::Nothing,
                Reduce::With(nccl, Norms::Separate),
                Reduce::With(Selection::Auto, Norms::Separate),
                Reduce::With(Selection::Auto, Norms::Fused),
            ]
        );
        assert!(processes(false, 4, 4) && !processes(false, 4, 1) && !processes(false, 1, 8));
        assert!(processes(true, 1, 1));
    }
}
