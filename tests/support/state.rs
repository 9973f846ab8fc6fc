//! Comparing index states, and reading how far a running service has caught up.

use serde_json::Value;

/// Whether the source's log ends sum to at least `log_end` (so the watermarks shown are
/// fresh enough to include what the test produced: Kafka = messages produced, NATS JetStream =
/// messages + 1), and every partition has applied everything up to its high watermark.
pub fn caught_up(stats: &Value, log_end: i64) -> bool {
    let Some(parts) = stats["sources"]["partitions"].as_array() else {
        return false;
    };
    let ends: i64 = parts
        .iter()
        .map(|p| p["high_watermark"].as_i64().unwrap_or(0).max(0))
        .sum();
    !parts.is_empty()
        && ends >= log_end
        && parts.iter().all(|p| {
            let high = p["high_watermark"].as_i64().unwrap_or(-1);
            // The source's position stands in only for an empty partition: elsewhere it runs
            // ahead of what the shards have applied.
            let empty = p["low_watermark"].as_i64() == Some(high);
            let applied = p["applied_offset"]
                .as_i64()
                .or(p["position"].as_i64().filter(|_| empty))
                .unwrap_or(-2);
            high >= 0 && applied >= high
        })
}

/// What two indexes must agree on to hold the same state: per-partition counts, every
/// engine's blocks by tier, and the answer to every query (as sorted rows). Liveness times
/// are left out (they are wall-clock times of application).
#[derive(Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub partitions: Vec<(String, u64, u64)>,
    pub engines: Vec<(String, u64, [u64; 3])>,
    pub answers: Vec<Vec<AnswerRow>>,
}

/// One row of an answer: (engine, matched blocks, fastest tier of the last one, matched
/// blocks per tier).
pub type AnswerRow = (String, u32, String, [u32; 3]);

pub fn fingerprint(
    index: &kvindex::index::Index,
    queries: &[(kvindex::event::PartitionKey, Vec<u32>)],
    block_size: u32,
) -> Fingerprint {
    let stats = index.stats();
    let mut partitions: Vec<_> = stats
        .partitions
        .iter()
        .filter(|p| p.memberships > 0)
        .map(|p| (format!("{:?}", p.key), p.block_entries, p.memberships))
        .collect();
    partitions.sort();
    let mut engines: Vec<_> = index
        .engines()
        .into_iter()
        .filter(|e| e.blocks > 0)
        .map(|e| (e.engine_id, e.blocks, e.blocks_by_tier))
        .collect();
    engines.sort();
    let answers = queries
        .iter()
        .map(|(partition, tokens)| {
            let blocks = kvindex::index::QueryBlocks::Tokens {
                token_ids: tokens.clone(),
                block_size,
                extras: Vec::new(),
            };
            let mut rows: Vec<_> = index
                .lookup(partition, &blocks)
                .1
                .to_vec()
                .into_iter()
                .map(|m| {
                    let tier = format!("{:?}", m.tier);
                    (m.engine_id, m.matched_blocks, tier, m.blocks_on)
                })
                .collect();
            rows.sort();
            rows
        })
        .collect();
    Fingerprint {
        partitions,
        engines,
        answers,
    }
}
