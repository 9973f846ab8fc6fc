//! The engines' ZeroMQ frames, as vLLM's and SGLang's publishers (and TensorRT-LLM's
//! vLLM-compatible one) put them on the wire. Pure functions over byte frames, so they can be
//! tested and fuzzed without a socket.
//!
//! * Live (PUB → SUB): three frames `[topic, seq, payload]`; `seq` is 8 bytes, big-endian,
//!   unsigned (from 0 per publisher instance, or from `time_ns()` for TensorRT-LLM).
//! * Replay request (DEALER → the engine's ROUTER): `[b"", start_seq]`. The empty delimiter
//!   is part of the request (a ROUTER that gets anything else ignores it), and it must come
//!   from a DEALER: a REQ socket takes one reply only.
//! * Replay replies, one per buffered batch with `seq >= start_seq`, in order: `[b"", topic,
//!   seq, payload]` (vLLM ≥ 0.26, SGLang ≥ 0.5.23) or `[b"", seq, payload]` (older vLLM,
//!   SGLang); then an end marker whose last frame is empty (`seq` = `ff×8`).

use thiserror::Error;

/// The `seq` frame of an end-of-replay marker (`-1` as a signed 8-byte integer).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// A frame set that is not what the engines send.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    #[error("sequence frame is {0} bytes, expected 8")]
    SeqLength(usize),
    #[error("replay reply does not start with an empty delimiter frame")]
    NoDelimiter,
}

impl FrameError {
    /// A short, stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            FrameError::FrameCount { .. } => "frame_count",
            FrameError::SeqLength(_) => "seq_length",
            FrameError::NoDelimiter => "no_delimiter",
        }
    }
}

/// One batch as published: its topic, sequence number and msgpack payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub payload: Vec<u8>,
}

/// Reads an 8-byte big-endian sequence frame.
pub fn parse_seq(frame: &[u8]) -> Result<u64, FrameError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| FrameError::SeqLength(frame.len()))
}

/// A live message: exactly `[topic, seq, payload]`.
pub fn parse_live(mut frames: Vec<Vec<u8>>) -> Result<Batch, FrameError> {
    if frames.len() != 3 {
        return Err(FrameError::FrameCount {
            expected: "3 (topic, seq, payload)",
            got: frames.len(),
        });
    }
    let payload = frames.pop().unwrap_or_default();
    let seq = parse_seq(&frames[1])?;
    let topic = frames.swap_remove(0);
    Ok(Batch {
        topic,
        seq,
        payload,
    })
}

/// The replay request for everything from `start_seq` on, as a DEALER sends it.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// One replay reply, as a DEALER receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayReply {
    /// A buffered batch (the topic is empty in the older two-frame form).
    Batch(Batch),
    /// The end of the replay.
    End,
}

/// Parses a replay reply in either generation's form. The end marker is recognised by its
/// empty last frame, whatever precedes it (what every robust consumer does).
pub fn parse_replay(mut frames: Vec<Vec<u8>>) -> Result<ReplayReply, FrameError> {
    if frames.first().is_none_or(|f| !f.is_empty()) {
        return Err(FrameError::NoDelimiter);
    }
    if frames.len() >= 3 && frames.last().is_some_and(Vec::is_empty) {
        return Ok(ReplayReply::End);
    }
    let (topic, seq_at) = match frames.len() {
        4 => (std::mem::take(&mut frames[1]), 2),
        3 => (Vec::new(), 1),
        got => {
            return Err(FrameError::FrameCount {
                expected: "3 or 4 (delimiter, topic?, seq, payload)",
                got,
            });
        }
    };
    let seq = parse_seq(&frames[seq_at])?;
    let payload = frames.pop().unwrap_or_default();
    Ok(ReplayReply::Batch(Batch {
        topic,
        seq,
        payload,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(parts: &[&[u8]]) -> Vec<Vec<u8>> {
        parts.iter().map(|p| p.to_vec()).collect()
    }

    #[test]
    fn live_frames() {
        let seq = 7u64.to_be_bytes();
        let b = parse_live(f(&[b"kv", &seq, b"\x93"])).unwrap();
        assert_eq!(
            (b.topic.as_slice(), b.seq, b.payload.as_slice()),
            (&b"kv"[..], 7, &b"\x93"[..])
        );
        assert_eq!(
            parse_live(f(&[&seq, b"x"])),
            Err(FrameError::FrameCount {
                expected: "3 (topic, seq, payload)",
                got: 2
            })
        );
        assert_eq!(
            parse_live(f(&[b"", b"\x01", b"x"])),
            Err(FrameError::SeqLength(1))
        );
        // Big-endian, unsigned: the top bit is data, not a sign.
        let big = (u64::MAX - 1).to_be_bytes();
        assert_eq!(parse_live(f(&[b"", &big, b""])).unwrap().seq, u64::MAX - 1);
    }

    #[test]
    fn both_reply_generations_and_both_end_markers() {
        let seq = 3u64.to_be_bytes();
        let new = parse_replay(f(&[b"", b"kv", &seq, b"p"])).unwrap();
        let old = parse_replay(f(&[b"", &seq, b"p"])).unwrap();
        let ReplayReply::Batch(new) = new else {
            panic!()
        };
        let ReplayReply::Batch(old) = old else {
            panic!()
        };
        assert_eq!(
            (new.seq, new.topic.as_slice(), new.payload.as_slice()),
            (3, &b"kv"[..], &b"p"[..])
        );
        assert_eq!(
            (old.seq, old.topic.as_slice(), old.payload.as_slice()),
            (3, &b""[..], &b"p"[..])
        );
        assert_eq!(
            parse_replay(f(&[b"", b"", &END_SEQ, b""])),
            Ok(ReplayReply::End)
        );
        assert_eq!(parse_replay(f(&[b"", &END_SEQ, b""])), Ok(ReplayReply::End));
        assert_eq!(
            parse_replay(f(&[b"x", &seq, b"p"])),
            Err(FrameError::NoDelimiter)
        );
        assert_eq!(parse_replay(Vec::new()), Err(FrameError::NoDelimiter));
        assert!(parse_replay(f(&[b"", b"p"])).is_err());
    }

    #[test]
    fn request_has_the_delimiter() {
        let [delim, seq] = replay_request(258);
        assert!(delim.is_empty());
        assert_eq!(seq, vec![0, 0, 0, 0, 0, 0, 1, 2]);
    }
}
