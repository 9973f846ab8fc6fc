//! An inference engine's KV-event publisher, for the bridge's tests and benchmark: it publishes
//! over ZeroMQ exactly as vLLM's
//! `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) does, and as SGLang's copy of it
//! (`python/sglang/srt/disaggregation/kv_events.py`) does; it uses the same libzmq as pyzmq.
//!
//! What it reproduces, per data-parallel rank `r` (`0..dp_size`):
//! - a PUB socket bound at `tcp://127.0.0.1:{pub_base + r}` (send high-water mark from the spec,
//!   linger 0) and, with replay on, a ROUTER bound at `tcp://127.0.0.1:{replay_base + r}`;
//! - live messages of three frames `[topic, seq (8 bytes big-endian), payload]`, `seq` counting
//!   from 0 for each publisher instance (or from the start time in ns, [`SeqStart::TimeNs`]);
//!   after the send, `(seq, payload)` joins a replay buffer of the newest `buffer_steps` batches;
//! - payloads as msgspec writes them: the batch `[ts (float64 s), events, dp_rank]`, events either
//!   positional tagged arrays (older vLLM and SGLang, one [`Encoding`] per layout) or maps tagged
//!   by `"type"` ([`Encoding::Map`], current ones), integers in their smallest msgpack form. The
//!   encoder is byte-identical to vLLM's on the recorded payloads in `tests/fixtures/vllm/`;
//! - replay: a DEALER sends `[b"", start_seq]` (the ROUTER sees `[identity, b"", start_seq]`); every
//!   buffered batch with `seq >= start_seq` goes back, oldest first, as
//!   `[identity, b"", topic, seq, payload]` ([`ReplyForm::WithTopic`], current vLLM) or
//!   `[identity, b"", seq, payload]` ([`ReplyForm::NoTopic`], older vLLM, SGLang), then the end
//!   marker `[identity, b"", b"", ff×8, b""]` or `[identity, b"", ff×8, b""]`. A request that is
//!   not three frames is dropped unanswered; `start_seq` is read as a big-endian integer of any
//!   length, as `int.from_bytes(.., "big")` reads it. A start older than the buffer silently
//!   starts at the oldest batch kept; one past the newest gets only the end marker;
//! - one thread per rank owning both sockets, which in each turn serves at most one pending replay
//!   request and then publishes at most one batch, like vLLM's publisher thread.
//!
//! As with the real engines, the ROUTER keeps libzmq's default send high-water mark (1,000
//! messages per peer) and silently drops what does not fit: a replay of a few thousand batches
//! arrives with holes even at a client reading as fast as it can, and to a slow reader without its
//! end marker. A PUB drops live messages to a subscriber that is not connected and subscribed yet
//! (use [`FakeEngine::wait_for_subscribers`] before publishing).
//!
//! ```ignore
//! let engine = FakeEngine::start(EngineSpec { dp_size: 2, ..EngineSpec::vllm() });
//! // point kvindex at engine.endpoint() / engine.replay_endpoint(), then:
//! assert!(engine.wait_for_subscribers(1, Duration::from_secs(10)));
//! let first = chain(&tokens, 16, None, 0);
//! let seq = engine.publish(0, vec![first.clone()]);
//! engine.publish_unsent(0, vec![EngineEvent::removed(vec![1])]); // a gap only replay fills
//! let model = engine.history(0); // everything rank 0 published, in seq order
//! ```

//!
//! Files: here the engine and its rank bookkeeping; `wire.rs` the events and their msgpack
//! encoding (byte-identical to msgspec's); `rank.rs` one rank's publisher thread.

mod rank;
mod wire;

pub use wire::{EngineEvent, block_hashes_of, chain, encode_batch};

use std::collections::VecDeque;
use wire::check_encodable;

