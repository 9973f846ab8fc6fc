//! The sequence rules for one publisher stream (an engine's DP rank, or one topic on a bound
//! socket): which live batch is forwarded, which is a duplicate, when a gap must be replayed,
//! and when the stream must be fenced. Pure state, no sockets, so every rule is unit-tested.
//!
//! Two watermarks, as in the most careful peers: `last` is the last seq forwarded (live or
//! replayed) in this epoch; `live_high` is the highest seq seen on the live socket since the
//! connection came up. Within one publisher life live seqs only grow, so a live seq at or
//! below `live_high` means the publisher restarted; a live seq at or below `last` but above
//! `live_high` is a batch a replay already forwarded.
//!
//! A fence starts a new epoch with nothing forwarded: whatever comes next is the new base.

/// Where a stream stands durably (what the sink has), kept across bridge restarts.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// Bumped at each fence; forwarded as the `epoch` header.
    pub epoch: u64,
    /// Last seq durable in this epoch and the digest of its payload; `None`: a fence was
    /// started and nothing after it is durable yet (a restart fences again).
    pub seq: Option<u64>,
    pub digest: u64,
}

/// What to do with a live batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    /// The next one (or the first after a fence): forward it.
    Forward,
    /// Already forwarded (by a replay): drop it.
    Duplicate,
    /// Batches `from..seq` are missing: replay them first.
    Gap { from: u64 },
    /// The seq went backwards on the live socket: the publisher restarted.
    Restarted,
}

/// What a probe replay (from the last forwarded seq, on every (re)connection) says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The same publisher life: forward the replayed batches after `last`.
    SameLife,
    /// A different publisher (its batch at `last` differs, or it has not reached `last`), or
    /// its buffer no longer holds `last`: fence.
    Lost,
}

#[derive(Clone, Debug)]
pub struct Sequencer {
    epoch: u64,
    last: Option<u64>,
    last_digest: u64,
    live_high: Option<u64>,
    /// Nothing forwarded since the last fence (a new fence would add nothing).
    clean: bool,
}

impl Sequencer {
    /// A stream resuming from its durable position, or meeting its engine for the first time
    /// (`None`: the index may hold anything for it, so the first connection fences).
    pub fn resume(position: Option<&Position>) -> Sequencer {
        Sequencer {
            epoch: position.map_or(0, |p| p.epoch),
            last: position.and_then(|p| p.seq),
            last_digest: position.map_or(0, |p| p.digest),
            live_high: None,
            clean: false,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The last seq forwarded in this epoch.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Whether a fence now would change nothing (nothing forwarded since the last one).
    pub fn is_clean(&self) -> bool {
        self.clean
    }

    /// Classifies a live batch (call [`saw_live`](Self::saw_live) after handling it).
    pub fn classify_live(&self, seq: u64) -> Live {
        if self.live_high.is_some_and(|high| seq <= high) {
            return Live::Restarted;
        }
        match self.last {
            None => Live::Forward,
            Some(last) if seq == last.wrapping_add(1) => Live::Forward,
            Some(last) if seq <= last => Live::Duplicate,
            Some(last) => Live::Gap { from: last + 1 },
        }
    }

    /// Records a live seq as seen (forwarded or not).
    pub fn saw_live(&mut self, seq: u64) {
        self.live_high = Some(self.live_high.map_or(seq, |h| h.max(seq)));
    }

    /// The connection went down: the next live batch may come from another publisher life.
    pub fn disconnected(&mut self) {
        self.live_high = None;
    }

    /// Whether a replayed batch is new (above the last forwarded).
    pub fn is_new(&self, seq: u64) -> bool {
        self.last.is_none_or(|last| seq > last)
    }

    /// Records a forwarded batch.
    pub fn forwarded(&mut self, seq: u64, digest: u64) {
        self.last = Some(seq);
        self.last_digest = digest;
        self.clean = false;
    }

    /// Starts a new epoch with nothing forwarded; returns it.
    pub fn fence(&mut self) -> u64 {
        self.epoch += 1;
        self.last = None;
        self.live_high = None;
        self.clean = true;
        self.epoch
    }

    /// Judges a probe replay from [`last`](Self::last): `first` is the first replayed batch's
    /// seq and payload digest (`None`: only the end marker came back).
    pub fn judge_probe(&self, first: Option<(u64, u64)>) -> Probe {
        match (self.last, first) {
            (Some(last), Some((seq, digest))) if seq == last && digest == self.last_digest => {
                Probe::SameLife
            }
            _ => Probe::Lost,
        }
    }
}

/// The digest identifying a batch's payload (for the probe).
pub fn digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_duplicate_gap_restart() {
        let mut s = Sequencer::resume(None);
        assert_eq!(
            s.classify_live(5),
            Live::Forward,
            "first batch after a fence is the base"
        );
        s.saw_live(5);
        s.forwarded(5, 1);
        assert_eq!(s.classify_live(6), Live::Forward);
        assert_eq!(s.classify_live(9), Live::Gap { from: 6 });
        // A replay forwards 6..=9; the live 7 queued meanwhile is a duplicate.
        for seq in 6..=9 {
            assert!(s.is_new(seq));
            s.forwarded(seq, seq);
        }
        assert!(!s.is_new(8));
        assert_eq!(s.classify_live(7), Live::Duplicate);
        s.saw_live(7);
        assert_eq!(s.classify_live(10), Live::Forward);
        s.saw_live(10);
        s.forwarded(10, 10);
        // Back to 0 on the live socket: a new publisher life.
        assert_eq!(s.classify_live(0), Live::Restarted);
        assert_eq!(s.classify_live(10), Live::Restarted);
    }

    #[test]
    fn a_fence_starts_a_clean_epoch() {
        let mut s = Sequencer::resume(Some(&Position {
            epoch: 3,
            seq: Some(41),
            digest: 7,
        }));
        assert!(!s.is_clean());
        assert_eq!(s.classify_live(42), Live::Forward);
        assert_eq!(s.fence(), 4);
        assert!(s.is_clean());
        assert_eq!(s.last(), None);
        assert_eq!(s.classify_live(0), Live::Forward);
        s.forwarded(0, 1);
        assert!(!s.is_clean());
    }

    #[test]
    fn probe_needs_the_same_batch_at_the_same_seq() {
        let s = Sequencer::resume(Some(&Position {
            epoch: 1,
            seq: Some(10),
            digest: 99,
        }));
        assert_eq!(s.judge_probe(Some((10, 99))), Probe::SameLife);
        assert_eq!(
            s.judge_probe(Some((10, 98))),
            Probe::Lost,
            "restarted and reached 10"
        );
        assert_eq!(
            s.judge_probe(Some((12, 99))),
            Probe::Lost,
            "buffer moved past 10"
        );
        assert_eq!(s.judge_probe(None), Probe::Lost, "restarted, not yet at 10");
        assert_eq!(
            Sequencer::resume(None).judge_probe(Some((0, 1))),
            Probe::Lost
        );
    }

    #[test]
    fn a_reconnection_forgets_the_live_watermark() {
        let mut s = Sequencer::resume(None);
        s.saw_live(3);
        s.forwarded(3, 0);
        s.disconnected();
        // Not "restarted": the probe decides; live 4 continues.
        assert_eq!(s.classify_live(4), Live::Forward);
    }
}
