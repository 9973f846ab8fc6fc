//! Positioning the durable consumer from kvindex's checkpoint, and keeping it in order: the
//! (re)positioning at connect, after a reconnect, a lost delivery or a pull error (with backoff),
//! the divergence check against the stream's first and last sequence, and the classification of
//! each pulled message (deliver, skip a redelivery below the position, or reposition). See the
//! module docs of `nats` for the contract.

use super::{
    ACK_WAIT, MAX_ACK_PENDING, NatsSource, POSITION_TIMEOUT, PULL_BATCH, PULL_EXPIRES,
    PULL_HEARTBEAT, Pulled, Reader, TRANSIENT_IDLE, Watermarks, nats_err, to_message,
};
use crate::source::{Divergence, SourceError};
use async_nats::jetstream::{
    self,
    consumer::{AckPolicy, DeliverPolicy, pull},
    context::ConsumerInfoErrorKind,
};
use std::sync::atomic::Ordering;
use std::time::Instant;

impl NatsSource {
    pub(super) fn reader_failed(&mut self, why: &str) {
        if self.health.warnings.ready() {
            tracing::warn!(
                position = self.position,
                error = why,
                "nats: pull failed; repositioning the consumer"
            );
        }
        let js = self.js_mut();
        js.reader = None;
        js.retry_at = Some(Instant::now() + js.retry.next_delay());
    }

    /// Repositions if connected and not backing off; true when a reader is ready.
    pub(super) async fn try_reposition(&mut self, deadline: tokio::time::Instant) -> bool {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return false;
        }
        if let Some(at) = self.js().retry_at {
            let at = tokio::time::Instant::from_std(at);
            if at > deadline {
                return false;
            }
            tokio::time::sleep_until(at).await;
        }
        let result = tokio::time::timeout(POSITION_TIMEOUT, self.reposition()).await;
        let error = match result {
            Ok(Ok(())) => {
                self.health.repositions += 1;
                let js = self.js_mut();
                js.retry_at = None;
                js.retry.reset();
                return js.reader.is_some();
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_string(),
        };
        if self.health.warnings.ready() {
            tracing::warn!(position = self.position, error = %error, "nats: cannot position the consumer; retrying");
        }
        let js = self.js_mut();
        js.retry_at = Some(Instant::now() + js.retry.next_delay());
        false
    }

