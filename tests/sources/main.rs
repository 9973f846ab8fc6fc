//! The sources against real brokers: Kafka through librdkafka's mock cluster (the embedded
//! broker), plain and behind mutual TLS; NATS JetStream at 127.0.0.1:4222 (tests fail loudly if
//! it is absent) and a private nats-server with mutual TLS and a password; `kvindex produce`
//! into both; and the engine bridge against ZeroMQ publishers that behave like vLLM's and
//! SGLang's.

#[path = "../support/mod.rs"]
mod support;

mod bridge;
mod kafka;
mod kafka_secured;
mod nats;
mod nats_secured;
mod produce;
