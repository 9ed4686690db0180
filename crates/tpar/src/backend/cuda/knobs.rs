//! The experiment knobs: environment variables (`TPAR_MAX_BLOCKS`, `TPAR_MIN_BLOCK_THREADS`,
//! `TPAR_PDL_SQUEEZE`, `TPAR_FUSED_*`) that override a launch default for a measurement. Each
//! is read once per process, where its default is decided, and a value that is not a whole
//! number is named in a warning and ignored, so that an experiment does not measure the
//! defaults while its author thinks otherwise. None changes the protocol or a result, only how
//! a call is launched.

use std::sync::OnceLock;

/// A knob read once: the variable `name` as a whole number, passed through `read` (which
/// clamps, filters or warns, once) on first use.
pub(super) struct Knob {
    name: &'static str,
    read: fn(&'static str, Option<u32>) -> Option<u32>,
    value: OnceLock<Option<u32>>,
}

impl Knob {
    /// The knob `name`, its number taken through `read` (the knob's name, then its number or
    /// None where unset or not a number).
    pub(super) const fn with(
        name: &'static str,
        read: fn(&'static str, Option<u32>) -> Option<u32>,
    ) -> Self {
        Knob {
            name,
            read,
            value: OnceLock::new(),
        }
    }

    /// The knob's value for this process (None: unset, or ignored with a warning).
    pub(super) fn get(&self) -> Option<u32> {
        *self
            .value
            .get_or_init(|| (self.read)(self.name, env_u32(self.name)))
    }

    /// The knob `name`, its number as set.
    pub(super) const fn new(name: &'static str) -> Self {
        Knob::with(name, |_, value| value)
    }
}

/// The environment variable `name` as a whole number, read now (None: unset, or not a number,
/// which is named in a warning).
fn env_u32(name: &str) -> Option<u32> {
    knob_value(name, std::env::var(name).ok().as_deref()).unwrap_or_else(|why| {
        log::warn!("{why}");
        None
    })
}

/// [`env_u32`]'s reading of `value`, the variable `name`'s (None: unset).
fn knob_value(name: &str, value: Option<&str>) -> std::result::Result<Option<u32>, String> {
    let Some(value) = value else { return Ok(None) };
    value.trim().parse().map(Some).map_err(|_| {
        format!("{name}={value:?} is not a whole number: ignored, the built-in rule applies (unset it, or give a number such as {name}=2)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_experiment_knob_that_is_not_a_number_is_named_and_ignored() {
        assert_eq!(knob_value("TPAR_PDL_SQUEEZE", None), Ok(None));
        assert_eq!(knob_value("TPAR_PDL_SQUEEZE", Some(" 2 ")), Ok(Some(2)));
        let why = knob_value("TPAR_PDL_SQUEEZE", Some("2x")).unwrap_err();
        assert!(
            why.starts_with("TPAR_PDL_SQUEEZE=\"2x\" is not a whole number"),
            "{why}"
        );
        assert!(knob_value("TPAR_MIN_BLOCK_THREADS", Some("-64")).is_err());
    }

    #[test]
    fn a_knob_passes_its_number_through_its_reading() {
        // Variables no test sets: the reading sees None and decides the value.
        static DEFAULTED: Knob = Knob::with("TPAR_TEST_KNOB_NEVER_SET", |name, v| {
            assert_eq!(name, "TPAR_TEST_KNOB_NEVER_SET");
            Some(v.unwrap_or(7))
        });
        assert_eq!(DEFAULTED.get(), Some(7));
        assert_eq!(DEFAULTED.get(), Some(7));
        static UNSET: Knob = Knob::new("TPAR_TEST_KNOB_NEVER_SET_EITHER");
        assert_eq!(UNSET.get(), None);
        static CLAMPED: Knob = Knob::with("TPAR_TEST_KNOB_CLAMPED_NEVER_SET", |_, v| {
            v.map(|v| v.clamp(1, 16))
        });
        assert_eq!(CLAMPED.get(), None);
    }
}