use rank::RankLoop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender, SyncSender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How a batch and its events are laid out. msgspec writes every field of a positional
/// (`array_like`) struct, defaults included, so each positional layout has a fixed length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// vLLM 0.9 and SGLang's first copy: batch `[ts, events]` (no DP rank);
    /// `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]`,
    /// `["BlockRemoved", block_hashes]`, `["AllBlocksCleared"]`. Neither `medium` nor `lora_name`
    /// is on the wire: publishing a `lora_name`, or a medium other than GPU, panics.
    ArrayV09,
    /// vLLM 0.11: batch `[ts, events, dp_rank]`; `BlockStored` as in `ArrayV09` plus `medium`
    /// (7 elements), `["BlockRemoved", block_hashes, medium]`. No `lora_name` on the wire:
    /// publishing one panics.
    ArrayV011,
    /// Positional with LoRA names: as `ArrayV011`, `BlockStored` with a trailing `lora_name`
    /// (8 elements, nil when none).
    Array,
    /// Current vLLM (0.34) and SGLang: batch `[ts, events, dp_rank]`, events maps tagged by
    /// `"type"`: `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
    /// "block_size", "lora_id", "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes",
    /// "medium"}`, `{"type": "AllBlocksCleared"}`.
    Map,
}

/// How a replay reply is framed (after `[identity, b""]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyForm {
    /// `[topic, seq, payload]`, end marker `[b"", ff×8, b""]` (current vLLM).
    WithTopic,
    /// `[seq, payload]`, end marker `[ff×8, b""]` (older vLLM, SGLang).
    NoTopic,
}

/// How block hashes (kept as `u64` here) are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashForm {
    /// A non-negative integer in its smallest form, as msgspec writes vLLM's `int` hashes
    /// (`0xcf` uint64 for any hash of 2^32 or more).
    U64,
    /// The same bits as a signed 64-bit integer in its smallest form (SGLang's signed hashes):
    /// hashes of 2^63 or more go out negative (`0xd3` int64 when below -2^31).
    I64,
    /// Always `0xcf` + 8 bytes, even for small values (encoders that do not shrink integers).
    U64Wide,
    /// Always `0xd3` + 8 bytes of the signed value.
    I64Wide,
}

/// Where each publisher instance starts its sequence numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqStart {
    /// 0, as vLLM and SGLang (`itertools.count()`).
    Zero,
    /// The (re)start time in ns since the Unix epoch (TensorRT-LLM style).
    TimeNs,
}

/// What the fake engine looks like on the wire.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    /// Number of data-parallel ranks: publisher `r` binds `pub_base + r` (and `replay_base + r`).
    pub dp_size: u32,
    pub encoding: Encoding,
    pub reply_form: ReplyForm,
    pub hash_form: HashForm,
    pub seq_start: SeqStart,
    /// Whether each rank binds a replay ROUTER.
    pub replay: bool,
    /// Batches kept for replay per rank (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    /// First frame of every live message (and of replies in [`ReplyForm::WithTopic`]).
    pub topic: String,
    /// `block_size` written in every `BlockStored`.
    pub block_size: u32,
    /// The PUB socket's send high-water mark (vLLM's `hwm`).
    pub sndhwm: i32,
}

impl Default for EngineSpec {
    /// Current vLLM: maps, topic in replay replies, unsigned hashes, seq from 0, replay with
    /// 10,000 batches, topic `""`, blocks of 16, PUB high-water mark 100,000, one rank.
    fn default() -> Self {
        EngineSpec {
            dp_size: 1,
            encoding: Encoding::Map,
            reply_form: ReplyForm::WithTopic,
            hash_form: HashForm::U64,
            seq_start: SeqStart::Zero,
            replay: true,
            buffer_steps: 10_000,
            topic: String::new(),
            block_size: 16,
            sndhwm: 100_000,
        }
    }
}

impl EngineSpec {
    /// Current vLLM (the default).
    pub fn vllm() -> Self {
        Self::default()
    }