    /// Checks the position against the stream and (re)creates or re-attaches the durable
    /// consumer there. A divergence stops the source (or resets it) and returns `Ok`.
    pub(super) async fn reposition(&mut self) -> Result<(), SourceError> {
        let connects = self.stats.connects.load(Ordering::SeqCst);
        let durable = self.settings.durable.clone();
        let (context, stream_config) = {
            let js = self.js_mut();
            js.reader = None;
            (js.context.clone(), js.stream_config.clone())
        };
        let stream = context
            .get_or_create_stream(stream_config.clone())
            .await
            .map_err(|e| nats_err(&format!("stream `{}`", stream_config.name), e))?;
        let info = stream.cached_info();
        let marks = Watermarks::of(&info.state);
        *self.watermarks.lock() = marks;
        // A stream that exists with other subjects: consume only ours.
        let filter_subject = if info.config.subjects == stream_config.subjects {
            String::new()
        } else if stream_config.subjects.len() == 1 {
            tracing::warn!(stream = %stream_config.name, existing = ?info.config.subjects, configured = ?stream_config.subjects, "nats: stream exists with other subjects; filtering on the configured one");
            stream_config.subjects[0].clone()
        } else {
            tracing::warn!(stream = %stream_config.name, existing = ?info.config.subjects, configured = ?stream_config.subjects, "nats: stream exists with other subjects; consuming all of them");
            String::new()
        };

        let from_start = self.js().from_start;
        if !from_start {
            let k = self.position;
            let divergence = if k > marks.high {
                Some(Divergence::AheadOfLog {
                    stored: k,
                    high: marks.high,
                })
            } else if k < marks.low {
                Some(Divergence::EventsDeleted {
                    stored: k,
                    low: marks.low,
                })
            } else {
                None
            };
            if let Some(d) = divergence {
                self.health.divergences += 1;
                if !self.settings.reset_on_divergence {
                    tracing::error!(source = %self.name, divergence = ?d, first_seq = marks.low, last_seq = marks.high - 1,
                        "nats: checkpoint diverged from the stream; consuming STOPPED (set reset_on_divergence to restart from the stream's first sequence, or rebuild the index)");
                    self.health.divergence = Some(d);
                    return Ok(());
                }
                tracing::warn!(source = %self.name, divergence = ?d, restart_at = marks.low,
                    "nats: checkpoint diverged from the stream; restarting from the stream's first sequence (reset_on_divergence)");
                self.health.reset = Some((d, marks.low));
                self.js_mut().from_start = true;
            }
        }
        let from_start = self.js().from_start;
        let start = if from_start {
            self.position = marks.low;
            DeliverPolicy::All
        } else {
            DeliverPolicy::ByStartSequence {
                start_sequence: self.position as u64,
            }
        };
        let description = owner_description(&self.settings.owner);
        let config = pull::Config {
            durable_name: Some(durable.clone()),
            description: description.clone(),
            inactive_threshold: if self.settings.transient {
                TRANSIENT_IDLE
            } else {
                Default::default()
            },
            deliver_policy: start,
            ack_policy: AckPolicy::All,
            ack_wait: ACK_WAIT,
            max_ack_pending: MAX_ACK_PENDING,
            filter_subject: filter_subject.clone(),
            ..Default::default()
        };

        let reuse = match stream.consumer_info(&durable).await {
            Ok(ci) => {
                if let Some(other) = pulled_by_other_owner(&ci, &description) {
                    return Err(SourceError::Config(format!(
                        "durable consumer `{durable}` is in use by {other}, which is pulling from \
                         it: each replica needs a durable of its own (leave source.nats.durable \
                         at its default, `kvindex-{{replica_id}}`); not touching it"
                    )));
                }
                let delivered = ci.delivered.stream_sequence as i64;
                let at_start = if from_start {
                    delivered < marks.low
                } else {
                    delivered + 1 == self.position
                };
                let ours = ci.config.ack_policy == AckPolicy::All
                    && ci.config.deliver_subject.is_none()
                    && ci.config.ack_wait == ACK_WAIT
                    && ci.config.max_ack_pending == MAX_ACK_PENDING
                    && ci.config.filter_subject == filter_subject
                    && ci.config.description == description;
                let idle = ci.num_ack_pending == 0
                    && ci.ack_floor.stream_sequence == ci.delivered.stream_sequence;
                if !(ours && idle && at_start) {
                    tracing::info!(durable = %durable, delivered, ack_floor = ci.ack_floor.stream_sequence, pending = ci.num_ack_pending, position = self.position,
                        "nats: durable consumer is not at the checkpoint; recreating it there");
                    stream
                        .delete_consumer(&durable)
                        .await
                        .map_err(|e| nats_err(&format!("delete consumer `{durable}`"), e))?;
                }
                ours && idle && at_start
            }
            Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => false,
            Err(e) => return Err(nats_err(&format!("consumer `{durable}` info"), e)),
        };
        let consumer: jetstream::consumer::PullConsumer = if reuse {
            stream
                .get_consumer(&durable)
                .await
                .map_err(|e| nats_err(&format!("consumer `{durable}`"), e))?
        } else {
            stream
                .create_consumer(config)
                .await
                .map_err(|e| nats_err(&format!("create consumer `{durable}`"), e))?
        };
        let last_cseq = consumer.cached_info().delivered.consumer_sequence;
        let messages = consumer
            .stream()
            .max_messages_per_batch(PULL_BATCH)
            .expires(PULL_EXPIRES)
            .heartbeat(PULL_HEARTBEAT)
            .messages()
            .await
            .map_err(|e| nats_err(&format!("pull from consumer `{durable}`"), e))?;
        tracing::info!(source = %self.name, durable = %durable, position = self.position, from_start, reused = reuse, first_seq = marks.low, last_seq = marks.high - 1, "nats: consumer positioned");
        let js = self.js_mut();
        js.held.clear();
        js.seen_connects = connects;
        js.reader = Some(Reader {
            messages,
            last_cseq,
        });
        Ok(())
    }

