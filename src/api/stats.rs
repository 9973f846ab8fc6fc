//! `GET /v1/stats` (index, event and lookup counters plus the sources' own report),
//! `GET /v1/engines` (the engines the index knows, merged over shards, with the bridge's state
//! of each engine it follows, a page at a time) and `DELETE /v1/engines/{id}`.

use super::AppState;
use super::error::ApiError;
use crate::bridge::StreamReport;
use crate::event::{PartitionKey, Tier, engine_id};
use crate::index::{EngineInfo, PinnedSize};
use crate::ingest::SourceStatus;
use crate::pipeline::WarmUpReport;
use crate::spill::SpillStats;
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize, Serializer};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

#[derive(Serialize)]
pub struct Partition<'a> {
    pub tenant: &'a str,
    pub model: &'a str,
    pub adapter: &'a str,
}

impl<'a> From<&'a PartitionKey> for Partition<'a> {
    fn from(k: &'a PartitionKey) -> Self {
        Partition {
            tenant: &k.tenant,
            model: &k.model,
            adapter: &k.adapter,
        }
    }
}

/// Blocks by tier, keyed by [`Tier::as_str`] names.
#[derive(Default, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub struct TierCounts {
    pub gpu: u64,
    pub cpu: u64,
    pub disk: u64,
}

#[derive(Serialize)]
pub struct EngineRow<'a> {
    pub engine_id: &'a str,
    pub blocks: u64,
    pub blocks_by_tier: TierCounts,
    pub partitions: Vec<Partition<'a>>,
    /// Distinct adapter names of `partitions` (`""` is the base model), sorted.
    pub adapters: Vec<&'a str>,
    pub last_seen_us: i64,
    /// Events whose producer `seq` went below the highest applied for the engine.
    pub seq_regressions: u64,
    /// The bridge's stream feeding this engine (engine and rank), when a bridge runs here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bridge: Option<StreamReport>,
}

impl<'a> From<&'a EngineInfo> for EngineRow<'a> {
    fn from(e: &'a EngineInfo) -> Self {
        let tier = |t: Tier| e.blocks_by_tier[t as usize];
        let adapters: BTreeSet<&str> = e.partitions.iter().map(|p| p.adapter.as_str()).collect();
        EngineRow {
            engine_id: &e.engine_id,
            blocks: e.blocks,
            blocks_by_tier: TierCounts {
                gpu: tier(Tier::Gpu),
                cpu: tier(Tier::Cpu),
                disk: tier(Tier::Disk),
            },
            partitions: e.partitions.iter().map(Partition::from).collect(),
            adapters: adapters.into_iter().collect(),
            last_seen_us: e.last_seen_us,
            seq_regressions: e.seq_regressions,
            bridge: None,
        }
    }
}

#[derive(Serialize)]
struct EnginesResponse<'a> {
    engines: &'a [EngineRow<'a>],
    /// The cursor of the next page; `None` on the last.
    next: Option<String>,
}

/// The query of `GET /v1/engines`: both optional, as text so that errors name the field.
#[derive(Deserialize)]
pub struct PageQuery {
    limit: Option<String>,
    cursor: Option<String>,
}

/// A page request: at most `limit` engines with ids after `after` (bytes, so any cursor is a
/// position in the order of the ids, even one no id starts with).
#[derive(Debug, PartialEq, Eq)]
struct Page {
    limit: usize,
    after: Option<Vec<u8>>,
}

impl PageQuery {
    /// `limit` (1 or more; lowered to `max_page_size`, which is also the default) and `cursor`
    /// (an opaque token from a previous page's `next`: the hex of the last engine id served).
    fn page(self, max_page_size: usize) -> Result<Page, ApiError> {
        let limit = match self.limit.as_deref() {
            None => max_page_size,
            Some(s) => match s.parse::<u64>() {
                Ok(n) if n >= 1 => usize::try_from(n).unwrap_or(usize::MAX).min(max_page_size),
                _ => {
                    return Err(ApiError::bad_request(format!(
                        "limit: expected an integer of at least 1 (pages hold at most \
                         {max_page_size}), got `{s}`"
                    )));
                }
            },
        };
        let after = match self.cursor.as_deref() {
            None | Some("") => None,
            Some(c) => Some(hex::decode(c).map_err(|_| {
                ApiError::bad_request(
                    "cursor: not a cursor this server gave (pass `next` from the previous page \
                     as is)",
                )
            })?),
        };
        Ok(Page { limit, after })
    }
}

