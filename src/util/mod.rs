//! Small helpers every layer uses: retry [`Backoff`], rate-limited logging ([`LogEvery`]),
//! wall-clock time in unix microseconds ([`time`]), files written whole ([`fs`]), and the
//! crash points tests arm at the durability boundaries ([`crash_point`]).

pub mod backoff;
pub mod crash_point;
pub mod fs;
pub mod log_every;
pub mod time;

pub use backoff::Backoff;
pub use crash_point::crash_point;
pub use fs::write_atomically;
pub use log_every::LogEvery;
pub use time::{now_us, parse_rfc3339_us};
