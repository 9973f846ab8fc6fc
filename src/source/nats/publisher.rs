//! Publishing to NATS: JetStream publishes with server acks in a bounded window, or core
//! publishes, with subjects and headers as the consumer reads them back (`wire.rs`). For
//! `kvindex produce --nats` and the tests.

use super::NatsAuth;
use crate::source::SourceError;
use async_nats::HeaderMap;
use async_nats::jetstream;
use std::collections::VecDeque;
use std::time::Duration;

fn nats_err(what: &str, e: impl std::fmt::Display) -> SourceError {
    SourceError::Nats(format!("{what}: {e}"))
}

/// Publishes to NATS: JetStream publish with server acks (`jetstream`), or core publish.
/// For `kvindex produce --nats` and tests.
pub struct NatsPublisher {
    client: async_nats::Client,
    js: Option<jetstream::Context>,
    acks: VecDeque<jetstream::context::PublishAckFuture>,
}

/// JetStream publishes in flight before `send` waits for the oldest ack.
const PUBLISH_WINDOW: usize = 256;

impl NatsPublisher {
    pub async fn connect(url: &str, jetstream: bool) -> Result<NatsPublisher, SourceError> {
        NatsPublisher::connect_with(url, jetstream, &NatsAuth::default()).await
    }

    /// [`NatsPublisher::connect`] to a server that needs TLS or credentials.
    pub async fn connect_with(
        url: &str,
        jetstream: bool,
        auth: &NatsAuth,
    ) -> Result<NatsPublisher, SourceError> {
        let client = auth
            .options()
            .await?
            .name("kvindex-produce")
            .connection_timeout(Duration::from_secs(5))
            .connect(url)
            .await
            .map_err(|e| nats_err(&format!("cannot connect to {url}"), e))?;
        let js = jetstream.then(|| {
            jetstream::ContextBuilder::new()
                .timeout(Duration::from_secs(10))
                .build(client.clone())
        });
        Ok(NatsPublisher {
            client,
            js,
            acks: VecDeque::new(),
        })
    }

    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Creates the stream if missing (JetStream only; a publish to a subject no stream
    /// captures fails).
    pub async fn ensure_stream(
        &self,
        stream: &str,
        subjects: &[String],
    ) -> Result<(), SourceError> {
        if let Some(js) = &self.js {
            js.get_or_create_stream(jetstream::stream::Config {
                name: stream.to_string(),
                subjects: subjects.to_vec(),
                ..Default::default()
            })
            .await
            .map_err(|e| nats_err(&format!("stream `{stream}`"), e))?;
        }
        Ok(())
    }

    /// Publishes one message with headers (an engine's subject: [`super::wire::subject_for`];
    /// its labels: [`crate::source::labels`]). JetStream: waits for the oldest outstanding
    /// ack once [`PUBLISH_WINDOW`] are in flight; `flush` waits for all.
    pub async fn send(
        &mut self,
        subject: &str,
        headers: &[(&str, &str)],
        payload: Vec<u8>,
    ) -> Result<(), SourceError> {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, *v);
        }
        match &self.js {
            Some(js) => {
                if self.acks.len() >= PUBLISH_WINDOW
                    && let Some(ack) = self.acks.pop_front()
                {
                    ack.await.map_err(|e| nats_err("publish ack", e))?;
                }
                let ack = js
                    .publish_with_headers(subject.to_string(), map, payload.into())
                    .await
                    .map_err(|e| nats_err(&format!("publish {subject}"), e))?;
                self.acks.push_back(ack);
            }
            None => self
                .client
                .publish_with_headers(subject.to_string(), map, payload.into())
                .await
                .map_err(|e| nats_err(&format!("publish {subject}"), e))?,
        }
        Ok(())
    }

    /// Waits until every message sent so far is acknowledged (JetStream) or written out.
    pub async fn flush(&mut self) -> Result<(), SourceError> {
        while let Some(ack) = self.acks.pop_front() {
            ack.await.map_err(|e| nats_err("publish ack", e))?;
        }
        self.client.flush().await.map_err(|e| nats_err("flush", e))
    }
}
