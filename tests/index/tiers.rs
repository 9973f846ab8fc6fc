//! Holdings by tier: an engine may hold one block on GPU, CPU and disk at once (vLLM's CPU
//! offloading, LMCache), a removal naming a medium drops only that tier, lookups report how
//! much of each engine's prefix sits on each tier, and `tier_weights` rank by a weighted
//! prefix score while the default ranking stays the prefix length.

use crate::support::events::stored;
use kvindex::event::{EngineHash, Event, EventKind, PartitionKey, Tier};
use kvindex::index::{EngineMatch, Index, IndexSettings, LookupOptions, QueryBlocks, TierWeights};

const BS: u32 = 4;

fn part() -> PartitionKey {
    PartitionKey::new("acme", "llama", "")
}

fn indexes() -> Vec<Index> {
    [1, 2, 3]
        .into_iter()
        .map(|shards| Index::new(IndexSettings { shards, seed: 5 }))
        .collect()
}

/// Tokens of the first `blocks` blocks of prompt `family`.
fn tokens(family: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BS).map(|t| family * 10_000 + t).collect()
}

/// `engine` stores blocks `0..blocks` of `family` on `tier` (`None`: naming no tier).
fn store(engine: &str, family: u32, blocks: u32, tier: Option<Tier>) -> Event {
    let mut ev = stored(engine, part())
        .hashes((0..blocks as u64).map(|b| u64::from(family) << 32 | b))
        .tokens(tokens(family, blocks), BS)
        .event();
    ev.tier = tier;
    ev
}

/// `engine` removes blocks `from..to` of `family` from `tier` (`None`: naming no medium).
fn remove(engine: &str, family: u32, from: u32, to: u32, tier: Option<Tier>) -> Event {
    let mut ev = Event::new(EventKind::Removed, engine, part());
    ev.block_hashes = (from..to)
        .map(|b| EngineHash(u64::from(family) << 32 | u64::from(b)))
        .collect();
    ev.tier = tier;
    ev
}

fn query(family: u32, blocks: u32) -> QueryBlocks {
    QueryBlocks::Tokens {
        token_ids: tokens(family, blocks),
        block_size: BS,
        extras: Vec::new(),
    }
}

fn lookup(index: &Index, family: u32, blocks: u32) -> Vec<EngineMatch> {
    index.lookup(&part(), &query(family, blocks)).1.to_vec()
}

fn row(engine: &str, matched: u32, tier: Tier, blocks_on: [u32; 3]) -> EngineMatch {
    EngineMatch {
        engine_id: engine.into(),
        matched_blocks: matched,
        tier,
        blocks_on,
        score: None,
    }
}

fn apply(index: &Index, ev: &Event) {
    index.apply(ev, 1).expect("applies");
}

#[test]
fn a_block_offloaded_to_cpu_stays_matched_when_the_gpu_evicts_it() {
    use Tier::*;
    for index in indexes() {
        apply(&index, &store("e", 1, 4, Some(Gpu)));
        // vLLM's CPU offloading: the same blocks stored again, naming CPU.
        apply(&index, &store("e", 1, 4, Some(Cpu)));
        assert_eq!(lookup(&index, 1, 4), [row("e", 4, Gpu, [4, 4, 0])]);
        let engine = &index.engines()[0];
        assert_eq!((engine.blocks, engine.blocks_by_tier), (4, [4, 4, 0]));
        assert_eq!(index.stats().memberships, 4);

        // The GPU evicts the last two blocks: the CPU copies still match.
        apply(&index, &remove("e", 1, 2, 4, Some(Gpu)));
        assert_eq!(lookup(&index, 1, 4), [row("e", 4, Cpu, [2, 4, 0])]);
        let engine = &index.engines()[0];
        assert_eq!((engine.blocks, engine.blocks_by_tier), (4, [2, 4, 0]));

        // Removing a tier the engine does not hold the block on changes nothing.
        apply(&index, &remove("e", 1, 2, 4, Some(Disk)));
        assert_eq!(lookup(&index, 1, 4), [row("e", 4, Cpu, [2, 4, 0])]);

        // The CPU drops block 3: the match ends at block 3, and the engine's hash map
        // forgot it (a later removal of it is a no-op, a re-store is a new membership).
        apply(&index, &remove("e", 1, 3, 4, Some(Cpu)));
        assert_eq!(lookup(&index, 1, 4), [row("e", 3, Cpu, [2, 3, 0])]);
        assert_eq!(index.stats().memberships, 3);
        let map_entries: usize = (0..index.shard_count())
            .flat_map(|s| {
                let shard = index.shard(s).read();
                shard
                    .engines()
                    .flat_map(|e| e.map_sizes().map(|(_, n)| n))
                    .collect::<Vec<_>>()
            })
            .sum();
        assert_eq!(map_entries, 3);
    }
}

