//! The consumer context: librdkafka's rebalance callback (acquire: position from the
//! checkpoint; revoke: persist first, then drop what is buffered) and its log routing.

use super::Shared;
use super::position::Placement;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, TopicPartitionList};
use std::sync::Arc;

/// The consumer context: rebalance handling and log routing.
pub(super) struct Ctx {
    pub(super) shared: Arc<Shared>,
}

impl ClientContext for Ctx {
    fn error(&self, error: KafkaError, reason: &str) {
        match error.rdkafka_error_code() {
            Some(RDKafkaErrorCode::BrokerTransportFailure)
            | Some(RDKafkaErrorCode::AllBrokersDown)
            | Some(RDKafkaErrorCode::Resolve) => {
                self.shared.warn_rate_limited(reason, &error);
            }
            _ => self.shared.error_rate_limited(reason, &error),
        }
    }
}

impl ConsumerContext for Ctx {
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let shared = &self.shared;
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let partitions: Vec<i32> = tpl
            .elements_for_topic(&shared.topic)
            .iter()
            .map(|e| e.partition())
            .collect();
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                let placements = shared.place(consumer, &partitions);
                for pl in &placements {
                    if let Err(e) =
                        tpl.set_partition_offset(&shared.topic, pl.partition, pl.target.offset())
                    {
                        tracing::error!(partition = pl.partition, error = %e, "set offset");
                    }
                }
                shared.record(&placements);
                let res = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = res {
                    tracing::error!(topic = %shared.topic, error = %e, "assigning partitions");
                }
                pause_diverged(consumer, &shared.topic, &placements);
                if placements.is_empty() {
                    return;
                }
                tracing::info!(
                    topic = %shared.topic,
                    partitions = ?placements
                        .iter()
                        .map(|p| (p.partition, p.target))
                        .collect::<Vec<_>>(),
                    "kafka partitions assigned"
                );
            }
            _ => {
                if err == RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS {
                    tracing::info!(
                        topic = %shared.topic,
                        ?partitions,
                        lost = consumer.assignment_lost(),
                        "kafka partitions revoked; persisting checkpoint first"
                    );
                } else {
                    tracing::error!(topic = %shared.topic, ?err, "rebalance error");
                }
                // Everything handed out so far must be durable before another consumer starts
                // from our checkpoint.
                shared.checkpoints.persist_now();
                shared.forget(&partitions);
                let res = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = res {
                    tracing::error!(topic = %shared.topic, error = %e, "unassigning partitions");
                }
            }
        }
    }
}

pub(super) fn pause_diverged<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    placements: &[Placement],
) {
    let mut tpl = TopicPartitionList::new();
    for pl in placements.iter().filter(|p| p.diverged.is_some()) {
        tpl.add_partition(topic, pl.partition);
    }
    if tpl.count() > 0
        && let Err(e) = consumer.pause(&tpl)
    {
        tracing::error!(topic, error = %e, "pausing diverged partitions");
    }
}
