//! Positioning partitions from kvindex's checkpoint: where each acquired partition starts (the
//! stored next offset, or the configured start), whether that offset still fits the log
//! (divergence), what to do when it does not, and the watermarks behind those decisions and
//! behind `status()`.

use super::rebalance::{Ctx, pause_diverged};
use super::{Inner, Mode, PartState, QUERY_TIMEOUT, REFRESH_EVERY, Shared, State};
use crate::config::StartPosition;
use crate::source::Divergence;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Whether a stored next offset can be resumed from, given the partition's watermarks.
/// `stored == high` is fine (nothing new yet); `stored == low` is the oldest retained event.
pub fn check_divergence(stored: i64, low: i64, high: i64) -> Option<Divergence> {
    if stored > high {
        Some(Divergence::AheadOfLog { stored, high })
    } else if stored < low {
        Some(Divergence::EventsDeleted { stored, low })
    } else {
        None
    }
}

/// Where a partition is (re)positioned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    At(i64),
    Beginning,
    End,
}

impl Target {
    pub(super) fn offset(self) -> Offset {
        match self {
            Target::At(o) => Offset::Offset(o),
            Target::Beginning => Offset::Beginning,
            Target::End => Offset::End,
        }
    }
}

/// The decision for one partition being acquired or re-checked.
pub(super) struct Placement {
    pub(super) partition: i32,
    pub(super) target: Target,
    /// Set when the partition must not be consumed.
    pub(super) diverged: Option<Divergence>,
    pub(super) watermarks: Option<(i64, i64)>,
}

impl Placement {
    pub(super) fn position(&self) -> i64 {
        match (self.target, self.watermarks) {
            (Target::At(o), _) => o,
            (Target::Beginning, Some((low, _))) => low,
            (Target::End, Some((_, high))) => high,
            _ => -1,
        }
    }
}

/// What to do about a partition whose position is unusable.
pub(super) enum Resolution {
    /// Continue from the configured start.
    Start,
    /// Continue from this offset (ephemeral log start).
    At(i64),
    /// Stop consuming it.
    Stop,
}

impl Shared {
    /// Decides what to do about a divergence (and logs it / counts it).
    pub(super) fn resolve(&self, partition: i32, d: &Divergence, low: i64) -> Resolution {
        let topic = &self.topic;
        match d {
            Divergence::AheadOfLog { stored, high } if self.log_is_ephemeral => {
                let mut st = self.state.lock();
                if !st.ephemeral_logged {
                    st.ephemeral_logged = true;
                    tracing::info!(
                        topic,
                        partition,
                        stored,
                        high,
                        "the embedded broker's log is new since the checkpoint was written; \
                         partitions restart at the log start (logged once)"
                    );
                }
                // The new log's offsets start over: what the shards applied of the old one
                // must not make them skip the new one's messages as duplicates.
                st.resets.push(partition);
                Resolution::At(low)
            }
            _ if self.reset_on_divergence => {
                self.state.lock().resets.push(partition);
                tracing::warn!(
                    topic,
                    partition,
                    divergence = ?d,
                    start = ?self.start,
                    "checkpoint diverged from the log; reset_on_divergence: restarting the \
                     partition from the configured start"
                );
                Resolution::Start
            }
            _ => {
                self.divergences.fetch_add(1, Ordering::Relaxed);
                match d {
                    Divergence::AheadOfLog { stored, high } => tracing::error!(
                        topic,
                        partition,
                        stored,
                        high,
                        "checkpoint is ahead of the log (stored next offset > high watermark): \
                         partition stopped; the topic was probably recreated"
                    ),
                    Divergence::EventsDeleted { stored, low } => tracing::error!(
                        topic,
                        partition,
                        stored,
                        low,
                        "events were deleted before kvindex read them (log start > stored next \
                         offset): partition stopped"
                    ),
                }
                Resolution::Stop
            }
        }
    }

