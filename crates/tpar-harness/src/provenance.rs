//! Where a result came from: the host, the device, the build, the date and the command line,
//! recorded beside every measurement that is written out (the CLI's JSON, Python's records),
//! so that a file of figures can be traced to the run that made it.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct Provenance {
    pub host: String,
    pub device: String,
    /// The commit the program was built from (`git describe` of the caller's build).
    pub commit: String,
    /// UTC, RFC 3339, to the second.
    pub date: String,
    pub command: String,
    pub tpar_version: String,
}

impl Provenance {
    /// The record for a result measured now on `device`, by this process, built from `commit`.
    pub fn collect(device: String, commit: &str) -> Provenance {
        Provenance {
            host: tpar::host_name(),
            device,
            commit: commit.to_owned(),
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            tpar_version: env!("CARGO_PKG_VERSION").to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_record_names_its_device_commit_and_a_utc_date() {
        let p = super::Provenance::collect("cpu: test".into(), "abc123");
        assert_eq!(
            (p.device.as_str(), p.commit.as_str()),
            ("cpu: test", "abc123")
        );
        assert!(p.date.ends_with('Z') && p.date.len() == 20, "{}", p.date);
        assert!(!p.command.is_empty() && !p.host.is_empty());
        let json = serde_json::to_value(&p).unwrap();
        assert_eq!(json["tpar_version"], env!("CARGO_PKG_VERSION"));
    }
}
