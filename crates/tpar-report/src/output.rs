//! Where a report goes. `--json PATH` and `--plot PATH` name a *target*: `-` is standard
//! output; a regular file (or a path with nothing there yet) is written whole or not at all (a
//! new file beside it, renamed over it, keeping the old file's permissions); a device, FIFO or
//! socket, and whatever a symbolic link leads to, is opened and written in place, never
//! replaced: `--json /dev/null` stays a device, a link stays a link (its target is written, or
//! created if it is not there yet), `--json /dev/stdout` writes to whatever stdout is.
//! [`check_target`] says before a run whether a target can be written, so that a bad path fails
//! at once rather than after the measurement. Every error names the flag and the path.
//!
//! Standard output is written without panicking: [`print_out`] returns the error (a closed
//! pipe, a full disk) for the caller to end on, and [`print_err`] drops what a closed stderr
//! cannot take.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{ReportError, Result};

/// The target that means standard output.
pub const STDOUT: &str = "-";

/// How a target path is written, from what is there.
#[derive(Debug, PartialEq)]
enum Written {
    /// A regular file, or nothing yet: replaced by a new file renamed over it.
    Replaced {
        /// The permission bits of the file there now, kept by the replacement.
        mode: Option<u32>,
    },
    /// A device, FIFO or socket, or a symbolic link to anything but a folder: opened through
    /// the path and written in place.
    InPlace,
    /// A symbolic link whose target is not there yet: written in place, creating the target
    /// (at this path once the links are followed).
    Dangling(PathBuf),
}

/// The longest chain of symbolic links followed (as the kernel's own limit).
const MAX_LINKS: usize = 40;

/// `--flag path`, as errors name a target.
fn named(flag: &str, path: &str) -> String {
    format!("--{flag} {path}")
}

fn refused(flag: &str, path: &str, reason: impl Into<String>) -> ReportError {
    ReportError::Target {
        target: named(flag, path),
        reason: reason.into(),
    }
}

/// What is at `path` (see [`Written`]); a folder, or a path that cannot be looked at, is refused.
fn resolve(flag: &str, path: &str) -> Result<Written> {
    use std::os::unix::fs::PermissionsExt;
    let folder = |what: String| Err(refused(flag, path, format!("{what}; give a file path")));
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Written::Replaced { mode: None }),
        Err(e) => Err(refused(flag, path, format!("cannot look at it: {e}"))),
        Ok(meta) if meta.is_dir() => folder("is a folder".into()),
        Ok(meta) if meta.is_file() => Ok(Written::Replaced {
            mode: Some(meta.permissions().mode() & 0o7777),
        }),
        Ok(meta) if meta.file_type().is_symlink() => match std::fs::metadata(path) {
            Ok(target) if target.is_dir() => folder("is a link to a folder".into()),
            Ok(_) => Ok(Written::InPlace),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok(Written::Dangling(link_target(flag, path)?))
            }
            Err(e) => Err(refused(flag, path, format!("cannot follow the link: {e}"))),
        },
        // A character or block device, a FIFO or a socket.
        Ok(_) => Ok(Written::InPlace),
    }
}

/// The path a chain of symbolic links starting at `path` ends at (which is not there).
fn link_target(flag: &str, path: &str) -> Result<PathBuf> {
    let mut at = PathBuf::from(path);
    for _ in 0..MAX_LINKS {
        match std::fs::read_link(&at) {
            Ok(link) => {
                let base = at.parent().map_or_else(PathBuf::new, Path::to_path_buf);
                at = base.join(link);
            }
            Err(_) => return Ok(at),
        }
    }
    Err(refused(
        flag,
        path,
        format!("more than {MAX_LINKS} symbolic links in a row (a loop?)"),
    ))
}