    /// Positions `partitions` from the checkpoint store (or the configured start), checking
    /// each stored offset against the log. Blocks on broker queries (bounded by timeouts).
    pub(super) fn place(&self, consumer: &BaseConsumer<Ctx>, partitions: &[i32]) -> Vec<Placement> {
        let wms = match fetch_watermarks(consumer, &self.topic, partitions, QUERY_TIMEOUT) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(
                    topic = %self.topic,
                    error = %e,
                    "cannot fetch watermarks while positioning partitions; stored offsets are \
                     used unchecked (an out-of-range fetch is still reported as divergence)"
                );
                HashMap::new()
            }
        };
        let mut out = Vec::with_capacity(partitions.len());
        let mut need_start = Vec::new();
        for &p in partitions {
            let wm = wms.get(&p).copied();
            let stored = self.checkpoints.next_offset(&self.source_name, p);
            let mut placement = Placement {
                partition: p,
                target: Target::End,
                diverged: None,
                watermarks: wm,
            };
            match (stored, wm) {
                (Some(s), Some((low, high))) => match check_divergence(s, low, high) {
                    None => placement.target = Target::At(s),
                    Some(d) => match self.resolve(p, &d, low) {
                        Resolution::At(o) => placement.target = Target::At(o),
                        Resolution::Start => need_start.push(out.len()),
                        Resolution::Stop => {
                            placement.target = Target::At(s);
                            placement.diverged = Some(d);
                        }
                    },
                },
                (Some(s), None) => placement.target = Target::At(s),
                (None, _) => need_start.push(out.len()),
            }
            out.push(placement);
        }
        if !need_start.is_empty() {
            let parts: Vec<i32> = need_start.iter().map(|&i| out[i].partition).collect();
            let targets = self.start_targets(consumer, &parts);
            for (i, t) in need_start.into_iter().zip(targets) {
                out[i].target = t;
            }
        }
        out
    }

    /// The configured start for each partition.
    pub(super) fn start_targets(
        &self,
        consumer: &BaseConsumer<Ctx>,
        partitions: &[i32],
    ) -> Vec<Target> {
        match self.start {
            StartPosition::Earliest => vec![Target::Beginning; partitions.len()],
            StartPosition::Latest => vec![Target::End; partitions.len()],
            StartPosition::TimeUs(us) => {
                let mut tpl = TopicPartitionList::new();
                for &p in partitions {
                    // Timestamps are milliseconds in Kafka.
                    let _ = tpl.add_partition_offset(
                        &self.topic,
                        p,
                        Offset::Offset(us.div_euclid(1000)),
                    );
                }
                match consumer.offsets_for_times(tpl, QUERY_TIMEOUT) {
                    Ok(res) => partitions
                        .iter()
                        .map(|&p| {
                            match res.find_partition(&self.topic, p).map(|e| e.offset()) {
                                Some(Offset::Offset(o)) => Target::At(o),
                                // -1: no message at or after the time (Kafka semantics: end).
                                Some(Offset::End) => Target::End,
                                other => {
                                    tracing::warn!(
                                        topic = %self.topic, partition = p, result = ?other,
                                        "offsets_for_times gave no offset; starting at the \
                                         log start rather than skipping events"
                                    );
                                    Target::Beginning
                                }
                            }
                        })
                        .collect(),
                    Err(e) => {
                        tracing::warn!(
                            topic = %self.topic, error = %e,
                            "offsets_for_times failed; starting at the log start rather than \
                             skipping events"
                        );
                        vec![Target::Beginning; partitions.len()]
                    }
                }
            }
        }
    }

    /// Records placements as the partitions now held.
    pub(super) fn record(&self, placements: &[Placement]) {
        let mut st = self.state.lock();
        for pl in placements {
            let (low, high) = pl.watermarks.unwrap_or((-1, -1));
            st.parts.insert(
                pl.partition,
                PartState {
                    position: pl.position(),
                    low,
                    high,
                    divergence: pl.diverged.clone(),
                },
            );
            if let Some((_, high)) = pl.watermarks {
                st.high_at_start.entry(pl.partition).or_insert(high);
            }
        }
    }

    pub(super) fn forget(&self, partitions: &[i32]) {
        let mut st = self.state.lock();
        for p in partitions {
            st.parts.remove(p);
            st.high_at_start.remove(p);
        }
        st.ready.retain(|m| !partitions.contains(&m.partition));
    }

    /// Transient broker trouble (unreachable, transport failures): a warning, and the status's
    /// reason unless a more specific one is already known.
    pub(super) fn warn_rate_limited(&self, what: &str, error: &KafkaError) {
        self.note_trouble(what, error, false);
        if self.warnings.ready() {
            tracing::warn!(topic = %self.topic, %error, "kafka: {what} (retrying)");
        }
    }

    /// Broker trouble with a named cause (a TLS handshake refused, authentication failed): an
    /// error, and the status's reason, over any transient one.
    pub(super) fn error_rate_limited(&self, what: &str, error: &KafkaError) {
        self.note_trouble(what, error, true);
        if self.errors.ready() {
            tracing::error!(topic = %self.topic, %error, reason = what, "librdkafka error (retrying)");
        }
    }

    /// Keeps `what` failed with `error` for the status, until [`Shared::clear_trouble`]. A
    /// transient failure does not replace the cause already known (brokers become
    /// unreachable *because* the handshake failed).
    fn note_trouble(&self, what: &str, error: &KafkaError, specific: bool) {
        let mut trouble = self.trouble.lock();
        if specific || trouble.is_none() {
            *trouble = Some(format!("{what}: {error}"));
        }
    }

    /// An exchange with the brokers succeeded: whatever troubled them is over.
    pub(super) fn clear_trouble(&self) {
        *self.trouble.lock() = None;
    }
}

