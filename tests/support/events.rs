//! Building events the way producers send them: [`stored`] by an engine in a partition, then
//! what the event carries.
//!
//! ```ignore
//! let ev = stored("engine-a", llama("")).hashes(1000..1003).tokens(1..=12, 4).event();
//! ```

use kvindex::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, Tier};

/// An event under construction.
pub struct EventBuilder(Event);

/// `engine` stored blocks in `partition` (give them with [`EventBuilder::hashes`]).
pub fn stored(engine: &str, partition: PartitionKey) -> EventBuilder {
    EventBuilder(Event::new(EventKind::Stored, engine, partition))
}

impl EventBuilder {
    /// The engine's own hashes of the blocks, root first.
    pub fn hashes(mut self, hashes: impl IntoIterator<Item = u64>) -> Self {
        self.0.block_hashes = hashes.into_iter().map(EngineHash).collect();
        self
    }

    /// The engine's hashes as raw bytes (32-byte hashes, …).
    pub fn hash_bytes(mut self, hashes: &[&[u8]]) -> Self {
        self.0.block_hashes = hashes.iter().map(|h| EngineHash::from_bytes(h)).collect();
        self
    }

    /// The blocks' tokens, `block_size` per block.
    pub fn tokens(mut self, token_ids: impl IntoIterator<Item = u32>, block_size: u32) -> Self {
        self.0.content = BlockContent::Tokens {
            token_ids: token_ids.into_iter().collect(),
            block_size,
        };
        self
    }

    /// The block the chain continues after.
    pub fn parent(mut self, hash: u64) -> Self {
        self.0.parent_hash = Some(EngineHash(hash));
        self
    }

    pub fn tier(mut self, tier: Tier) -> Self {
        self.0.tier = Some(tier);
        self
    }

    pub fn event(self) -> Event {
        self.0
    }
}

impl From<EventBuilder> for Event {
    fn from(b: EventBuilder) -> Event {
        b.0
    }
}

/// Decodes a vLLM msgpack batch (`[ts, events, …]`) published by engine `e` serving `model`,
/// as the service's vLLM decoder would.
pub fn decode_vllm_batch(
    batch: &rmpv::Value,
    model: &str,
) -> Result<kvindex::event::Decoded, kvindex::event::DecodeError> {
    use kvindex::event::{DecodeSettings, Envelope, Format, VllmSettings, decode_payload};
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, batch).unwrap();
    let settings = DecodeSettings {
        format: Format::Vllm,
        vllm: VllmSettings {
            model: Some(model.into()),
            ..VllmSettings::default()
        },
        ..DecodeSettings::default()
    };
    let envelope = Envelope {
        engine: Some("e"),
        ..Envelope::default()
    };
    decode_payload(&bytes, &envelope, &settings)
}