    /// vLLM 0.11: positional events with `medium`, replies without the topic frame.
    pub fn vllm_legacy() -> Self {
        EngineSpec {
            encoding: Encoding::ArrayV011,
            reply_form: ReplyForm::NoTopic,
            ..Self::default()
        }
    }

    /// SGLang: maps, replies without the topic frame, signed hashes (its first releases wrote
    /// the [`Encoding::ArrayV09`] layout).
    pub fn sglang() -> Self {
        EngineSpec {
            reply_form: ReplyForm::NoTopic,
            hash_form: HashForm::I64,
            ..Self::default()
        }
    }
}

/// The fake engine: one publisher thread per DP rank. Every method is synchronous with the rank
/// threads; the engine can be shared between threads (`&FakeEngine` is `Sync`).
pub struct FakeEngine {
    spec: EngineSpec,
    ctx: zmq::Context,
    pub_base: u16,
    replay_base: Option<u16>,
    /// Names the inproc endpoints of each binding (they must not be reused).
    generation: AtomicU64,
    shared: Vec<Arc<RankShared>>,
    /// The running rank threads; empty once stopped.
    live: Mutex<Vec<RankCtl>>,
}

/// What a rank shows the test, kept across restarts (reset by them).
#[derive(Default)]
struct RankShared {
    history: Mutex<Vec<(u64, Vec<EngineEvent>)>>,
    replays: AtomicU64,
    handshakes: AtomicU64,
    handshake_failures: AtomicU64,
    disconnects: AtomicU64,
}

impl RankShared {
    fn reset(&self) {
        lock(&self.history).clear();
        for counter in [
            &self.replays,
            &self.handshakes,
            &self.handshake_failures,
            &self.disconnects,
        ] {
            counter.store(0, Ordering::SeqCst);
        }
    }
}

struct RankCtl {
    tx: Sender<Cmd>,
    /// Our end of an inproc PAIR: one empty message per command wakes the rank thread's poll.
    wake: zmq::Socket,
    thread: Option<JoinHandle<()>>,
}

enum Cmd {
    Publish {
        events: Vec<EngineEvent>,
        send: bool,
        ack: SyncSender<u64>,
    },
    Truncate {
        keep: usize,
        ack: SyncSender<()>,
    },
    Stop,
}

/// The sockets of one rank, bound.
struct Bound {
    publisher: zmq::Socket,
    router: Option<zmq::Socket>,
    monitor: zmq::Socket,
}

const HOST: &str = "127.0.0.1";
/// Ports are drawn below Linux's ephemeral range (32768+), so no outgoing connection can take
/// one while a restart rebinds it.
const PORT_LO: u16 = 20_000;
const PORT_HI: u16 = 32_000;
const ACK_TIMEOUT: Duration = Duration::from_secs(30);

impl FakeEngine {
    /// Binds every rank's sockets on free ports and starts the rank threads.
    pub fn start(spec: EngineSpec) -> FakeEngine {
        assert!(spec.dp_size >= 1, "dp_size must be at least 1");
        assert!(
            spec.dp_size < u32::from((PORT_HI - PORT_LO) / 2),
            "dp_size {} is too large",
            spec.dp_size
        );
        let ctx = zmq::Context::new();
        let generation = AtomicU64::new(0);
        let span = spec.dp_size as u16;
        let mut attempts = 0;
        let (pub_base, replay_base, bound) = loop {
            let pub_base = random_port(span);
            let replay_base = spec.replay.then(|| random_port(span));
            let g = generation.fetch_add(1, Ordering::SeqCst);
            match bind_all(&ctx, &spec, pub_base, replay_base, g) {
                Ok(bound) => break (pub_base, replay_base, bound),
                Err(zmq::Error::EADDRINUSE) if attempts < 200 => attempts += 1,
                Err(e) => panic!("fake engine: cannot bind its sockets: {e}"),
            }
        };
        let shared = (0..spec.dp_size)
            .map(|_| Arc::new(RankShared::default()))
            .collect();
        let engine = FakeEngine {
            spec,
            ctx,
            pub_base,
            replay_base,
            generation,
            shared,
            live: Mutex::new(Vec::new()),
        };
        *lock(&engine.live) = engine.spawn(bound);
        engine
    }

