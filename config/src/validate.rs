//! The rules a loaded [`Config`] must satisfy beyond its types: ranges, cross-field rules, and
//! values that must parse (listen address, start position). The error names the first field
//! that breaks one.

use super::load::LORA_NAMES;
use super::{Config, ConfigError, MAX_FLUSH_INTERVAL_S, SourceKind, StartPosition};
use std::net::SocketAddr;

impl Config {
    /// Checks every rule; the error names the first field that breaks one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn bad(field: &str, reason: impl Into<String>) -> ConfigError {
            ConfigError::invalid(field, reason)
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(bad("data_dir", "must not be empty"));
        }
        if let Err(e) = self.http.listen.parse::<SocketAddr>() {
            return Err(bad(
                "http.listen",
                format!(
                    "must be a socket address like 127.0.0.1:8080, got `{}` ({e})",
                    self.http.listen
                ),
            ));
        }
        if self.http.max_body_bytes < 1024 {
            return Err(bad(
                "http.max_body_bytes",
                format!("must be at least 1024, got {}", self.http.max_body_bytes),
            ));
        }
        self.validate_http()?;
        if self.source.max_payload_bytes == 0 {
            return Err(bad("source.max_payload_bytes", "must be at least 1, got 0"));
        }
        if self.source.max_inflight_bytes < 1 << 20 {
            return Err(bad(
                "source.max_inflight_bytes",
                format!(
                    "must be at least 1048576 (1 MiB), got {}",
                    self.source.max_inflight_bytes
                ),
            ));
        }
        let kafka = &self.source.kafka;
        if StartPosition::parse(&kafka.start).is_none() {
            return Err(bad(
                "source.kafka.start",
                format!(
                    "must be earliest, latest or an RFC 3339 time (e.g. 2025-01-31T12:00:00Z), got `{}`",
                    kafka.start
                ),
            ));
        }
        if let Some(p) = kafka.partitions.iter().find(|&&p| p < 0) {
            return Err(bad(
                "source.kafka.partitions",
                format!("partition numbers are ≥ 0, got {p}"),
            ));
        }
        if self.source.kind == SourceKind::Kafka {
            for (field, value) in [
                ("source.kafka.brokers", &kafka.brokers),
                ("source.kafka.topic", &kafka.topic),
            ] {
                if value.trim().is_empty() {
                    return Err(bad(field, "must not be empty when source.kind = \"kafka\""));
                }
            }
        }
        let nats = &self.source.nats;
        if nats.subjects.is_empty() {
            return Err(bad(
                "source.nats.subjects",
                "must list at least one subject",
            ));
        }
        if let Some(s) = nats.subjects.iter().find(|s| s.trim().is_empty()) {
            return Err(bad(
                "source.nats.subjects",
                format!("subjects must not be empty, got `{s}`"),
            ));
        }
        self.validate_names()?;
        if self.source.kind == SourceKind::Nats {
            for (field, value) in [
                ("source.nats.url", &nats.url),
                ("source.nats.stream", &nats.stream),
                ("source.nats.durable", &nats.durable),
            ] {
                if value.trim().is_empty() {
                    return Err(bad(field, "must not be empty when source.kind = \"nats\""));
                }
            }
        }
        if let Some((id, _)) = self
            .source
            .vllm
            .lora_names
            .iter()
            .find(|(_, n)| n.is_empty())
        {
            return Err(bad(
                &format!("{LORA_NAMES}.{id}"),
                "adapter name must not be empty",
            ));
        }
        let index = &self.index;
        if index.l1_max_bytes == 0 {
            return Err(bad("index.l1_max_bytes", "must be at least 1, got 0"));
        }
        let (high, low) = (index.high_watermark, index.low_watermark);
        if !(high > 0.0 && high <= 1.0) {
            return Err(bad(
                "index.high_watermark",
                format!("must be in (0, 1], got {high}"),
            ));
        }
        if !(low > 0.0 && low < high) {
            return Err(bad(
                "index.low_watermark",
                format!("must be in (0, index.high_watermark = {high}), got {low}"),
            ));
        }
        let wb = &self.writeback;
        if !(1..=65536).contains(&wb.batch_size) {
            return Err(bad(
                "writeback.batch_size",
                format!("must be in 1..=65536, got {}", wb.batch_size),
            ));
        }
        if wb.periodic_flush_interval < 0 {
            return Err(bad(
                "writeback.periodic_flush_interval",
                format!(
                    "must be ≥ 0 seconds (0 = off), got {}",
                    wb.periodic_flush_interval
                ),
            ));
        }
        if wb.periodic_flush_interval > MAX_FLUSH_INTERVAL_S {
            return Err(bad(
                "writeback.periodic_flush_interval",
                format!(
                    "must be at most {MAX_FLUSH_INTERVAL_S} seconds (one year; 0 = off), got {}",
                    wb.periodic_flush_interval
                ),
            ));
        }
        if wb.emergency_evict_for_restore && !wb.write_back_on_evict {
            return Err(bad(
                "writeback.emergency_evict_for_restore",
                "requires writeback.write_back_on_evict = true (evicting without writing back would lose the entries)",
            ));
        }
        if self.checkpoint.interval_ms == 0 {
            return Err(bad("checkpoint.interval_ms", "must be at least 1, got 0"));
        }
        if self.checkpoint.max_events == 0 {
            return Err(bad("checkpoint.max_events", "must be at least 1, got 0"));
        }
        self.validate_nats()?;
        self.validate_bridge()
    }

    /// The replica id and the consumer names made from it.
    fn validate_names(&self) -> Result<(), ConfigError> {
        let id = &self.cluster.replica_id;
        if !id.is_empty() && !crate::is_valid_replica_id(id) {
            return Err(ConfigError::invalid(
                "cluster.replica_id",
                format!("letters, digits, `-` and `_` only, at most 64 of them, got `{id}`"),
            ));
        }
        let durable = &self.source.nats.durable;
        let forbidden = |c: char| c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\');
        if durable.chars().any(forbidden) {
            return Err(ConfigError::invalid(
                "source.nats.durable",
                format!(
                    "a JetStream consumer name has no whitespace, `.`, `*`, `>`, `/` or `\\`, got `{durable}`"
                ),
            ));
        }
        Ok(())
    }

    /// `[source.nats]`'s credentials: at most one way to authenticate, a user with its
    /// password, TLS client files in pairs. The files themselves are read when connecting.
    fn validate_nats(&self) -> Result<(), ConfigError> {
        let nats = &self.source.nats;
        let user_password = !nats.user.is_empty() || !nats.password.is_empty();
        let ways = [
            !nats.credentials_file.as_os_str().is_empty(),
            !nats.nkey_seed_file.as_os_str().is_empty(),
            user_password,
            !nats.token.is_empty(),
        ];
        if ways.iter().filter(|&&w| w).count() > 1 {
            return Err(ConfigError::invalid(
                "source.nats",
                "give one way to authenticate: credentials_file, nkey_seed_file, user with \
                 KVINDEX_SOURCE__NATS__PASSWORD, or KVINDEX_SOURCE__NATS__TOKEN",
            ));
        }
        if user_password && nats.user.is_empty() {
            return Err(ConfigError::invalid(
                "source.nats.user",
                "must be set with KVINDEX_SOURCE__NATS__PASSWORD",
            ));
        }
        if user_password && nats.password.is_empty() {
            return Err(ConfigError::invalid(
                "source.nats.user",
                "needs a password (KVINDEX_SOURCE__NATS__PASSWORD)",
            ));
        }
        if nats.tls_cert.as_os_str().is_empty() != nats.tls_key.as_os_str().is_empty() {
            return Err(ConfigError::invalid(
                "source.nats.tls_cert",
                "and source.nats.tls_key go together (both or neither)",
            ));
        }
        Ok(())
    }

    /// `[http]` beyond the listen address and body limit: the token's sources, TLS files in
    /// pairs, and the limits. The token file itself is read by
    /// [`HttpConfig::bearer_token`](super::HttpConfig::bearer_token) (at load).
    fn validate_http(&self) -> Result<(), ConfigError> {
        let http = &self.http;
        let has_file = !http.auth_token_file.as_os_str().is_empty();
        if has_file && !http.auth_token.is_empty() {
            return Err(ConfigError::invalid(
                "http.auth_token_file",
                "and KVINDEX_HTTP__AUTH_TOKEN are both set; give the token one way",
            ));
        }
        if http.auth_reads && !has_file && http.auth_token.is_empty() {
            return Err(ConfigError::invalid(
                "http.auth_reads",
                "needs a token (http.auth_token_file or KVINDEX_HTTP__AUTH_TOKEN)",
            ));
        }
        match (
            http.tls_cert.as_os_str().is_empty(),
            http.tls_key.as_os_str().is_empty(),
        ) {
            (false, true) => {
                return Err(ConfigError::invalid(
                    "http.tls_key",
                    "must be set with http.tls_cert (both or neither)",
                ));
            }
            (true, false) => {
                return Err(ConfigError::invalid(
                    "http.tls_cert",
                    "must be set with http.tls_key (both or neither)",
                ));
            }
            _ => {}
        }
        for (field, value) in [
            ("http.request_timeout_ms", http.request_timeout_ms),
            (
                "http.max_concurrent_requests",
                http.max_concurrent_requests as u64,
            ),
            ("http.max_page_size", http.max_page_size as u64),
        ] {
            if value == 0 {
                return Err(ConfigError::invalid(field, "must be at least 1, got 0"));
            }
        }
        Ok(())
    }

    /// `[[bridge.engines]]`: ids, ranks, models. Endpoint syntax per rank is checked where
    /// the ranks' endpoints are derived (`kvindex::bridge::validate`).
    fn validate_bridge(&self) -> Result<(), ConfigError> {
        let mut ids = std::collections::HashSet::new();
        for (i, e) in self.bridge.engines.iter().enumerate() {
            let field = |k: &str| format!("bridge.engines[{i}].{k}");
            if e.id.is_empty() {
                return Err(ConfigError::invalid(&field("id"), "must not be empty"));
            }
            if e.id.contains(['#', '/']) {
                return Err(ConfigError::invalid(
                    &field("id"),
                    format!(
                        "`{}` must not contain `#` or `/` (kvindex derives rank and topic ids with them)",
                        e.id
                    ),
                ));
            }
            if !ids.insert(e.id.as_str()) {
                return Err(ConfigError::invalid(
                    &field("id"),
                    format!("`{}` is configured twice", e.id),
                ));
            }
            if e.endpoint.is_empty() {
                return Err(ConfigError::invalid(&field("endpoint"), "must be set"));
            }
            if e.dp_size == 0 {
                return Err(ConfigError::invalid(
                    &field("dp_size"),
                    "must be at least 1",
                ));
            }
            let model = if e.model.is_empty() {
                &self.source.vllm.model
            } else {
                &e.model
            };
            if model.is_empty() {
                return Err(ConfigError::invalid(
                    &field("model"),
                    "must be set (or source.vllm.model): vLLM and SGLang payloads name no model",
                ));
            }
        }
        Ok(())
    }
}