/// `GET /v1/engines?limit=&cursor=`: one page of the engines sorted by id, with the cursor of
/// the next (`null` on the last page). Pages hold at most `http.max_page_size` engines.
///
/// Bodies borrow from locals, so they are serialized here (`Json::into_response` serializes
/// eagerly) rather than returned as `Json<T>`.
pub async fn engines(
    State(state): State<Arc<AppState>>,
    query: Result<Query<PageQuery>, QueryRejection>,
) -> Response {
    let page = match query
        .map_err(|e| ApiError::bad_request(format!("invalid query: {}", e.body_text())))
        .and_then(|Query(q)| q.page(state.max_page_size))
    {
        Ok(page) => page,
        Err(e) => return e.into_response(),
    };
    let engines = state.index.engines();
    let mut rows: Vec<EngineRow<'_>> = engines.iter().map(EngineRow::from).collect();
    let streams = state
        .bridge
        .as_ref()
        .map(|b| b.report())
        .unwrap_or_default();
    let mut bridge_only = Vec::new();
    for stream in streams {
        let id = engine_id(&stream.engine, stream.dp_rank);
        match rows.iter_mut().find(|r| r.engine_id == id) {
            Some(row) => row.bridge = Some(stream),
            None => bridge_only.push((id, stream)),
        }
    }
    // Engines the bridge follows that hold nothing in the index (yet, or since a fence).
    rows.extend(bridge_only.iter().map(|(id, stream)| EngineRow {
        engine_id: id,
        blocks: 0,
        blocks_by_tier: TierCounts::default(),
        partitions: Vec::new(),
        adapters: Vec::new(),
        last_seen_us: 0,
        seq_regressions: 0,
        bridge: Some(stream.clone()),
    }));
    rows.sort_by(|a, b| a.engine_id.cmp(b.engine_id));
    let start = page.after.as_deref().map_or(0, |after| {
        rows.partition_point(|r| r.engine_id.as_bytes() <= after)
    });
    let rest = &rows[start..];
    let served = &rest[..rest.len().min(page.limit)];
    let next = (served.len() < rest.len())
        .then(|| served.last().map(|r| hex::encode(r.engine_id)))
        .flatten();
    Json(&EnginesResponse {
        engines: served,
        next,
    })
    .into_response()
}

/// `DELETE /v1/engines/{id}`: drops the engine from every partition, durably (committed
/// before the answer), on an operator's word; it comes back with its next event.
pub async fn forget_engine(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let Some(pipeline) = state.pipeline.clone() else {
        return ApiError::Unavailable("this server has no index to change".into()).into_response();
    };
    let engine = id.clone();
    match tokio::task::spawn_blocking(move || pipeline.forget_engine(&engine)).await {
        Ok(Some(removed)) => {
            tracing::info!(engine = %id, memberships = removed, "engine cleared on request");
            Json(serde_json::json!({"engine_id": id, "memberships_removed": removed}))
                .into_response()
        }
        Ok(None) => ApiError::UnknownEngine(id).into_response(),
        Err(e) => ApiError::Unavailable(format!("clearing the engine failed: {e}")).into_response(),
    }
}

#[derive(Serialize)]
struct PartitionRow<'a> {
    #[serde(flatten)]
    key: Partition<'a>,
    block_entries: u64,
    memberships: u64,
}

#[derive(Serialize)]
struct IndexConfig<'a> {
    shards: usize,
    partitions: Vec<PartitionRow<'a>>,
    block_entries: u64,
    memberships: u64,
    engines: usize,
    l1_bytes: usize,
    /// `null` while the index is empty.
    l1_bytes_per_membership: Option<f64>,
    /// The block size pinned per (tenant, model), with the events that conflicted with it.
    block_sizes: &'a [PinnedSize],
}

#[derive(Serialize)]
struct EventsSection {
    applied: BTreeMap<&'static str, u64>,
    applied_total: u64,
    block_ops: u64,
    malformed: BTreeMap<&'static str, u64>,
    skipped: BTreeMap<&'static str, u64>,
}

#[derive(Serialize)]
struct LookupsSection {
    total: u64,
    errors: u64,
}

