//! The block size each (tenant, model) stores token chains with, so token lookups need not
//! name it. The first size seen for a model is **pinned**: later events with another size
//! are counted as conflicts and logged (their own keys still use their own size), never
//! silently flipping every lookup of the model. Pins are made durable by the pipeline before
//! the first event carrying them is routed (`Store::pin_block_size`), and reloaded at start,
//! so a warm restart answers token lookups exactly as before it.

use parking_lot::RwLock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What an event's block size means for its model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observed {
    /// The pinned size (or no token content): nothing to do.
    Known,
    /// No size is pinned yet: make `size` durable, then [`BlockSizes::pin`] it.
    New(u32),
    /// Another size than the pinned one.
    Conflict { pinned: u32, got: u32 },
}

/// One model's pin, as `/v1/stats` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PinnedSize {
    pub tenant: String,
    pub model: String,
    pub block_size: u32,
    /// Events seen with another block size.
    pub conflicts: u64,
}

struct Pin {
    size: u32,
    conflicts: AtomicU64,
}

/// tenant → model → pin (nested so a lookup by `&str` allocates nothing).
#[derive(Default)]
pub struct BlockSizes {
    pins: RwLock<HashMap<String, HashMap<String, Pin>>>,
    conflicts: AtomicU64,
}

impl BlockSizes {
    /// The pinned size of (tenant, model).
    pub fn get(&self, tenant: &str, model: &str) -> Option<u32> {
        self.pins.read().get(tenant)?.get(model).map(|p| p.size)
    }

    /// Classifies a token-carrying event's `size` for (tenant, model); counts conflicts.
    pub fn observe(&self, tenant: &str, model: &str, size: u32) -> Observed {
        let pins = self.pins.read();
        match pins.get(tenant).and_then(|m| m.get(model)) {
            Some(p) if p.size == size => Observed::Known,
            Some(p) => {
                p.conflicts.fetch_add(1, Relaxed);
                self.conflicts.fetch_add(1, Relaxed);
                Observed::Conflict {
                    pinned: p.size,
                    got: size,
                }
            }
            None => Observed::New(size),
        }
    }

    /// Pins `size` for (tenant, model) unless a size is pinned already; returns the pin.
    pub fn pin(&self, tenant: &str, model: &str, size: u32) -> u32 {
        let mut pins = self.pins.write();
        pins.entry(tenant.to_string())
            .or_default()
            .entry(model.to_string())
            .or_insert(Pin {
                size,
                conflicts: AtomicU64::new(0),
            })
            .size
    }

    /// Events whose block size conflicted with their model's pin, in this process.
    pub fn conflicts(&self) -> u64 {
        self.conflicts.load(Relaxed)
    }

    /// Every pin, sorted by (tenant, model).
    pub fn list(&self) -> Vec<PinnedSize> {
        let pins = self.pins.read();
        let mut out: Vec<PinnedSize> = pins
            .iter()
            .flat_map(|(tenant, models)| {
                models.iter().map(move |(model, p)| PinnedSize {
                    tenant: tenant.clone(),
                    model: model.clone(),
                    block_size: p.size,
                    conflicts: p.conflicts.load(Relaxed),
                })
            })
            .collect();
        out.sort_by(|a, b| (&a.tenant, &a.model).cmp(&(&b.tenant, &b.model)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_size_is_pinned_and_others_conflict() {
        let sizes = BlockSizes::default();
        assert_eq!(sizes.observe("t", "m", 16), Observed::New(16));
        assert_eq!(
            sizes.get("t", "m"),
            None,
            "not pinned until the caller pins it"
        );
        assert_eq!(sizes.pin("t", "m", 16), 16);
        assert_eq!(sizes.pin("t", "m", 32), 16, "a pin is never replaced");
        assert_eq!(sizes.observe("t", "m", 16), Observed::Known);
        assert_eq!(
            sizes.observe("t", "m", 32),
            Observed::Conflict {
                pinned: 16,
                got: 32
            }
        );
        assert_eq!(sizes.get("t", "m"), Some(16));
        assert_eq!(sizes.conflicts(), 1);
        assert_eq!(sizes.list()[0].conflicts, 1);
        assert_eq!(sizes.observe("u", "m", 32), Observed::New(32));
    }
}
