//! Engine liveness: which engines of the shard have gone silent (by kvindex's own clock when
//! their events were applied), and the clears that forget an engine. A dead engine that never
//! sent `ALL_CLEARED` would otherwise hold its blocks forever and be ranked first.

use super::{EngineState, Shard};
use crate::event::{Event, EventKind, PartitionKey};
use std::collections::BTreeSet;
use std::sync::Arc;

impl Shard {
    /// Engines that no event has reached since `cutoff_us` (kvindex clock), leaving out those
    /// already waiting to be retired. Every engine counts as heard at `grace_from_us` at the
    /// latest (when the sources caught up), so a restart or a backlog gives every engine a
    /// full grace period.
    pub fn silent_engines(&self, cutoff_us: i64, grace_from_us: i64) -> Vec<Arc<str>> {
        self.engines
            .iter()
            .enumerate()
            .filter(|(i, e)| {
                !e.is_free()
                    && e.heard_us.max(grace_from_us) < cutoff_us
                    && !self.retiring(*i as u32)
            })
            .map(|(_, e)| e.name.clone())
            .collect()
    }

    /// The `ALL_CLEARED` events that drop `engine` from this shard: one per (tenant, model)
    /// it stored into (none if the shard does not know it). Then [`Shard::retire_engine`]
    /// reclaims its slot.
    pub fn forget_events(&self, engine: &str) -> Vec<Event> {
        let Some(&eid) = self.engine_ids.get(engine) else {
            return Vec::new();
        };
        let models: BTreeSet<(&str, &str)> = self.engines[eid as usize]
            .parts
            .iter()
            .map(|(pid, _)| {
                let k = &self.partitions[*pid as usize].key;
                (k.tenant.as_str(), k.model.as_str())
            })
            .collect();
        models
            .into_iter()
            .map(|(tenant, model)| {
                Event::new(
                    EventKind::AllCleared,
                    engine,
                    PartitionKey::new(tenant, model, ""),
                )
            })
            .collect()
    }

    /// When kvindex last applied an event of engine `eid` (its own clock), or `loaded_us` if
    /// none since this process loaded it.
    pub fn engine_heard_us(&self, eid: u32, loaded_us: i64) -> i64 {
        self.engines
            .get(eid as usize)
            .map_or(loaded_us, |e| heard(e, loaded_us))
    }

    /// Whether the shard knows `engine` (it stored or was heard from here).
    pub fn knows_engine(&self, engine: &str) -> bool {
        self.engine_ids.contains_key(engine)
    }
}

fn heard(e: &EngineState, loaded_us: i64) -> i64 {
    if e.heard_us == 0 {
        loaded_us
    } else {
        e.heard_us
    }
}