#[test]
fn a_removal_naming_no_medium_drops_every_tier() {
    use Tier::*;
    for index in indexes() {
        apply(&index, &store("e", 1, 3, None));
        apply(&index, &store("e", 1, 3, Some(Cpu)));
        apply(&index, &store("e", 1, 3, Some(Disk)));
        // A store naming no tier is on GPU.
        assert_eq!(lookup(&index, 1, 3), [row("e", 3, Gpu, [3, 3, 3])]);
        apply(&index, &remove("e", 1, 1, 3, None));
        assert_eq!(lookup(&index, 1, 3), [row("e", 1, Gpu, [1, 1, 1])]);
        let engine = &index.engines()[0];
        assert_eq!((engine.blocks, engine.blocks_by_tier), (1, [1, 1, 1]));
        // An ALL_CLEARED drops every tier too.
        apply(&index, &Event::new(EventKind::AllCleared, "e", part()));
        assert!(lookup(&index, 1, 3).is_empty());
        assert_eq!(index.stats().memberships, 0);
    }
}

#[test]
fn tier_weights_rank_by_the_weighted_prefix_and_the_default_ranking_is_unchanged() {
    use Tier::*;
    for index in indexes() {
        // "cpu" holds 4 blocks on CPU only, "gpu" 3 on GPU, "both" 2 on GPU and CPU.
        apply(&index, &store("cpu", 1, 4, Some(Cpu)));
        apply(&index, &store("gpu", 1, 3, Some(Gpu)));
        apply(&index, &store("both", 1, 2, Some(Gpu)));
        apply(&index, &store("both", 1, 2, Some(Cpu)));
        // Default: by prefix length.
        let names = |rows: &[EngineMatch]| -> Vec<String> {
            rows.iter().map(|r| r.engine_id.clone()).collect()
        };
        assert_eq!(names(&lookup(&index, 1, 4)), ["cpu", "gpu", "both"]);
        assert!(lookup(&index, 1, 4).iter().all(|r| r.score.is_none()));

        let weighted = |w: [f64; 3], limit: usize| {
            let options = LookupOptions {
                limit,
                tier_weights: Some(TierWeights(w)),
                ..LookupOptions::default()
            };
            let rows = index
                .lookup_with(&part(), &query(1, 4), &options)
                .1
                .to_vec();
            let scores: Vec<f64> = rows.iter().map(|r| r.score.unwrap()).collect();
            (names(&rows), scores)
        };
        // GPU 1, CPU 0.5: gpu 3.0 > both 2.0 = cpu 2.0 (tie: the longer prefix first).
        assert_eq!(
            weighted([1.0, 0.5, 0.25], usize::MAX),
            (
                vec!["gpu".into(), "cpu".into(), "both".into()],
                vec![3.0, 2.0, 2.0]
            )
        );
        // The best one alone, as a router asking for one engine gets it.
        assert_eq!(
            weighted([1.0, 0.5, 0.25], 1),
            (vec!["gpu".into()], vec![3.0])
        );
        // A block on two tiers is worth its best one: CPU above GPU makes "both" 2 × 4.
        assert_eq!(
            weighted([1.0, 4.0, 0.0], usize::MAX),
            (
                vec!["cpu".into(), "both".into(), "gpu".into()],
                vec![16.0, 8.0, 3.0]
            )
        );
        // Equal weights rank as the default does.
        assert_eq!(weighted([1.0; 3], usize::MAX).0, ["cpu", "gpu", "both"]);
    }
}