    pub fn spec(&self) -> &EngineSpec {
        &self.spec
    }

    /// Rank 0's PUB endpoint, `tcp://127.0.0.1:{pub_base}` (rank `r` is on `pub_base + r`).
    pub fn endpoint(&self) -> String {
        self.endpoint_of(0)
    }

    /// Rank `rank`'s PUB endpoint.
    pub fn endpoint_of(&self, rank: u32) -> String {
        format!("tcp://{HOST}:{}", self.pub_base + rank as u16)
    }

    /// Rank 0's replay (ROUTER) endpoint, when replay is on.
    pub fn replay_endpoint(&self) -> Option<String> {
        self.replay_endpoint_of(0)
    }

    /// Rank `rank`'s replay endpoint, when replay is on.
    pub fn replay_endpoint_of(&self, rank: u32) -> Option<String> {
        self.replay_base
            .map(|p| format!("tcp://{HOST}:{}", p + rank as u16))
    }

    pub fn pub_port(&self) -> u16 {
        self.pub_base
    }

    pub fn replay_port(&self) -> Option<u16> {
        self.replay_base
    }

    /// Publishes one batch on `rank`: assigns the next seq, sends it live, buffers it for replay.
    /// Returns its seq.
    pub fn publish(&self, rank: u32, events: Vec<EngineEvent>) -> u64 {
        self.submit(rank, events, true)
    }

    /// Like [`publish`](Self::publish), but the live send is skipped (as if the PUB high-water
    /// mark dropped it): the batch takes a seq and is buffered for replay only.
    pub fn publish_unsent(&self, rank: u32, events: Vec<EngineEvent>) -> u64 {
        self.submit(rank, events, false)
    }

    /// An empty batch (TensorRT-LLM sends one every 5 s as a heartbeat). Returns its seq.
    pub fn heartbeat(&self, rank: u32) -> u64 {
        self.publish(rank, Vec::new())
    }

    /// Drops the oldest buffered batches of `rank` so only the newest `keep` remain (what
    /// `buffer_steps` overflow does). History is untouched.
    pub fn truncate_buffer(&self, rank: u32, keep: usize) {
        let live = lock(&self.live);
        let (ack, done) = mpsc::sync_channel(1);
        send_cmd(rank_ctl(&live, rank), Cmd::Truncate { keep, ack });
        done.recv_timeout(ACK_TIMEOUT)
            .unwrap_or_else(|e| panic!("fake engine rank {rank} did not truncate: {e}"));
    }

    /// An engine restart: every rank closes both sockets and forgets its seq and buffer, then the
    /// same ports are bound again and seqs start over (0, or the new time in ns). History, replay
    /// and subscriber counts start over too. Also brings a [`stop`](Self::stop)ped engine back.
    pub fn restart(&self) {
        let mut live = lock(&self.live);
        shutdown(&mut live);
        for shared in &self.shared {
            shared.reset();
        }
        // libzmq closes listeners on its I/O thread, just after zmq_close returns.
        let deadline = Instant::now() + Duration::from_secs(10);
        let bound = loop {
            let g = self.generation.fetch_add(1, Ordering::SeqCst);
            match bind_all(&self.ctx, &self.spec, self.pub_base, self.replay_base, g) {
                Ok(bound) => break bound,
                Err(zmq::Error::EADDRINUSE) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("fake engine: cannot rebind its ports on restart: {e}"),
            }
        };
        *live = self.spawn(bound);
    }

    /// The engine disappears: every rank closes its sockets and its thread ends, without a last
    /// `AllBlocksCleared` (a crashed engine). Publishing afterwards panics; `restart` revives it.
    pub fn stop(&self) {
        shutdown(&mut lock(&self.live));
    }

