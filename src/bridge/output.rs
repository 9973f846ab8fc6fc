//! What the bridge writes to the sink for a batch or a fence, in either partitioning:
//!
//! * `partition_by = "engine"`: the engine's payload unchanged, keyed by the engine id (the
//!   Kafka key / NATS subject token), with headers `model`, `tenant`, `seq`, `dp_rank` and
//!   `epoch`. One engine's batches stay in one partition, in order. A fence is a vLLM batch
//!   holding one `AllBlocksCleared`, keyed and labelled the same way.
//! * `partition_by = "adapter"`: the batch decoded and re-encoded as kvindex `CacheEventBatch`
//!   protobuf, one record per adapter partition it touches, keyed by [`adapter_key`], so
//!   Kafka's partitioner spreads adapters over partitions. Events that concern every adapter
//!   of the engine (unscoped removals, `AllBlocksCleared`, fences) go to every adapter
//!   partition the stream has published to, as one copy scoped to each (a scoped removal, an
//!   `ADAPTER_CLEARED`), so each applies in order with that partition's stores: a sweeping
//!   copy applied late in one partition would clear what was stored again through another.

use crate::event::{
    DecodeError, Envelope, Event, EventKind, PartitionKey, VllmSettings, encode, engine_id, vllm,
};
use crate::source::{DP_RANK_HEADER, MODEL_HEADER, TENANT_HEADER};
use std::collections::BTreeSet;

/// Header carrying the publisher's sequence number of the batch.
pub const SEQ_HEADER: &str = "seq";
/// Header carrying the stream's fence epoch (changes at each fence).
pub const EPOCH_HEADER: &str = "epoch";

/// How the bridge keys what it publishes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PartitionBy {
    /// Key = engine id, payload forwarded as is.
    #[default]
    Engine,
    /// Key = (tenant, model, adapter), payload re-encoded as `CacheEventBatch`.
    Adapter,
}

impl PartitionBy {
    pub const NAMES: [&'static str; 2] = ["engine", "adapter"];

    pub fn parse(s: &str) -> Option<PartitionBy> {
        match s {
            "engine" => Some(PartitionBy::Engine),
            "adapter" => Some(PartitionBy::Adapter),
            _ => None,
        }
    }
}

/// One record for the sink.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Kafka key / NATS subject token.
    pub key: String,
    pub headers: Vec<(&'static str, String)>,
    pub payload: Vec<u8>,
}

/// Who a stream's records speak for.
#[derive(Clone, Debug)]
pub struct StreamLabels {
    /// The engine id the bridge keys by (the consumer appends `#dp<rank>` for ranks > 0).
    pub engine: String,
    pub dp_rank: u32,
    pub model: String,
    pub tenant: String,
    /// `lora_id` → adapter name, for re-encoding.
    pub vllm: VllmSettings,
}

/// The Kafka key / NATS subject token of an adapter partition: the JSON array
/// `["<tenant>","<model>","<adapter>"]` (unambiguous whatever the names contain). Kafka's
/// default partitioner hashes it (murmur2, as the Java client does).
pub fn adapter_key(p: &PartitionKey) -> String {
    serde_json::to_string(&[&p.tenant, &p.model, &p.adapter]).unwrap_or_default()
}

impl StreamLabels {
    fn headers(&self, seq: Option<u64>, epoch: u64) -> Vec<(&'static str, String)> {
        let mut h = vec![
            (MODEL_HEADER, self.model.clone()),
            (TENANT_HEADER, self.tenant.clone()),
            (DP_RANK_HEADER, self.dp_rank.to_string()),
            (EPOCH_HEADER, epoch.to_string()),
        ];
        if let Some(seq) = seq {
            h.push((SEQ_HEADER, seq.to_string()));
        }
        h
    }

    fn base_partition(&self) -> PartitionKey {
        PartitionKey::new(&self.tenant, &self.model, "")
    }

    /// The records for one batch, and how many events it holds. `adapters`: the adapter
    /// partitions this stream has published to (grown here; new names are returned so the
    /// caller can persist them).
    pub fn batch(
        &self,
        by: PartitionBy,
        seq: u64,
        epoch: u64,
        payload: &[u8],
        adapters: &mut BTreeSet<String>,
    ) -> Result<Batch, DecodeError> {
        match by {
            PartitionBy::Engine => {
                let (events, _rank) = vllm::batch_summary(payload)?;
                Ok(Batch {
                    records: vec![Record {
                        key: self.engine.clone(),
                        headers: self.headers(Some(seq), epoch),
                        payload: payload.to_vec(),
                    }],
                    events,
                    new_adapters: Vec::new(),
                })
            }
            PartitionBy::Adapter => self.by_adapter(seq, epoch, payload, adapters),
        }
    }

