//! The replay client: asks an engine's ROUTER for every buffered batch from a seq on, from a
//! DEALER (never REQ, which takes one reply), and collects the replies until the end marker.
//!
//! Every attempt is bounded so one slow engine cannot stall the rest: at most
//! [`MAX_CONCURRENT`] replays run at once in the process, a reply must arrive within
//! [`IDLE_TIMEOUT`] of the previous one, the whole replay within [`TOTAL_TIMEOUT`], and at most
//! [`MAX_BATCHES`] batches are held. A failed attempt drops the socket, so late replies to it
//! are never mistaken for the next attempt's.

use super::frames::{self, Batch, ReplayReply};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Replays in flight at once, over all engines.
pub const MAX_CONCURRENT: usize = 8;
/// Longest wait for the next reply.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest replay.
pub const TOTAL_TIMEOUT: Duration = Duration::from_secs(60);
/// Most batches one replay may hold (vLLM buffers 10,000 by default).
pub const MAX_BATCHES: usize = 200_000;

/// What one replay request brought back.
#[derive(Debug, Default)]
pub struct Replay {
    /// The batches, in the order the engine sent them (libzmq's ROUTER drops replies past its
    /// send high-water mark, so there may be holes).
    pub batches: Vec<Batch>,
    /// Whether the end marker came (else the replay stopped on a timeout after some batches).
    pub complete: bool,
}

/// Why a replay gave nothing usable.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    #[error("malformed reply: {0}")]
    Malformed(#[from] frames::FrameError),
    #[error("more than {MAX_BATCHES} batches")]
    TooLarge,
    #[error("no replay slot free within {0:?}")]
    Busy(Duration),
}

struct Slots {
    used: Mutex<usize>,
    freed: Condvar,
}

static SLOTS: Slots = Slots {
    used: Mutex::new(0),
    freed: Condvar::new(),
};

struct Slot;

impl Slot {
    fn acquire(wait: Duration) -> Option<Slot> {
        let deadline = Instant::now() + wait;
        let mut used = SLOTS.used.lock().unwrap_or_else(PoisonError::into_inner);
        while *used >= MAX_CONCURRENT {
            let left = deadline.checked_duration_since(Instant::now())?;
            used = SLOTS
                .freed
                .wait_timeout(used, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *used += 1;
        Some(Slot)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut used = SLOTS.used.lock().unwrap_or_else(PoisonError::into_inner);
        *used = used.saturating_sub(1);
        SLOTS.freed.notify_one();
    }
}

/// A DEALER connected to one engine's replay endpoint (created on first use).
pub struct ReplayClient {
    ctx: zmq::Context,
    endpoint: String,
    socket: Option<zmq::Socket>,
}

impl ReplayClient {
    pub fn new(ctx: zmq::Context, endpoint: String) -> ReplayClient {
        ReplayClient {
            ctx,
            endpoint,
            socket: None,
        }
    }

    fn socket(&mut self) -> Result<&zmq::Socket, zmq::Error> {
        if self.socket.is_none() {
            let s = self.ctx.socket(zmq::DEALER)?;
            s.set_linger(0)?;
            s.connect(&self.endpoint)?;
            self.socket = Some(s);
        }
        Ok(self.socket.as_ref().expect("just set"))
    }

    /// The buffered batches with `seq >= from` (none: the engine has none).
    pub fn replay(&mut self, from: u64) -> Result<Replay, ReplayError> {
        let _slot = Slot::acquire(TOTAL_TIMEOUT).ok_or(ReplayError::Busy(TOTAL_TIMEOUT))?;
        let result = self.attempt(from);
        if result.is_err() {
            self.socket = None;
        }
        result
    }

    fn attempt(&mut self, from: u64) -> Result<Replay, ReplayError> {
        let socket = self.socket()?;
        let [delimiter, seq] = frames::replay_request(from);
        socket.send_multipart([delimiter, seq], 0)?;
        let started = Instant::now();
        let mut out = Vec::new();
        loop {
            let left = TOTAL_TIMEOUT.saturating_sub(started.elapsed());
            let wait = IDLE_TIMEOUT.min(left);
            let ready = if wait.is_zero() {
                0
            } else {
                socket.poll(zmq::POLLIN, wait.as_millis() as i64)?
            };
            if ready == 0 {
                // The end marker may be among the replies the ROUTER dropped: what came is
                // still usable, and the caller asks again from where it stops.
                if out.is_empty() {
                    return Err(ReplayError::Timeout(wait));
                }
                self.socket = None;
                return Ok(Replay {
                    batches: out,
                    complete: false,
                });
            }
            match frames::parse_replay(socket.recv_multipart(0)?)? {
                ReplayReply::End => {
                    return Ok(Replay {
                        batches: out,
                        complete: true,
                    });
                }
                ReplayReply::Batch(b) => {
                    if out.len() >= MAX_BATCHES {
                        return Err(ReplayError::TooLarge);
                    }
                    out.push(b);
                }
            }
        }
    }
}
