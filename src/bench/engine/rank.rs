//! One rank's publisher thread, like vLLM's: it owns the PUB, the ROUTER, the monitor and the
//! replay buffer, and in each turn serves at most one replay request, then publishes at most
//! one batch.

use super::{Cmd, Encoding, EngineEvent, HashForm, RankShared, ReplyForm, encode_batch};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{SystemTime, UNIX_EPOCH};

/// One rank's publisher thread: owns the PUB, the ROUTER, the monitor and the buffer.
pub(super) struct RankLoop {
    pub(super) rank: u32,
    pub(super) publisher: zmq::Socket,
    pub(super) router: Option<zmq::Socket>,
    pub(super) monitor: zmq::Socket,
    pub(super) wake: zmq::Socket,
    pub(super) rx: Receiver<Cmd>,
    pub(super) next_seq: u64,
    pub(super) buffer: VecDeque<(u64, Vec<u8>)>,
    pub(super) buffer_steps: usize,
    pub(super) topic: Vec<u8>,
    pub(super) encoding: Encoding,
    pub(super) hash_form: HashForm,
    pub(super) reply_form: ReplyForm,
    pub(super) block_size: u32,
    pub(super) shared: Arc<RankShared>,
}

impl RankLoop {
    pub(super) fn run(mut self) {
        loop {
            let (wake, monitor, replay) = {
                let mut items = vec![
                    self.wake.as_poll_item(zmq::POLLIN),
                    self.monitor.as_poll_item(zmq::POLLIN),
                ];
                if let Some(router) = &self.router {
                    items.push(router.as_poll_item(zmq::POLLIN));
                }
                match zmq::poll(&mut items, 100) {
                    Ok(_) => {}
                    Err(zmq::Error::EINTR) => continue,
                    Err(_) => return, // the context is going away
                }
                let replay = items.get(2).is_some_and(|i| i.is_readable());
                (items[0].is_readable(), items[1].is_readable(), replay)
            };
            if monitor {
                self.drain_monitor();
            }
            // Like vLLM: at most one replay request, then at most one batch, per turn.
            if replay {
                self.serve_replay();
            }
            if wake || !(monitor || replay) {
                let _ = self.wake.recv_bytes(zmq::DONTWAIT);
                match self.rx.try_recv() {
                    Ok(Cmd::Publish { events, send, ack }) => {
                        let _ = ack.send(self.publish(&events, send));
                    }
                    Ok(Cmd::Truncate { keep, ack }) => {
                        while self.buffer.len() > keep {
                            self.buffer.pop_front();
                        }
                        let _ = ack.send(());
                    }
                    Ok(Cmd::Stop) | Err(TryRecvError::Disconnected) => return,
                    Err(TryRecvError::Empty) => {}
                }
            }
        }
    }

    fn publish(&mut self, events: &[EngineEvent], send: bool) -> u64 {
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = encode_batch(
            ts,
            events,
            Some(self.rank),
            self.encoding,
            self.hash_form,
            self.block_size,
        );
        if send {
            let seq_bytes = seq.to_be_bytes();
            // A PUB never blocks: past the high-water mark libzmq drops, as pyzmq's does.
            let _ = self
                .publisher
                .send_multipart([&self.topic[..], &seq_bytes[..], &payload[..]], 0);
        }
        self.buffer.push_back((seq, payload));
        while self.buffer.len() > self.buffer_steps {
            self.buffer.pop_front();
        }
        seq
    }

    fn serve_replay(&mut self) {
        let Some(router) = &self.router else { return };
        let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) else {
            return;
        };
        if frames.len() != 3 {
            return; // vLLM logs "Invalid replay request" and answers nothing
        }
        let identity = &frames[0][..];
        // int.from_bytes(start_seq_bytes, "big"): any length; too big for u64 means "after all".
        let start = frames[2]
            .iter()
            .try_fold(0u64, |acc, &b| {
                acc.checked_mul(256).map(|v| v | u64::from(b))
            })
            .unwrap_or(u64::MAX);
        // Counted before answering, so a client holding the end marker sees the count.
        self.shared.replays.fetch_add(1, Ordering::SeqCst);
        let empty: &[u8] = b"";
        for (seq, payload) in self.buffer.iter().filter(|(seq, _)| *seq >= start) {
            let seq_bytes = seq.to_be_bytes();
            let _ = match self.reply_form {
                ReplyForm::WithTopic => router.send_multipart(
                    [
                        identity,
                        empty,
                        &self.topic[..],
                        &seq_bytes[..],
                        &payload[..],
                    ],
                    0,
                ),
                ReplyForm::NoTopic => {
                    router.send_multipart([identity, empty, &seq_bytes[..], &payload[..]], 0)
                }
            };
        }
        let end = [0xffu8; 8];
        let _ = match self.reply_form {
            ReplyForm::WithTopic => {
                router.send_multipart([identity, empty, empty, &end[..], empty], 0)
            }
            ReplyForm::NoTopic => router.send_multipart([identity, empty, &end[..], empty], 0),
        };
    }

    /// Counts handshakes and disconnections from the PUB's monitor (first frame: event u16 and
    /// value u32, native byte order).
    fn drain_monitor(&mut self) {
        while let Ok(frames) = self.monitor.recv_multipart(zmq::DONTWAIT) {
            let Some(head) = frames.first().filter(|f| f.len() >= 2) else {
                continue;
            };
            let event = u16::from_ne_bytes([head[0], head[1]]);
            let counter = if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw() {
                &self.shared.handshakes
            } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() {
                &self.shared.disconnects
            } else if event == zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL.to_raw()
                || event == zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL.to_raw()
                || event == zmq::SocketEvent::HANDSHAKE_FAILED_AUTH.to_raw()
            {
                &self.shared.handshake_failures
            } else {
                continue;
            };
            counter.fetch_add(1, Ordering::SeqCst);
        }
    }
}