    /// Whether the rank threads are running (not stopped).
    pub fn is_running(&self) -> bool {
        !lock(&self.live).is_empty()
    }

    /// Everything published on `rank` since the last (re)start, in seq order, unsent batches
    /// included: `(seq, events)`.
    pub fn history(&self, rank: u32) -> Vec<(u64, Vec<EngineEvent>)> {
        lock(&self.rank_shared(rank).history).clone()
    }

    /// Replay requests `rank` answered since the last (re)start (malformed ones not counted).
    pub fn replays_served(&self, rank: u32) -> u64 {
        self.rank_shared(rank).replays.load(Ordering::SeqCst)
    }

    /// Peers connected to `rank`'s PUB socket now (completed ZMTP handshakes minus lost
    /// connections, from the socket monitor).
    pub fn subscribers(&self, rank: u32) -> u64 {
        let s = self.rank_shared(rank);
        let lost = s
            .disconnects
            .load(Ordering::SeqCst)
            .saturating_sub(s.handshake_failures.load(Ordering::SeqCst));
        s.handshakes.load(Ordering::SeqCst).saturating_sub(lost)
    }

    /// Waits until every rank's PUB has at least `n` connected peers, then 50 ms more for their
    /// subscriptions (sent right after the handshake) to land. False on timeout.
    ///
    /// After a [`restart`](Self::restart), libzmq's SUB reconnects by itself but re-sends its
    /// subscription only when its owner next calls into the socket (recv, poll, getsockopt): a
    /// bridge blocked in `recv` does so at once, an idle test socket must be polled first, or the
    /// next batch is dropped for want of a subscription.
    pub fn wait_for_subscribers(&self, n: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !(0..self.spec.dp_size).all(|r| self.subscribers(r) >= n) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        true
    }

    fn rank_shared(&self, rank: u32) -> &RankShared {
        self.shared
            .get(rank as usize)
            .unwrap_or_else(|| panic!("fake engine has ranks 0..{}, not {rank}", self.spec.dp_size))
    }

    fn submit(&self, rank: u32, events: Vec<EngineEvent>, send: bool) -> u64 {
        if let Err(why) = check_encodable(&events, self.spec.encoding) {
            panic!("fake engine: {why}");
        }
        let live = lock(&self.live);
        let (ack, done) = mpsc::sync_channel(1);
        let cmd = Cmd::Publish {
            events: events.clone(),
            send,
            ack,
        };
        send_cmd(rank_ctl(&live, rank), cmd);
        let seq = done
            .recv_timeout(ACK_TIMEOUT)
            .unwrap_or_else(|e| panic!("fake engine rank {rank} did not publish: {e}"));
        lock(&self.rank_shared(rank).history).push((seq, events));
        seq
    }

