//! Wall-clock time as kvindex stores and parses it: unix microseconds. The parser of RFC 3339
//! times lives with the configuration that reads them ([`parse_rfc3339_us`]).

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in unix microseconds (0 if the clock is before 1970).
pub fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

pub use kvindex_config::parse_rfc3339_us;
