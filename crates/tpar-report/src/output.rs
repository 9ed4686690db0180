//! Where a report goes: JSON written whole or not at all (a temporary file renamed over the
//! target), and the split `--json` makes between the table and the JSON (stdout and stderr).

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::{ReportError, Result};

/// Writes `value` as pretty JSON to `target`: `-` is stdout; a path is written to a temporary
/// file beside it and renamed, so a reader never sees half a file.
pub fn write_json<T: Serialize>(target: &str, value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).expect("results serialise");
    text.push('\n');
    if target == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        return Ok(out.flush()?);
    }
    let path = Path::new(target);
    let tmp = path.with_file_name(format!(
        ".{}.tmp{}",
        path.file_name()
            .map_or("out".into(), |n| n.to_string_lossy()),
        std::process::id()
    ));
    std::fs::write(&tmp, text).map_err(|source| ReportError::Write {
        path: tmp.display().to_string(),
        source,
    })?;
    std::fs::rename(&tmp, path).map_err(|source| ReportError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// Prints `text` (the table) and writes `value` as JSON where `json` says: `-` puts the JSON on
/// stdout and the table on stderr, a path gets the JSON file and the table goes to stdout.
pub fn emit<T: Serialize>(text: &str, json: Option<&str>, value: &T) -> Result<()> {
    match json {
        Some("-") => {
            eprintln!("{text}");
            write_json("-", value)
        }
        Some(path) => {
            println!("{text}");
            write_json(path, value)?;
            eprintln!("wrote {path}");
            Ok(())
        }
        None => {
            println!("{text}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_file_is_complete_or_absent() {
        let dir = std::env::temp_dir().join(format!("tpar-report-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("out.json");
        write_json(path.to_str().unwrap(), &serde_json::json!({"a": 1})).unwrap();
        let back: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back["a"], 1);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file left"
        );
        assert!(write_json(dir.join("missing/x.json").to_str().unwrap(), &1).is_err());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
