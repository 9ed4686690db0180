//! The module's errors: `tpar.TparError` for everything tpar reports, its subclass
//! `tpar.TparRefused` for a call tpar does not take (with `choice` and `reason`), the
//! library's errors in the Python user's words, and panics (bugs) turned into TparError
//! instead of pyo3's PanicException, which `except Exception` does not catch.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::{create_exception, intern};

create_exception!(
    _tpar,
    TparError,
    PyException,
    "An error reported by tpar; the message says why and what to do."
);

create_exception!(
    _tpar,
    TparRefused,
    TparError,
    "tpar does not take this call (its dtype, layout, device or size, or a choice this communicator \
     does not hold such as NCCL with nccl=\"none\"); `choice` names what the call needed, where it \
     needed one, and `reason` is a short code. Route the call to your own path."
);

/// A `TparRefused` with its `choice` and `reason` attributes.
pub(crate) fn refused(choice: Option<&str>, reason: &str, message: impl Into<String>) -> PyErr {
    let error = TparRefused::new_err(message.into());
    Python::attach(|py| {
        let value = error.value(py);
        let _ = value.setattr(intern!(py, "choice"), choice);
        let _ = value.setattr(intern!(py, "reason"), reason);
    });
    error
}

/// The library's words for the Rust API, as the Python user passes the same settings.
pub(crate) fn python_words(text: &str) -> String {
    text.replace(
        "--timeout / Config::timeout",
        "timeout= when creating the tpar.Communicator",
    )
    .replace(
        "every rank must use the same Config::chunk_bytes",
        "every rank must pass the same chunk_bytes=",
    )
}

/// The library's error as a TparError (a typed refusal as TparRefused with its `choice` and
/// `reason`), its text in the Python user's words.
pub(crate) fn err(e: tpar::Error) -> PyErr {
    match e {
        tpar::Error::Refused {
            choice,
            reason,
            message,
        } => refused(
            choice,
            reason,
            python_words(&format!("unsupported: {message}")),
        ),
        other => TparError::new_err(python_words(&other.to_string())),
    }
}

/// Runs `f`, turning a panic (a bug in tpar) into a TparError instead of pyo3's
/// PanicException, which `except Exception` does not catch.
pub(crate) fn guard<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(TparError::new_err(format!(
                "internal error in {what}: {text}; please report it with the arguments that caused it"
            )))
        }
    }
}
