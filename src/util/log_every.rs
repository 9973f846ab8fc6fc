//! Rate-limited logging: a warning that repeats on every retry of a failing broker or disk
//! would flood the log, so each such site keeps a [`LogEvery`] and logs only when it allows.

use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// Allows one log line per `period`; the first call always may.
#[derive(Debug)]
pub struct LogEvery {
    period: Duration,
    last: Mutex<Option<Instant>>,
}

impl LogEvery {
    pub fn new(period: Duration) -> LogEvery {
        LogEvery {
            period,
            last: Mutex::new(None),
        }
    }

    /// Whether to log now; if so, the next line waits a whole `period`.
    pub fn ready(&self) -> bool {
        let now = Instant::now();
        let mut last = self.last.lock();
        if last.is_some_and(|t| now.duration_since(t) < self.period) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allows_one_line_per_period() {
        let every = LogEvery::new(Duration::from_millis(50));
        assert!(every.ready());
        assert!(!every.ready());
        std::thread::sleep(Duration::from_millis(60));
        assert!(every.ready());
    }
}