/// The folder a file at `path` is created in.
fn folder_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// A file name beside `path` for its replacement (or a probe), unique to this process and call.
fn sibling(path: &Path, what: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map_or("out".into(), |n| n.to_string_lossy());
    folder_of(path).join(format!(
        ".{name}.{what}{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Whether a file can be created in the folder of `file`: tried for real (access(2) says yes to root in
/// /proc, where nothing can be created), and removed again.
fn can_create_beside(file: &Path) -> std::io::Result<()> {
    let probe = sibling(file, "probe");
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Checks, before any work, that `--flag path` can be written: `-` always can; a new or
/// regular file needs a folder it can be created in (or, in a folder that takes no new files,
/// an existing file this process may write in place); what is written in place must be
/// writable by this process. The error names the flag, the path and the reason.
pub fn check_target(flag: &str, path: &str) -> Result<()> {
    if path == STDOUT {
        return Ok(());
    }
    if path.is_empty() {
        return Err(refused(
            flag,
            "''",
            "is empty; give a file path (or - for stdout)",
        ));
    }
    if path.as_bytes().contains(&0) {
        return Err(refused(flag, path, "holds a NUL byte"));
    }
    let file = Path::new(path);
    let creatable = |file: &Path| -> Result<()> {
        let folder = folder_of(file);
        if !folder.is_dir() {
            return Err(refused(
                flag,
                path,
                format!(
                    "folder {} does not exist; create it or pick another path",
                    folder.display()
                ),
            ));
        }
        can_create_beside(file).map_err(|e| {
            refused(
                flag,
                path,
                format!(
                    "cannot create a file in {}: {e}; pick another path",
                    folder.display()
                ),
            )
        })
    };
    let writable = || {
        if tpar::dir_writable(file) {
            Ok(())
        } else {
            Err(refused(
                flag,
                path,
                "cannot write there (permission denied); pick another path",
            ))
        }
    };
    match resolve(flag, path)? {
        Written::Replaced { mode: None } => creatable(file),
        // Replaced through its folder, or written in place where the folder takes no new
        // files: either way the file must be this user's to write.
        Written::Replaced { mode: Some(_) } | Written::InPlace => writable(),
        Written::Dangling(target) => creatable(&target),
    }
}

/// Writes `bytes` to `--flag target` (see the module doc: stdout, a file replaced whole, or
/// written in place).
pub fn write_target(flag: &str, target: &str, bytes: &[u8]) -> Result<()> {
    if target == STDOUT {
        let mut out = std::io::stdout().lock();
        return out
            .write_all(bytes)
            .and_then(|()| out.flush())
            .map_err(ReportError::Stdout);
    }
    let failed = |source| ReportError::Write {
        target: named(flag, target),
        source,
    };
    let path = Path::new(target);
    match resolve(flag, target)? {
        Written::InPlace | Written::Dangling(_) => in_place(path, bytes).map_err(failed),
        Written::Replaced { mode } => match replace(path, mode, bytes) {
            Ok(()) => Ok(()),
            // A folder that takes no new files, around a file this user may write: in place.
            Err(e) if mode.is_some() && e.kind() == std::io::ErrorKind::PermissionDenied => {
                in_place(path, bytes).map_err(failed)
            }
            Err(e) => Err(failed(e)),
        },
    }
}

/// Opens `path` (following links; created if missing, emptied if a file) and writes `bytes`.
fn in_place(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    file.write_all(bytes)?;
    file.flush()
}

/// A new file beside `path` holding `bytes` (with `mode`, if given), renamed over `path`; the
/// new file is removed if anything fails.
fn replace(path: &Path, mode: Option<u32>, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = sibling(path, "tmp");
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        if let Some(mode) = mode {
            file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        }
        file.write_all(bytes)?;
        file.flush()?;
        drop(file);
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes `value` as pretty JSON to `--json target`.
pub fn write_json<T: Serialize>(target: &str, value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value).expect("results serialise");
    text.push('\n');
    write_target("json", target, text.as_bytes())
}

/// Prints `text` and a newline to standard output; a closed pipe or a full disk is an error
/// ([`ReportError::Stdout`]), not a panic.
pub fn print_out(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
        .map_err(ReportError::Stdout)
}

/// Prints `text` and a newline to standard error in one write; what a closed or full stderr
/// cannot take is dropped (there is nowhere left to say it).
pub fn print_err(text: &str) {
    let line = format!("{text}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Whether a command's table goes to standard output: not where that carries the JSON (`json`
/// is `-`) or another output (`stdout_taken`, such as `--plot -`), whose readers a text table
/// would break; it goes to standard error then. The rule of [`emit_to`], and of the rows so far
/// that an interrupted job prints.
pub fn table_on_stdout(json: Option<&str>, stdout_taken: bool) -> bool {
    !stdout_taken && json != Some(STDOUT)
}

/// Prints `text` (the table) and writes `value` as JSON where `json` says: `-` puts the JSON
/// on stdout and the table on stderr, a path gets the JSON and the table goes to stdout. With
/// `stdout_taken` (another output, such as `--plot -`, goes to stdout) the table goes to stderr.
pub fn emit_to<T: Serialize>(
    text: &str,
    json: Option<&str>,
    stdout_taken: bool,
    value: &T,
) -> Result<()> {
    if table_on_stdout(json, stdout_taken) {
        print_out(text)?;
    } else {
        print_err(text);
    }
    if let Some(target) = json {
        write_json(target, value)?;
        if target != STDOUT {
            print_err(&format!("wrote {target}"));
        }
    }
    Ok(())
}

/// [`emit_to`] with stdout free for the table.
pub fn emit<T: Serialize>(text: &str, json: Option<&str>, value: &T) -> Result<()> {
    emit_to(text, json, false, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tpar-report-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn json_file_is_complete_or_absent() {
        let dir = temp_dir("json");
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
        let missing = dir.join("missing/x.json");
        let err = write_json(missing.to_str().unwrap(), &1).unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("cannot write --json {}", missing.display())),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_replaced_file_keeps_its_permissions_and_a_link_stays_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("link");
        let file = dir.join("real.json");
        std::fs::write(&file, "old").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let link = dir.join("link.json");
        std::os::unix::fs::symlink("real.json", &link).unwrap();
        write_target("json", link.to_str().unwrap(), b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "new");
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        // A dangling link creates its target.
        let dangling = dir.join("dangling.json");
        std::os::unix::fs::symlink("made.json", &dangling).unwrap();
        write_target("json", dangling.to_str().unwrap(), b"x").unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("made.json")).unwrap(), "x");
        let looped = dir.join("loop");
        std::os::unix::fs::symlink("loop", &looped).unwrap();
        let err = check_target("plot", looped.to_str().unwrap()).unwrap_err();
        assert!(err.to_string().contains("symbolic links"), "{err}");
        let to_dir = dir.join("to-dir");
        std::os::unix::fs::symlink(&dir, &to_dir).unwrap();
        let err = check_target("json", to_dir.to_str().unwrap()).unwrap_err();
        assert!(err.to_string().contains("is a link to a folder"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn checks_name_the_flag_the_path_and_the_reason() {
        let dir = temp_dir("check");
        let text = |flag: &str, p: &str| check_target(flag, p).unwrap_err().to_string();
        let d = dir.to_str().unwrap();
        assert_eq!(
            text("json", d),
            format!("--json {d}: is a folder; give a file path")
        );
        let missing = format!("{d}/no/x.json");
        assert!(
            text("plot", &missing)
                .starts_with(&format!("--plot {missing}: folder {d}/no does not exist")),
            "{}",
            text("plot", &missing)
        );
        assert!(text("json", "").contains("is empty"));
        check_target("json", "-").unwrap();
        check_target("json", &format!("{d}/new.json")).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "probe removed");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