    /// Classifies one pulled message and updates the position / held acks.
    pub(super) fn pulled(&mut self, m: jetstream::Message) -> Pulled {
        let (seq, cseq, delivered) = match m.info() {
            Ok(i) => (i.stream_sequence as i64, i.consumer_sequence, i.delivered),
            Err(e) => {
                tracing::warn!(subject = %m.subject, error = %e, "nats: message without JetStream metadata skipped");
                return Pulled::Skip;
            }
        };
        let position = self.position;
        let from_start = self.js().from_start;
        let connects = self.stats.connects.load(Ordering::SeqCst);
        let js = self.js_mut();
        if js.seen_connects != connects {
            // The client reconnected since this pull was set up: whatever the old pull now
            // receives may come from a restarted server's older consumer state.
            js.reader = None;
            tracing::info!(
                seq,
                position,
                "nats: reconnected; repositioning the consumer"
            );
            return Pulled::Reposition;
        }
        let Some(reader) = js.reader.as_mut() else {
            return Pulled::Skip;
        };
        if cseq > reader.last_cseq + 1 {
            let lost = cseq - reader.last_cseq - 1;
            js.reader = None;
            tracing::warn!(
                seq,
                position,
                lost,
                "nats: deliveries lost in flight; repositioning to keep order"
            );
            return Pulled::Reposition;
        }
        reader.last_cseq = reader.last_cseq.max(cseq);
        if let Some(reply) = m.message.reply.clone() {
            if js.held.len() >= MAX_ACK_PENDING as usize {
                js.held.pop_front();
            }
            js.held.push_back((seq, reply));
        }
        let redelivery = !from_start && seq < position;
        if redelivery {
            self.health.redeliveries += 1;
            tracing::debug!(
                seq,
                position,
                delivered,
                "nats: redelivery of an uncommitted message"
            );
        } else {
            self.js_mut().from_start = false;
            self.position = seq + 1;
            let mut w = self.watermarks.lock();
            w.high = w.high.max(seq + 1);
        }
        Pulled::Deliver(to_message(&m.message, seq, self.settings.engine_token))
    }
}

/// What a consumer's description says of its owner.
const OWNER_PREFIX: &str = "kvindex replica ";

/// The description of a consumer `owner` makes (`None` without an owner).
fn owner_description(owner: &str) -> Option<String> {
    (!owner.is_empty()).then(|| format!("{OWNER_PREFIX}{owner}"))
}

/// The owner of `ci` (as its description says) when it is not us and is consuming from it:
/// a pull request waiting, or a delivery or ack within the last [`PULL_EXPIRES`]. Consumers
/// without an owner, and owners gone quiet, can be taken over.
fn pulled_by_other_owner(ci: &jetstream::consumer::Info, ours: &Option<String>) -> Option<String> {
    let theirs = ci.config.description.as_deref()?;
    let owner = theirs.strip_prefix(OWNER_PREFIX)?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let quiet_for = PULL_EXPIRES.as_secs() as i64;
    let active = ci.num_waiting > 0
        || [ci.delivered.last_active, ci.ack_floor.last_active]
            .into_iter()
            .flatten()
            .any(|at| now - at.unix_timestamp() < quiet_for);
    (ours.as_deref() != Some(theirs) && active).then(|| format!("replica `{owner}`"))
}
