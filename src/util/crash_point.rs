//! Crash points: named places at the durability boundaries where a test can make the process
//! die on the spot, to prove that a crash exactly there loses nothing and applies nothing
//! twice. A `kill -9` at a random moment rarely lands between two steps a few microseconds
//! apart; a crash point always does.
//!
//! `KVINDEX_CRASH_AT=<name>@<n>` aborts the process (`std::process::abort`: no destructor, no
//! flush, what `kill -9` does to the process) the `n`-th time it passes `<name>` (`@<n>` left
//! out: the first). Unset, which is the only setting a deployment should have, a crash point
//! is one atomic load. The points:
//!
//! | name | where |
//! |---|---|
//! | `commit.built` | a shard's checkpoint batch (rows + offsets) is built, not yet written |
//! | `commit.written` | the batch is in RocksDB; the pipeline does not know it is durable yet |
//! | `ack.before` | offsets are durable; the source is about to commit / ack them upstream |
//! | `ack.after` | the source has committed / acked them |
//! | `evict.durable` | an eviction's entries are durable in L2 (committed, or written back); L1 still holds them |
//! | `warmup.chunk` | a restart has loaded one more chunk of a shard's rows into L1 |

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable that arms a crash point.
pub const CRASH_AT_ENV: &str = "KVINDEX_CRASH_AT";

struct Armed {
    name: String,
    /// Passes left before the abort.
    left: AtomicU64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let spec = std::env::var(CRASH_AT_ENV).ok()?;
            let (name, n) = match spec.split_once('@') {
                Some((name, n)) => (name, n.parse().ok()?),
                None => (spec.as_str(), 1),
            };
            tracing::warn!(
                crash_point = name,
                pass = n,
                "{CRASH_AT_ENV} is set: this process will abort there (a test aid)"
            );
            Some(Armed {
                name: name.to_string(),
                left: AtomicU64::new(n),
            })
        })
        .as_ref()
}

/// Passes the crash point `name`: aborts the process if it is the armed one and this is the
/// pass it was armed for.
#[inline]
pub fn crash_point(name: &'static str) {
    if let Some(armed) = armed()
        && armed.name == name
        && armed.left.fetch_sub(1, Ordering::Relaxed) == 1
    {
        eprintln!("kvindex: crash point {name} reached; aborting");
        std::process::abort();
    }
}
