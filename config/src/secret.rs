//! [`Secret`]: a configuration string that never shows itself. `Debug` and `Serialize` print
//! `<redacted>` once it is set, so a config dumped to a log, an error or a TOML tree does not
//! carry the value; only [`Secret::expose`] hands it out.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// What `Debug` and `Serialize` print in place of a set secret.
pub const REDACTED: &str = "<redacted>";

/// A secret string (the HTTP bearer token); `""` means unset.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The value itself, for the one place that must compare it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("Secret(unset)")
        } else {
            write!(f, "Secret({REDACTED})")
        }
    }
}

/// Serializes as `""` when unset and as [`REDACTED`] otherwise: the serialized defaults are the
/// loader's schema (where it is unset), and a serialized config is for showing, never for
/// carrying the value.
impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(if self.0.is_empty() { "" } else { REDACTED })
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_serialize_hide_the_value() {
        let s = Secret::new("hunter2-very-secret");
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(!format!("{s:#?}").contains("hunter2"));
        let json = serde_json::to_string(&s).unwrap();
        assert!(!json.contains("hunter2"), "{json}");
        assert_eq!(s.expose(), "hunter2-very-secret");
        assert_eq!(serde_json::to_string(&Secret::default()).unwrap(), "\"\"");
    }
}
