//! The Kafka side of the engine contract, both directions: a message's key is its engine id
//! (so one engine's events stay ordered in one partition), and its headers
//! ([`crate::source::labels`]) name the model and tenant a vLLM payload does not. The publisher
//! builds records from these; the consumer reads them back here.

use rdkafka::message::{Header, Headers, OwnedHeaders};

/// The record key of an engine's events.
pub fn key_of(engine: &str) -> &str {
    engine
}

/// The engine a record's key names (a key that is not UTF-8 names none).
pub fn engine_of(key: Option<&[u8]>) -> Option<String> {
    key.and_then(|k| std::str::from_utf8(k).ok())
        .map(str::to_string)
}

/// Record headers from `(name, value)` pairs.
pub fn headers(pairs: &[(&str, &str)]) -> OwnedHeaders {
    pairs.iter().fold(OwnedHeaders::new(), |h, &(key, value)| {
        h.insert(Header {
            key,
            value: Some(value),
        })
    })
}

/// One header's value, if present and UTF-8.
pub fn header<H: Headers>(headers: Option<&H>, name: &str) -> Option<String> {
    headers?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| std::str::from_utf8(h.value?).ok())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{MODEL_HEADER, TENANT_HEADER, labels};

    #[test]
    fn what_a_publisher_writes_the_consumer_reads_back() {
        let h = headers(&labels("llama", "acme"));
        assert_eq!(header(Some(&h), MODEL_HEADER).as_deref(), Some("llama"));
        assert_eq!(header(Some(&h), TENANT_HEADER).as_deref(), Some("acme"));
        assert_eq!(header(Some(&h), "other"), None);
        assert_eq!(header::<OwnedHeaders>(None, MODEL_HEADER), None);
        let key = key_of("engine-7");
        assert_eq!(engine_of(Some(key.as_bytes())).as_deref(), Some("engine-7"));
        assert_eq!(engine_of(Some(&[0xff, 0xfe])), None);
    }
}