#[derive(Serialize)]
struct StatsResponse<'a> {
    /// This replica's id (absent for an index without a data dir of its own).
    #[serde(skip_serializing_if = "Option::is_none")]
    replica_id: Option<&'a str>,
    index: IndexConfig<'a>,
    events: EventsSection,
    lookups: LookupsSection,
    /// `{}` without a source.
    #[serde(serialize_with = "empty_if_none")]
    sources: Option<SourceStatus>,
    /// L1 / L2 sizes, write-back counters and the breaker (absent for an index without a
    /// store behind it).
    #[serde(skip_serializing_if = "Option::is_none")]
    writeback: Option<SpillStats>,
    /// One row per bridge stream (engine and rank), when a bridge runs here.
    #[serde(skip_serializing_if = "Option::is_none")]
    bridge: Option<Vec<StreamReport>>,
    /// The load of L1 after a restart (absent without shard workers). The `index` counters
    /// are exact once `done`.
    #[serde(skip_serializing_if = "Option::is_none")]
    warm_up: Option<WarmUpReport>,
}

pub async fn stats(State(state): State<Arc<AppState>>) -> Response {
    let s = state.index.stats();
    let m = &state.metrics;
    let body = StatsResponse {
        replica_id: Some(state.replica_id.as_str()).filter(|id| !id.is_empty()),
        index: IndexConfig {
            shards: s.shards,
            partitions: s
                .partitions
                .iter()
                .map(|p| PartitionRow {
                    key: Partition::from(&p.key),
                    block_entries: p.block_entries,
                    memberships: p.memberships,
                })
                .collect(),
            block_entries: s.block_entries,
            memberships: s.memberships,
            engines: s.engines,
            l1_bytes: s.l1_bytes,
            l1_bytes_per_membership: (s.memberships > 0)
                .then(|| s.l1_bytes as f64 / s.memberships as f64),
            block_sizes: &s.block_sizes,
        },
        events: EventsSection {
            applied: m.applied(),
            applied_total: m.applied_total(),
            block_ops: m.block_ops.load(Relaxed),
            malformed: m.malformed(),
            skipped: m.skipped(),
        },
        lookups: LookupsSection {
            total: m.lookups.load(Relaxed),
            errors: m.lookup_errors.load(Relaxed),
        },
        sources: state.sources.as_ref().map(|s| s.source_status()),
        writeback: state.spill.as_ref().map(|s| s.stats()),
        bridge: state.bridge.as_ref().map(|b| b.report()),
        warm_up: state.pipeline.as_ref().map(|p| p.warm_up().report()),
    };
    Json(&body).into_response()
}

/// A missing section as `{}`, so clients can always index into it.
fn empty_if_none<S: Serializer, T: Serialize>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => v.serialize(s),
        None => serde_json::Map::new().serialize(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(limit: Option<&str>, cursor: Option<&str>) -> PageQuery {
        PageQuery {
            limit: limit.map(str::to_string),
            cursor: cursor.map(str::to_string),
        }
    }

    #[test]
    fn page_limits_and_cursors() {
        let page = |l, c| query(l, c).page(10);
        assert_eq!(
            page(None, None).unwrap(),
            Page {
                limit: 10,
                after: None
            }
        );
        assert_eq!(page(Some("3"), None).unwrap().limit, 3);
        assert_eq!(page(Some("99999999999999999999"), None).ok(), None);
        assert_eq!(page(Some("1000"), None).unwrap().limit, 10);
        let cursor = hex::encode("engine#dp1");
        assert_eq!(
            page(None, Some(&cursor)).unwrap().after.as_deref(),
            Some(b"engine#dp1".as_slice())
        );
        assert_eq!(page(None, Some("")).unwrap().after, None);
        // Any hex is a position, even bytes no engine id holds.
        assert_eq!(
            page(None, Some("ff")).unwrap().after.as_deref(),
            Some(b"\xff".as_slice())
        );
        for bad in ["0", "-1", "x", ""] {
            let e = page(Some(bad), None).unwrap_err().to_string();
            assert!(e.starts_with("limit: "), "{e}");
        }
        for bad in ["zz", "abc", "f"] {
            let e = page(None, Some(bad)).unwrap_err().to_string();
            assert!(e.starts_with("cursor: "), "{e}");
        }
    }
}
