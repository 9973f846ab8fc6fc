//! The bound on memory in flight between the router and the shard workers, in bytes: decoded
//! events queued for shards count against a budget, `ingest_batch` waits while it is spent,
//! and each worker gives its share back once applied. The per-shard queue length alone would
//! let a paused shard (L1 at its hard cap while L2 is down) hold 64 batches of up to 4,096
//! messages each, gigabytes with large payloads, outside the L1 budget.

use crate::event::{BlockContent, Event};
use parking_lot::{Condvar, Mutex};

/// Default budget of decoded events in flight.
pub const DEFAULT_INFLIGHT_BYTES: u64 = 64 << 20;

/// A byte semaphore. One item larger than the whole budget is admitted when nothing else is in
/// flight, so a huge message cannot wedge the pipeline.
pub struct Inflight {
    limit: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

impl Inflight {
    pub fn new(limit: u64) -> Inflight {
        Inflight {
            limit,
            used: Mutex::new(0),
            freed: Condvar::new(),
        }
    }

    /// Waits until `bytes` fit, then takes them.
    pub fn acquire(&self, bytes: u64) {
        let mut used = self.used.lock();
        while *used > 0 && used.saturating_add(bytes) > self.limit {
            self.freed.wait(&mut used);
        }
        *used += bytes;
    }

    /// Gives `bytes` back.
    pub fn release(&self, bytes: u64) {
        let mut used = self.used.lock();
        *used = used.saturating_sub(bytes);
        self.freed.notify_all();
    }

    /// Bytes in flight now.
    pub fn used(&self) -> u64 {
        *self.used.lock()
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }
}

/// What a decoded event holds on the heap and in place, roughly (strings, hashes, tokens).
pub fn event_bytes(ev: &Event) -> u64 {
    let content = match &ev.content {
        BlockContent::HashesOnly => 0,
        BlockContent::Tokens { token_ids, .. } => token_ids.len() * 4,
        BlockContent::Digests(d) => d.len() * 8,
    };
    (std::mem::size_of::<Event>()
        + ev.engine.len()
        + ev.partition.tenant.len()
        + ev.partition.model.len()
        + ev.partition.adapter.len()
        + ev.block_hashes.len() * 8
        + ev.block_extras
            .iter()
            .map(|x| x.heap_bytes() + 96)
            .sum::<usize>()
        + content) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn waits_while_spent_and_admits_one_oversized_item_alone() {
        let budget = Arc::new(Inflight::new(100));
        budget.acquire(60);
        let b = budget.clone();
        let waiter = std::thread::spawn(move || {
            b.acquire(60);
            b.used()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiter.is_finished(), "60 + 60 > 100 must wait");
        budget.release(60);
        assert_eq!(waiter.join().unwrap(), 60);
        budget.release(60);
        budget.acquire(1_000);
        assert_eq!(
            budget.used(),
            1_000,
            "alone, an oversized item goes through"
        );
    }
}
