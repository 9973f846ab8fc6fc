//! Small helpers every layer uses: retry [`Backoff`], rate-limited logging ([`LogEvery`]) and
//! wall-clock time in unix microseconds ([`time`]).

pub mod backoff;
pub mod log_every;
pub mod time;

pub use backoff::Backoff;
pub use log_every::LogEvery;
pub use time::{now_us, parse_rfc3339_us};
