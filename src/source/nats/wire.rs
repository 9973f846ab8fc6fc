//! The NATS side of the engine contract, both directions: a message's subject names its engine
//! (one token of it, `source.nats.engine_token`, the last by default), and its headers
//! ([`crate::source::labels`]) name the model and tenant a vLLM payload does not. Publishers
//! build subjects here; the consumer reads subjects and headers back here.

use async_nats::HeaderMap;

/// The subject an engine's events are published on: `<prefix>.<engine>`, with the engine id
/// made a single subject token (separators, wildcards and whitespace become `_`).
pub fn subject_for(prefix: &str, engine: &str) -> String {
    let token: String = engine
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' => '_',
            c if c.is_whitespace() => '_',
            c => c,
        })
        .collect();
    format!("{}.{token}", prefix.trim_end_matches('.'))
}

/// The engine a subject names: its token `index` (negative counts from the end), if present
/// and non-empty.
pub fn engine_of(subject: &str, index: i32) -> Option<&str> {
    let tokens: Vec<&str> = subject.split('.').collect();
    let i = if index < 0 {
        tokens.len() as i64 + i64::from(index)
    } else {
        i64::from(index)
    };
    let token = *tokens.get(usize::try_from(i).ok()?)?;
    (!token.is_empty()).then_some(token)
}

/// One header's value, if present.
pub fn header(headers: Option<&HeaderMap>, name: &str) -> Option<String> {
    headers
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_token() {
        let s = "kv.events.engine-7";
        assert_eq!(engine_of(s, -1), Some("engine-7"));
        assert_eq!(engine_of(s, 0), Some("kv"));
        assert_eq!(engine_of(s, 2), Some("engine-7"));
        assert_eq!(engine_of(s, -3), Some("kv"));
        assert_eq!(engine_of(s, 3), None);
        assert_eq!(engine_of(s, -4), None);
        assert_eq!(engine_of("a..b", 1), None);
    }

    #[test]
    fn a_published_subject_names_its_engine_back() {
        for engine in ["engine-7", "pod.a", "w*1", "x >y"] {
            let subject = subject_for("kv.events.", engine);
            let back = engine_of(&subject, -1).expect("a token");
            assert_eq!(back, subject_for("", engine).trim_start_matches('.'));
            assert_eq!(subject.split('.').count(), 3, "{subject}");
        }
    }
}