    fn by_adapter(
        &self,
        seq: u64,
        epoch: u64,
        payload: &[u8],
        adapters: &mut BTreeSet<String>,
    ) -> Result<Batch, DecodeError> {
        let env = Envelope {
            engine: Some(&self.engine),
            model: Some(&self.model),
            tenant: Some(&self.tenant),
            dp_rank: Some(self.dp_rank),
        };
        let (events, skipped) = vllm::decode(payload, &env, &self.vllm)?;
        if !skipped.is_empty() {
            tracing::debug!(engine = %self.engine, skipped = skipped.len(), "bridge: events dropped while re-encoding");
        }
        let total = events.len();
        let mut new_adapters = Vec::new();
        adapters.insert(String::new());
        // Per adapter partition, its events in stream order.
        let mut groups: Vec<(PartitionKey, Vec<Event>)> = Vec::new();
        let push = |groups: &mut Vec<(PartitionKey, Vec<Event>)>, key: PartitionKey, ev: Event| {
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, evs)) => evs.push(ev),
                None => groups.push((key, vec![ev])),
            }
        };
        for mut ev in events {
            ev.seq = seq;
            if ev.is_adapter_agnostic() {
                // To every adapter partition the engine used, as one copy scoped to each: it
                // then applies in order with the rest of its partition (a sweeping copy in one
                // Kafka partition could overtake stores made later through another).
                for adapter in adapters.iter() {
                    let key = PartitionKey::new(&ev.partition.tenant, &ev.partition.model, adapter);
                    push(&mut groups, key.clone(), scoped_to(&ev, key));
                }
            } else {
                if adapters.insert(ev.partition.adapter.clone()) {
                    new_adapters.push(ev.partition.adapter.clone());
                }
                push(&mut groups, ev.partition.clone(), ev);
            }
        }
        let records = groups
            .into_iter()
            .map(|(key, events)| Record {
                key: adapter_key(&key),
                headers: self.headers(Some(seq), epoch),
                payload: encode::to_proto(&events),
            })
            .collect();
        Ok(Batch {
            records,
            events: total,
            new_adapters,
        })
    }

    /// The records of a fence: `AllBlocksCleared` for this engine and rank, before anything
    /// newer, to every partition that may hold its blocks.
    pub fn fence(&self, by: PartitionBy, epoch: u64, adapters: &BTreeSet<String>) -> Vec<Record> {
        let engine = engine_id(&self.engine, self.dp_rank);
        let mut cleared = Event::new(EventKind::AllCleared, engine, self.base_partition());
        cleared.timestamp_us = crate::util::now_us();
        match by {
            PartitionBy::Engine => vec![Record {
                key: self.engine.clone(),
                headers: self.headers(None, epoch),
                payload: encode::to_vllm(std::slice::from_ref(&cleared), self.dp_rank),
            }],
            PartitionBy::Adapter => {
                let base = BTreeSet::from([String::new()]);
                adapters
                    .union(&base)
                    .map(|adapter| {
                        let key = PartitionKey::new(&self.tenant, &self.model, adapter);
                        let scoped = scoped_to(&cleared, key.clone());
                        Record {
                            key: adapter_key(&key),
                            headers: self.headers(None, epoch),
                            payload: encode::to_proto(std::slice::from_ref(&scoped)),
                        }
                    })
                    .collect()
            }
        }
    }
}

/// A sweep over every adapter partition (an unscoped removal, a clear) restricted to
/// `partition` alone: a scoped removal, an `ADAPTER_CLEARED`.
fn scoped_to(ev: &Event, partition: PartitionKey) -> Event {
    let mut copy = ev.clone();
    copy.partition = partition;
    copy.adapter_scoped = true;
    if copy.kind == EventKind::AllCleared {
        copy.kind = EventKind::AdapterCleared;
    }
    copy
}

/// A batch's records and what they hold.
#[derive(Debug)]
pub struct Batch {
    pub records: Vec<Record>,
    /// Events in the batch as the engine sent it.
    pub events: usize,
    /// Adapter partitions this batch published to for the first time.
    pub new_adapters: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{BlockContent, DecodeSettings, EngineHash, Tier, decode_payload};