    /// Starts one thread per rank on its bound sockets.
    fn spawn(&self, bound: Vec<Bound>) -> Vec<RankCtl> {
        let g = self.generation.fetch_add(1, Ordering::SeqCst);
        let start_seq = match self.spec.seq_start {
            SeqStart::Zero => 0,
            SeqStart::TimeNs => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        };
        bound
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                let wake_endpoint = format!("inproc://fake-engine-wake-{g}-{rank}");
                let wake_rx = self.ctx.socket(zmq::PAIR).expect("PAIR socket");
                wake_rx.set_linger(0).expect("linger");
                wake_rx.bind(&wake_endpoint).expect("bind inproc wake");
                let wake = self.ctx.socket(zmq::PAIR).expect("PAIR socket");
                wake.set_linger(0).expect("linger");
                wake.connect(&wake_endpoint).expect("connect inproc wake");
                let (tx, rx) = mpsc::channel();
                let worker = RankLoop {
                    rank: rank as u32,
                    publisher: b.publisher,
                    router: b.router,
                    monitor: b.monitor,
                    wake: wake_rx,
                    rx,
                    next_seq: start_seq,
                    buffer: VecDeque::new(),
                    buffer_steps: self.spec.buffer_steps,
                    topic: self.spec.topic.as_bytes().to_vec(),
                    encoding: self.spec.encoding,
                    hash_form: self.spec.hash_form,
                    reply_form: self.spec.reply_form,
                    block_size: self.spec.block_size,
                    shared: self.shared[rank].clone(),
                };
                let thread = std::thread::Builder::new()
                    .name(format!("fake-engine-dp{rank}"))
                    .spawn(move || worker.run())
                    .expect("spawn fake engine thread");
                RankCtl {
                    tx,
                    wake,
                    thread: Some(thread),
                }
            })
            .collect()
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        shutdown(&mut lock(&self.live));
        // `ctx` goes last: every socket is closed with linger 0, so terminating it is immediate.
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn rank_ctl(live: &[RankCtl], rank: u32) -> &RankCtl {
    assert!(!live.is_empty(), "fake engine is stopped");
    live.get(rank as usize)
        .unwrap_or_else(|| panic!("fake engine has ranks 0..{}, not {rank}", live.len()))
}

fn send_cmd(ctl: &RankCtl, cmd: Cmd) {
    ctl.tx.send(cmd).expect("fake engine rank thread is gone");
    // Never blocks; were the wake lost, the thread's poll timeout still picks the command up.
    let _ = ctl.wake.send(&b""[..], zmq::DONTWAIT);
}

/// Stops and joins every rank thread (their sockets close as they end).
fn shutdown(live: &mut Vec<RankCtl>) {
    for ctl in live.iter() {
        let _ = ctl.tx.send(Cmd::Stop);
        let _ = ctl.wake.send(&b""[..], zmq::DONTWAIT);
    }
    for mut ctl in live.drain(..) {
        if let Some(thread) = ctl.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Binds every rank's PUB (and ROUTER) at `base + rank`; on any error nothing stays bound.
fn bind_all(
    ctx: &zmq::Context,
    spec: &EngineSpec,
    pub_base: u16,
    replay_base: Option<u16>,
    generation: u64,
) -> Result<Vec<Bound>, zmq::Error> {
    (0..spec.dp_size as u16)
        .map(|r| {
            let publisher = ctx.socket(zmq::PUB)?;
            publisher.set_sndhwm(spec.sndhwm)?;
            publisher.set_linger(0)?;
            // The monitor tells when subscribers have connected (wait_for_subscribers).
            let monitor_endpoint = format!("inproc://fake-engine-monitor-{generation}-{r}");
            let events = zmq::SocketEvent::HANDSHAKE_SUCCEEDED.to_raw()
                | zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL.to_raw()
                | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL.to_raw()
                | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH.to_raw()
                | zmq::SocketEvent::DISCONNECTED.to_raw();
            publisher.monitor(&monitor_endpoint, i32::from(events))?;
            let monitor = ctx.socket(zmq::PAIR)?;
            monitor.set_linger(0)?;
            monitor.connect(&monitor_endpoint)?;
            publisher.bind(&format!("tcp://{HOST}:{}", pub_base + r))?;
            let router = match replay_base {
                Some(base) => {
                    let router = ctx.socket(zmq::ROUTER)?;
                    router.set_linger(0)?;
                    router.bind(&format!("tcp://{HOST}:{}", base + r))?;
                    Some(router)
                }
                None => None,
            };
            Ok(Bound {
                publisher,
                router,
                monitor,
            })
        })
        .collect()
}

/// A base port with `span` free-looking ports above it, in `PORT_LO..PORT_HI`.
fn random_port(span: u16) -> u16 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let seed = nanos ^ (u64::from(std::process::id()) << 32) ^ CALLS.fetch_add(1, Ordering::SeqCst);
    let room = u64::from(PORT_HI - PORT_LO - span);
    PORT_LO + (wire::mix64(seed) % room) as u16
}
