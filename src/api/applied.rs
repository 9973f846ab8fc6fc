//! How far an answer's replica had applied its source: the `applied` member of every lookup
//! answer, `{"source": "kafka:kv-events", "next_offsets": {"0": 1234, "1": 99}}`.
//!
//! Replicas of one index each read the whole source at their own pace (see `cluster`); a
//! router asking several of them can prefer the answer whose offsets are highest. The offsets
//! are read before the index is, so they are a floor: every event below `next_offsets[p]` of
//! partition `p` is reflected in the answer (later ones may be too). A partition that not
//! every shard has applied anything of yet is absent.

use super::lookup::push_json_str;

/// The offsets, read before a lookup.
pub struct Applied {
    pub source: String,
    /// `(partition, next offset applied)`, by partition.
    pub next_offsets: Vec<(i32, i64)>,
}

impl Applied {
    /// About how many bytes [`Applied::render_member`] writes.
    pub fn size_hint(&self) -> usize {
        48 + self.source.len() + 28 * self.next_offsets.len()
    }

    /// Appends `,"applied":{...}` (a member of the enclosing object).
    pub fn render_member(&self, out: &mut Vec<u8>) {
        let mut num = itoa::Buffer::new();
        out.extend_from_slice(b",\"applied\":{\"source\":");
        push_json_str(out, &self.source);
        out.extend_from_slice(b",\"next_offsets\":{");
        for (i, (partition, next)) in self.next_offsets.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(num.format(*partition).as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(num.format(*next).as_bytes());
        }
        out.extend_from_slice(b"}}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_valid_json_by_partition() {
        let applied = Applied {
            source: "nats:KV \"x\"".into(),
            next_offsets: vec![(0, 12), (3, -1), (10, i64::MAX)],
        };
        let mut out = b"{\"a\":1".to_vec();
        applied.render_member(&mut out);
        out.push(b'}');
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"a": 1, "applied": {"source": "nats:KV \"x\"",
                "next_offsets": {"0": 12, "3": -1, "10": i64::MAX}}})
        );
        assert!(out.len() <= 8 + applied.size_hint());
    }
}