    fn labels() -> StreamLabels {
        StreamLabels {
            engine: "pod-a".into(),
            dp_rank: 1,
            model: "llama".into(),
            tenant: "acme".into(),
            vllm: VllmSettings::default(),
        }
    }

    fn stored(adapter: &str, hash: u64) -> Event {
        let mut ev = Event::new(
            EventKind::Stored,
            "pod-a#dp1",
            PartitionKey::new("acme", "llama", adapter),
        );
        ev.block_hashes = vec![EngineHash(hash)];
        ev.content = BlockContent::Tokens {
            token_ids: vec![1, 2],
            block_size: 2,
        };
        ev.tier = Some(Tier::Gpu);
        ev
    }

    #[test]
    fn engine_mode_forwards_the_payload_with_its_labels() {
        let payload = encode::to_vllm(&[stored("", 1)], 1);
        let mut adapters = BTreeSet::new();
        let b = labels()
            .batch(PartitionBy::Engine, 9, 2, &payload, &mut adapters)
            .unwrap();
        assert_eq!(b.events, 1);
        assert_eq!(b.records.len(), 1);
        let r = &b.records[0];
        assert_eq!(
            (r.key.as_str(), r.payload.as_slice()),
            ("pod-a", payload.as_slice())
        );
        for (k, v) in [
            ("model", "llama"),
            ("tenant", "acme"),
            ("seq", "9"),
            ("epoch", "2"),
            ("dp_rank", "1"),
        ] {
            assert!(r.headers.contains(&(k, v.to_string())), "{k}");
        }
    }

    #[test]
    fn adapter_mode_splits_by_adapter_and_sends_sweeping_events_everywhere() {
        let mut removed = Event::new(
            EventKind::Removed,
            "pod-a#dp1",
            PartitionKey::new("acme", "llama", ""),
        );
        removed.block_hashes = vec![EngineHash(1)];
        let payload = encode::to_vllm(&[stored("sql", 1), stored("", 2), removed], 1);
        let mut adapters = BTreeSet::new();
        let b = labels()
            .batch(PartitionBy::Adapter, 4, 0, &payload, &mut adapters)
            .unwrap();
        assert_eq!(b.events, 3);
        assert_eq!(b.new_adapters, vec!["sql".to_string()]);
        let keys: Vec<&str> = b.records.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(
            keys,
            [r#"["acme","llama","sql"]"#, r#"["acme","llama",""]"#]
        );
        let opts = DecodeSettings::default();
        for r in &b.records {
            let events = decode_payload(&r.payload, &Envelope::default(), &opts)
                .unwrap()
                .events;
            assert!(events.iter().all(|e| e.engine == "pod-a#dp1" && e.seq == 4));
            // The unscoped removal reaches every adapter partition, as a copy scoped to it.
            let last = events.last().unwrap();
            assert_eq!(last.kind, EventKind::Removed, "{}", r.key);
            assert!(last.adapter_scoped, "{}", r.key);
            assert_eq!(adapter_key(&last.partition), r.key);
        }
        let fence = labels().fence(PartitionBy::Adapter, 5, &adapters);
        assert_eq!(fence.len(), 2);
        for r in &fence {
            let events = decode_payload(&r.payload, &Envelope::default(), &opts)
                .unwrap()
                .events;
            assert_eq!(events.len(), 1);
            assert_eq!(
                (events[0].kind, events[0].engine.as_str()),
                (EventKind::AdapterCleared, "pod-a#dp1")
            );
            assert_eq!(adapter_key(&events[0].partition), r.key);
        }
    }

    #[test]
    fn an_engine_mode_fence_decodes_as_all_cleared_for_the_rank() {
        let fence = labels().fence(PartitionBy::Engine, 3, &BTreeSet::new());
        let env = Envelope {
            engine: Some("pod-a"),
            model: Some("llama"),
            tenant: Some("acme"),
            dp_rank: Some(1),
        };
        let events = decode_payload(&fence[0].payload, &env, &DecodeSettings::default())
            .unwrap()
            .events;
        assert_eq!(events.len(), 1);
        assert_eq!(
            (events[0].kind, events[0].engine.as_str()),
            (EventKind::AllCleared, "pod-a#dp1")
        );
        assert_eq!(events[0].partition, PartitionKey::new("acme", "llama", ""));
    }
}