/// Low and high watermarks of `partitions` in two ListOffsets round trips (not 2 per partition).
pub(super) fn fetch_watermarks<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partitions: &[i32],
    timeout: Duration,
) -> Result<HashMap<i32, (i64, i64)>, KafkaError> {
    if partitions.is_empty() {
        return Ok(HashMap::new());
    }
    let query = |which: Offset| -> Result<HashMap<i32, i64>, KafkaError> {
        let mut tpl = TopicPartitionList::new();
        for &p in partitions {
            tpl.add_partition_offset(topic, p, which)?;
        }
        let res = consumer.offsets_for_times(tpl, timeout)?;
        let mut out = HashMap::new();
        for e in res.elements() {
            if e.error().is_ok()
                && let Offset::Offset(o) = e.offset()
            {
                out.insert(e.partition(), o);
            }
        }
        Ok(out)
    };
    let lows = query(Offset::Beginning)?;
    let highs = query(Offset::End)?;
    Ok(lows
        .into_iter()
        .filter_map(|(p, low)| highs.get(&p).map(|&high| (p, (low, high))))
        .collect())
}

impl Inner {
    /// Explicit mode: assigns the partitions once (retried every second until the broker
    /// answers, if the partition list must come from metadata).
    pub(super) fn assign_explicit(&self) {
        let Mode::Explicit(parts) = &self.mode else {
            return;
        };
        let shared = &self.shared;
        {
            let mut st = shared.state.lock();
            if st.explicit_assigned
                || st
                    .last_assign_attempt
                    .is_some_and(|t| t.elapsed() < REFRESH_EVERY)
            {
                return;
            }
            st.last_assign_attempt = Some(Instant::now());
        }
        let partitions = match parts {
            Some(p) => p.clone(),
            None => match self
                .consumer
                .fetch_metadata(Some(&shared.topic), QUERY_TIMEOUT)
            {
                Ok(md) => {
                    shared.clear_trouble();
                    let t = md.topics().iter().find(|t| t.name() == shared.topic);
                    match t {
                        Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                            t.partitions().iter().map(|p| p.id()).collect()
                        }
                        _ => {
                            tracing::warn!(topic = %shared.topic, "topic not found (retrying)");
                            return;
                        }
                    }
                }
                Err(e) => {
                    shared.warn_rate_limited("fetching metadata", &e);
                    return;
                }
            },
        };
        let placements = shared.place(&self.consumer, &partitions);
        let mut tpl = TopicPartitionList::new();
        for pl in &placements {
            let _ = tpl.add_partition_offset(&shared.topic, pl.partition, pl.target.offset());
        }
        shared.record(&placements);
        if let Err(e) = self.consumer.assign(&tpl) {
            tracing::error!(topic = %shared.topic, error = %e, "assigning partitions");
            return;
        }
        pause_diverged(&self.consumer, &shared.topic, &placements);
        shared.state.lock().explicit_assigned = true;
        tracing::info!(
            topic = %shared.topic,
            partitions = ?placements.iter().map(|p| (p.partition, p.target)).collect::<Vec<_>>(),
            "kafka partitions assigned (explicit)"
        );
    }

    /// After an out-of-range error: classifies every active partition's position against the
    /// log; diverged ones are stopped / reset, the others are re-seeked to their position so a
    /// partition whose fetcher stopped on the error resumes.
    pub(super) fn recheck(&self) {
        let shared = &self.shared;
        let active: Vec<(i32, i64)> = {
            let mut st = shared.state.lock();
            if !st.needs_check || st.last_check.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
                return;
            }
            st.last_check = Some(Instant::now());
            st.parts
                .iter()
                .filter(|(_, s)| s.divergence.is_none())
                .map(|(&p, s)| (p, s.position))
                .collect()
        };
        let parts: Vec<i32> = active.iter().map(|&(p, _)| p).collect();
        let wms = match fetch_watermarks(&self.consumer, &shared.topic, &parts, QUERY_TIMEOUT) {
            Ok(w) => w,
            Err(e) => {
                shared.warn_rate_limited("fetching watermarks for an out-of-range check", &e);
                return;
            }
        };
        shared.state.lock().needs_check = false;
        let mut to_start = Vec::new();
        let mut stopped = Vec::new();
        for (p, pos) in active {
            let Some(&(low, high)) = wms.get(&p) else {
                continue;
            };
            let target = match (pos >= 0)
                .then(|| check_divergence(pos, low, high))
                .flatten()
            {
                None => {
                    if pos >= 0 {
                        Some(Target::At(pos))
                    } else {
                        None
                    }
                }
                Some(d) => match shared.resolve(p, &d, low) {
                    Resolution::At(o) => Some(Target::At(o)),
                    Resolution::Start => {
                        to_start.push(p);
                        None
                    }
                    Resolution::Stop => {
                        stopped.push(Placement {
                            partition: p,
                            target: Target::At(pos),
                            diverged: Some(d),
                            watermarks: Some((low, high)),
                        });
                        None
                    }
                },
            };
            if let Some(t) = target {
                self.seek(p, t, Some((low, high)));
            }
        }
        if !to_start.is_empty() {
            let targets = shared.start_targets(&self.consumer, &to_start);
            for (p, t) in to_start.into_iter().zip(targets) {
                self.seek(p, t, wms.get(&p).copied());
            }
        }
        if !stopped.is_empty() {
            pause_diverged(&self.consumer, &shared.topic, &stopped);
            let mut st = shared.state.lock();
            for pl in &stopped {
                if let Some(ps) = st.parts.get_mut(&pl.partition) {
                    ps.divergence = pl.diverged.clone();
                }
            }
            st.ready
                .retain(|m| !stopped.iter().any(|s| s.partition == m.partition));
        }
    }

    pub(super) fn seek(&self, partition: i32, target: Target, wm: Option<(i64, i64)>) {
        let shared = &self.shared;
        let pl = Placement {
            partition,
            target,
            diverged: None,
            watermarks: wm,
        };
        if let Err(e) = self
            .consumer
            .seek(&shared.topic, partition, target.offset(), QUERY_TIMEOUT)
        {
            tracing::error!(topic = %shared.topic, partition, ?target, error = %e, "seek failed");
            shared.state.lock().needs_check = true;
            return;
        }
        let mut st = shared.state.lock();
        if let Some(ps) = st.parts.get_mut(&partition) {
            ps.position = pl.position();
            if let Some((low, high)) = wm {
                ps.low = low;
                ps.high = high;
            }
        }
    }
}

/// Refreshes the watermarks of held partitions about once a second until `stop`.
pub(super) fn refresh_loop(weak: Weak<Inner>, stop: Arc<AtomicBool>) {
    let tick = Duration::from_millis(50);
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if Instant::now() < next {
            std::thread::sleep(tick);
            continue;
        }
        next = Instant::now() + REFRESH_EVERY;
        let Some(inner) = weak.upgrade() else {
            return;
        };
        let shared = &inner.shared;
        let parts: Vec<i32> = shared.state.lock().parts.keys().copied().collect();
        if parts.is_empty() {
            continue;
        }
        let timeout = Duration::from_secs(1);
        let wms = match fetch_watermarks(&inner.consumer, &shared.topic, &parts, timeout) {
            Ok(wms) => wms,
            Err(e) => {
                shared.warn_rate_limited("refreshing watermarks", &e);
                continue;
            }
        };
        shared.clear_trouble();
        let mut st = shared.state.lock();
        let State {
            parts,
            high_at_start,
            ..
        } = &mut *st;
        for (p, (low, high)) in wms {
            if let Some(ps) = parts.get_mut(&p) {
                ps.low = low;
                ps.high = high;
                high_at_start.entry(p).or_insert(high);
            }
        }
    }
}
