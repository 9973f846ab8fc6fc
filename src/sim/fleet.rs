//! A synthetic engine fleet: deterministic, realistic KV-cache event traffic for
//! `kvindex produce`, `kvindex demo` and tests.
//!
//! The fleet simulates what a vLLM deployment publishes, closely enough that the index sees the
//! same shapes of traffic it will see in production:
//!
//! * **Deployments.** Every (tenant, model) pair is a deployment served by its own engines
//!   (engine `i` serves deployment `i % (tenants × models)`), because a vLLM engine serves one
//!   model. Each engine also serves every LoRA adapter of its model.
//! * **Prompt families** (`Workload`). Real chat and RAG traffic is dominated by shared
//!   prefixes: a few long system prompts per deployment (chosen with a skew, so one is hot),
//!   multi-turn conversations whose every turn extends the previous turn's tokens (prompt plus
//!   the model's answer), and RAG documents shared by many users, pasted after a system prompt.
//!   Token ids are uniform in a 128k vocabulary; only their sharing structure matters.
//! * **Routing with affinity.** Conversations stick to the engine that served their last turn
//!   (session affinity, as a prefix-aware router achieves) with a small spill to other engines;
//!   new conversations mostly go to the engine that last served their system prompt. So
//!   prefixes are reused on one engine and also replicated over a few.
//! * **Engine caches** (`EngineCache`). Each engine is a prefix cache of `capacity_blocks`
//!   full blocks with LRU eviction of leaf blocks only, as vLLM's free-block queue does, so
//!   what an engine holds is always prefix-closed. On a request the engine stores the blocks of
//!   the sequence it did not hold (one `Stored` event with its own chained hashes) after
//!   evicting what it must (`Removed` events).
//! * **Engine hashes.** Like vLLM (which seeds its block hash per process), every engine chains
//!   its own hash from its own seed, so two engines give the same tokens different hashes; the
//!   adapter is mixed into the root, so hashes never collide across adapter partitions. A
//!   restarted engine gets a new seed.
//! * **Eviction scope.** Evictions under a LoRA adapter name the adapter (scoped); base-model
//!   evictions are `adapter_scoped` half the time and legacy unscoped the other half, so both
//!   code paths of the index are exercised with identical effect.
//! * **Restarts and liveness.** About one request in `clear_every` restarts a random engine,
//!   which sends `AllCleared` and comes back empty; every engine sends a `ReplicaUpdated`
//!   heartbeat every ~1,000 of its events.
//!
//! Every event has a per-engine increasing `seq` and a `timestamp_us` from a simulated clock.
//! Everything is driven by one seeded [`Rng`]: the same [`FleetSettings`] gives the same stream.

use super::rng::Rng;
use crate::event::{BlockContent, EngineHash, Event, EventKind, PartitionKey, Tier};
use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Token ids are drawn from `0..VOCAB_SIZE` (a Llama-3-sized vocabulary).
pub const VOCAB_SIZE: u32 = 128_000;
/// Each engine sends a heartbeat after this many of its own events.
pub const HEARTBEAT_EVERY: u64 = 1_000;
/// Simulated clock start: 2025-06-15T00:00:00Z in unix microseconds.
const EPOCH_US: i64 = 1_749_945_600_000_000;

/// How the fleet is shaped. See the module docs for what each knob models.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetSettings {
    pub engines: usize,
    /// Adapter partitions per model, the base model included: 1 = base only, 3 = base,
    /// `lora-1`, `lora-2`.
    pub adapters: usize,
    pub tenants: usize,
    pub models: usize,
    pub block_size: u32,
    /// Blocks each engine can hold.
    pub capacity_blocks: usize,
    pub seed: u64,
    /// One engine restart (`AllCleared`) per this many requests on average; 0 = never.
    pub clear_every: u64,
    /// Engines publish the number of the cache slot a block occupies as its hash (a slot freed
    /// by an eviction or a restart is reused for other content), as engines that name blocks
    /// by their physical id do, instead of a content hash.
    pub reuse_hashes: bool,
    /// Engines offload to host memory as vLLM's CPU offloading does: about a third of stored
    /// chains are also stored on CPU (a second `Stored` naming `CPU`), and evictions name the
    /// GPU, so the CPU copies stay (until the engine restarts).
    pub cpu_offload: bool,
}

impl Default for FleetSettings {
    fn default() -> Self {
        FleetSettings {
            engines: 8,
            adapters: 2,
            tenants: 1,
            models: 1,
            block_size: 16,
            capacity_blocks: 4096,
            seed: 1,
            clear_every: 5000,
            reuse_hashes: false,
            cpu_offload: false,
        }
    }
}

/// Counts of what the fleet did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetStats {
    pub requests: u64,
    pub stored_events: u64,
    pub removed_events: u64,
    pub cleared_events: u64,
    pub heartbeat_events: u64,
    /// Blocks in `Stored` events.
    pub blocks_stored: u64,
    /// Blocks in `Removed` events (not counting restarts).
    pub blocks_removed: u64,
    /// Blocks dropped by restarts (`AllCleared`).
    pub blocks_cleared: u64,
    /// Blocks all engines hold now.
    pub blocks_cached: u64,
    /// Full blocks of all requests, and how many of them were already cached on their engine.
    pub prompt_blocks: u64,
    pub hit_blocks: u64,
}

impl FleetStats {
    /// All events emitted.
    pub fn events(&self) -> u64 {
        self.stored_events + self.removed_events + self.cleared_events + self.heartbeat_events
    }

    /// Fraction of request blocks the serving engine already held.
    pub fn hit_ratio(&self) -> f64 {
        if self.prompt_blocks == 0 {
            0.0
        } else {
            self.hit_blocks as f64 / self.prompt_blocks as f64
        }
    }
}

/// One cached block of an engine.
#[derive(Clone, Copy, Debug)]
struct Node {
    adapter: u16,
    parent: Option<u64>,
    /// Position in its chain (root = 0); deeper blocks are evicted first among equally old ones.
    depth: u32,
    /// Last request that used the block.
    tick: u64,
    /// Cached blocks whose parent this is; only leaves (0) may be evicted.
    children: u32,
}

/// One engine's prefix cache: at most `capacity` blocks, LRU eviction of leaves only.
///
/// A request touches its whole chain from the root, so a parent is always at least as recently
/// used as any of its children; ordering blocks by (last use, deeper first) therefore always
/// puts a leaf first, and plain LRU order evicts leaves before their parents. That keeps every
/// engine's content prefix-closed, as in vLLM, and every `Removed` chain consistent.
#[derive(Debug)]
struct EngineCache {
    capacity: usize,
    nodes: HashMap<u64, Node>,
    /// (tick, deeper first, hash): the first element is the next victim.
    lru: BTreeSet<(u64, Reverse<u32>, u64)>,
    /// With [`FleetSettings::reuse_hashes`]: the slot each held block occupies, and the free
    /// slots (lowest first, so freed slots are reused soon).
    slots: Option<(HashMap<u64, u64>, BTreeSet<u64>)>,
}

impl EngineCache {
    fn new(capacity: usize, reuse_hashes: bool) -> EngineCache {
        let capacity = capacity.max(1);
        EngineCache {
            capacity,
            nodes: HashMap::new(),
            lru: BTreeSet::new(),
            slots: reuse_hashes.then(|| (HashMap::new(), (1..=capacity as u64).collect())),
        }
    }

    /// The hash the engine publishes for the held block of content hash `h`.
    fn published(&self, h: u64) -> u64 {
        match &self.slots {
            Some((held, _)) => held.get(&h).copied().unwrap_or(0),
            None => h,
        }
    }

    fn len(&self) -> usize {
        self.nodes.len()
    }

    /// How many leading `hashes` the cache holds.
    fn cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.nodes.contains_key(h))
            .count()
    }

    /// Marks `hashes` (a held chain from the root) as used at `tick`.
    fn touch(&mut self, hashes: &[u64], tick: u64) {
        for &h in hashes {
            if let Some(n) = self.nodes.get_mut(&h) {
                self.lru.remove(&(n.tick, Reverse(n.depth), h));
                n.tick = tick;
                self.lru.insert((tick, Reverse(n.depth), h));
            }
        }
    }

    /// Evicts the least recently used leaf: its published hash and adapter.
    fn evict_one(&mut self) -> Option<(u64, u16)> {
        let (_, _, h) = self.lru.pop_first()?;
        let node = self.nodes.remove(&h)?;
        let h = match &mut self.slots {
            Some((held, free)) => {
                let slot = held.remove(&h).unwrap_or(0);
                free.insert(slot);
                slot
            }
            None => h,
        };
        debug_assert_eq!(node.children, 0, "LRU order evicts leaves first");
        if let Some(p) = node.parent.and_then(|p| self.nodes.get_mut(&p)) {
            p.children -= 1;
        }
        Some((h, node.adapter))
    }

    fn insert(&mut self, hash: u64, parent: Option<u64>, adapter: u16, depth: u32, tick: u64) {
        if let Some(p) = parent.and_then(|p| self.nodes.get_mut(&p)) {
            p.children += 1;
        }
        if let Some((held, free)) = &mut self.slots
            && let Some(slot) = free.pop_first()
        {
            held.insert(hash, slot);
        }
        self.nodes.insert(
            hash,
            Node {
                adapter,
                parent,
                depth,
                tick,
                children: 0,
            },
        );
        self.lru.insert((tick, Reverse(depth), hash));
    }

    /// Drops everything (a restart); returns how many blocks were held.
    fn clear(&mut self) -> usize {
        let n = self.nodes.len();
        self.nodes.clear();
        self.lru.clear();
        if let Some((held, free)) = &mut self.slots {
            free.extend(held.drain().map(|(_, slot)| slot));
        }
        n
    }
}

/// A (tenant, model) deployment and its shared prompt material.
#[derive(Debug)]
struct Deployment {
    tenant: String,
    model: String,
    /// Engines serving this deployment (indices into the fleet's engines).
    engines: Vec<usize>,
    /// Long system prompts shared by every conversation that uses them; index 0 is hottest.
    system_prompts: Vec<Vec<u32>>,
    /// The engine that last served each system prompt (prefix-aware routing for new chats).
    prompt_home: Vec<Option<usize>>,
    /// RAG documents shared across users.
    docs: Vec<Vec<u32>>,
}

/// A live multi-turn conversation: each turn's sequence extends the previous one.
#[derive(Debug)]
struct Conversation {
    deployment: usize,
    adapter: usize,
    system_prompt: usize,
    /// Everything so far: system prompt, documents, user turns and model answers.
    tokens: Vec<u32>,
    turns_left: u32,
    /// Engine that served the last turn (session affinity).
    home: usize,
}

/// One request as the router hands it to an engine.
#[derive(Debug)]
struct Request {
    engine: usize,
    partition: PartitionKey,
    /// Adapter index (0 = base model).
    adapter: usize,
    /// The sequence the engine caches: prompt plus generated answer (full blocks only count).
    tokens: Vec<u32>,
}

/// Prompt families, conversation state and routing. See the module docs.
#[derive(Debug)]
struct Workload {
    deployments: Vec<Deployment>,
    adapters: Vec<String>,
    conversations: Vec<Conversation>,
}

/// Live conversations kept at once; starting one more ends the oldest.
const MAX_LIVE_CONVERSATIONS: usize = 256;
/// A conversation this long (tokens) ends, like a chat hitting its context budget.
const MAX_CONVERSATION_TOKENS: usize = 8192;
const SYSTEM_PROMPTS: usize = 4;
const DOCS: usize = 24;

impl Workload {
    fn new(cfg: &FleetSettings, rng: &mut Rng) -> Workload {
        let tenants = cfg.tenants.max(1);
        let models = cfg.models.max(1);
        let engines = cfg.engines.max(1);
        let count = tenants * models;
        let mut deployments = Vec::new();
        for d in 0..count {
            let served: Vec<usize> = (0..engines).filter(|e| e % count == d).collect();
            if served.is_empty() {
                continue;
            }
            let tenant = if tenants == 1 {
                String::new()
            } else {
                format!("tenant-{}", d / models)
            };
            let system_prompts: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
                .map(|_| {
                    let n = rng.range(256, 2048);
                    rng.tokens(n)
                })
                .collect();
            let docs = (0..DOCS)
                .map(|_| {
                    let n = rng.range(512, 3072);
                    rng.tokens(n)
                })
                .collect();
            deployments.push(Deployment {
                tenant,
                model: format!("model-{}", d % models),
                engines: served,
                prompt_home: vec![None; system_prompts.len()],
                system_prompts,
                docs,
            });
        }
        let adapters = (0..cfg.adapters.max(1))
            .map(|a| {
                if a == 0 {
                    String::new()
                } else {
                    format!("lora-{a}")
                }
            })
            .collect();
        Workload {
            deployments,
            adapters,
            conversations: Vec::new(),
        }
    }

    fn partition(&self, deployment: usize, adapter: usize) -> PartitionKey {
        let d = &self.deployments[deployment];
        PartitionKey::new(&d.tenant, &d.model, &self.adapters[adapter])
    }

    /// Base model half the time, else a uniformly chosen LoRA adapter.
    fn pick_adapter(&self, rng: &mut Rng) -> usize {
        if self.adapters.len() == 1 || rng.chance(0.5) {
            0
        } else {
            1 + rng.below(self.adapters.len() - 1)
        }
    }

    /// The next request: 60% a follow-up turn of a live conversation (recent ones more
    /// likely), 30% a new conversation (hot system prompt, sometimes a RAG document), 10% a
    /// one-shot RAG question (system prompt + shared document + question).
    fn next_request(&mut self, rng: &mut Rng) -> Request {
        let roll = rng.below(100);
        if roll < 60 && !self.conversations.is_empty() {
            self.follow_up(rng)
        } else if roll < 90 {
            self.new_conversation(rng)
        } else {
            self.rag_one_shot(rng)
        }
    }

    fn follow_up(&mut self, rng: &mut Rng) -> Request {
        let n = self.conversations.len();
        let i = n - 1 - rng.skewed(n);
        let user = rng.range(16, 256);
        let answer = rng.range(32, 512);
        let extra = rng.tokens(user + answer);
        let spill = rng.chance(0.1);
        let spill_to = rng.next_u64();
        let conv = &mut self.conversations[i];
        conv.tokens.extend_from_slice(&extra);
        conv.turns_left = conv.turns_left.saturating_sub(1);
        // Session affinity with a 10% spill (load balancing, or a router that lost the session).
        if spill {
            let engines = &self.deployments[conv.deployment].engines;
            conv.home = engines[(spill_to % engines.len() as u64) as usize];
        }
        let (deployment, adapter, engine) = (conv.deployment, conv.adapter, conv.home);
        let ended = conv.turns_left == 0 || conv.tokens.len() >= MAX_CONVERSATION_TOKENS;
        let tokens = if ended {
            self.conversations.remove(i).tokens
        } else {
            self.conversations[i].tokens.clone()
        };
        Request {
            engine,
            partition: self.partition(deployment, adapter),
            adapter,
            tokens,
        }
    }

    /// Picks a deployment, a (skewed) system prompt and the engine for it: the prompt's last
    /// engine 70% of the time, else any engine of the deployment.
    fn start(&mut self, rng: &mut Rng) -> (usize, usize, usize) {
        let d = rng.below(self.deployments.len());
        let dep = &mut self.deployments[d];
        let p = rng.skewed(dep.system_prompts.len());
        let engine = match dep.prompt_home[p] {
            Some(e) if rng.chance(0.7) => e,
            _ => dep.engines[rng.below(dep.engines.len())],
        };
        dep.prompt_home[p] = Some(engine);
        (d, p, engine)
    }

    fn new_conversation(&mut self, rng: &mut Rng) -> Request {
        let (d, p, engine) = self.start(rng);
        let adapter = self.pick_adapter(rng);
        let dep = &self.deployments[d];
        let mut tokens = dep.system_prompts[p].clone();
        if rng.chance(0.3) {
            let doc = rng.skewed(dep.docs.len());
            tokens.extend_from_slice(&dep.docs[doc]);
        }
        let user = rng.range(16, 256);
        let answer = rng.range(32, 512);
        tokens.extend(rng.tokens(user + answer));
        let req = Request {
            engine,
            partition: self.partition(d, adapter),
            adapter,
            tokens: tokens.clone(),
        };
        if self.conversations.len() >= MAX_LIVE_CONVERSATIONS {
            self.conversations.remove(0);
        }
        self.conversations.push(Conversation {
            deployment: d,
            adapter,
            system_prompt: p,
            tokens,
            turns_left: rng.range(1, 9) as u32,
            home: engine,
        });
        req
    }

    fn rag_one_shot(&mut self, rng: &mut Rng) -> Request {
        let (d, p, _) = self.start(rng);
        let adapter = self.pick_adapter(rng);
        let dep = &self.deployments[d];
        // RAG traffic is spread by the load balancer: the shared documents end up on many engines.
        let engine = dep.engines[rng.below(dep.engines.len())];
        let doc = rng.skewed(dep.docs.len());
        let mut tokens = dep.system_prompts[p].clone();
        tokens.extend_from_slice(&dep.docs[doc]);
        let question = rng.range(16, 128);
        let answer = rng.range(32, 256);
        tokens.extend(rng.tokens(question + answer));
        Request {
            engine,
            partition: self.partition(d, adapter),
            adapter,
            tokens,
        }
    }

    /// A prompt real traffic would look up now: the whole of a live conversation (its next turn
    /// starts with it), or a new chat on a live conversation's system prompt.
    fn sample_query(&self, rng: &mut Rng) -> (PartitionKey, Vec<u32>) {
        if self.conversations.is_empty() {
            let d = rng.below(self.deployments.len());
            return (
                self.partition(d, 0),
                self.deployments[d].system_prompts[0].clone(),
            );
        }
        let n = self.conversations.len();
        let conv = &self.conversations[n - 1 - rng.skewed(n)];
        let partition = self.partition(conv.deployment, conv.adapter);
        if rng.chance(0.75) {
            return (partition, conv.tokens.clone());
        }
        let mut tokens =
            self.deployments[conv.deployment].system_prompts[conv.system_prompt].clone();
        let question = rng.range(16, 256);
        tokens.extend(rng.tokens(question));
        (partition, tokens)
    }
}

/// One simulated engine.
#[derive(Debug)]
struct Engine {
    name: String,
    deployment: usize,
    cache: EngineCache,
    /// Hash seed of the current process; changes on restart, as vLLM's per-process seed does.
    seed: u64,
    restarts: u64,
    seq: u64,
    since_heartbeat: u64,
}

/// The simulated fleet. See the module docs.
#[derive(Debug)]
pub struct Fleet {
    cfg: FleetSettings,
    rng: Rng,
    workload: Workload,
    engines: Vec<Engine>,
    clock_us: i64,
    /// Request counter, the engines' LRU clock.
    tick: u64,
    stats: FleetStats,
}

/// Seed of engine `index` after `restarts` restarts (independent of the request stream).
fn engine_seed(fleet_seed: u64, index: usize, restarts: u64) -> u64 {
    let mut r = Rng::new(fleet_seed ^ (index as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    for _ in 0..=restarts {
        r.next_u64();
    }
    r.next_u64()
}

impl Fleet {
    pub fn new(cfg: FleetSettings) -> Fleet {
        let mut rng = Rng::new(cfg.seed);
        let workload = Workload::new(&cfg, &mut rng);
        let mut engines: Vec<Engine> = (0..cfg.engines.max(1))
            .map(|i| Engine {
                name: format!("engine-{i:03}"),
                deployment: 0,
                cache: EngineCache::new(cfg.capacity_blocks, cfg.reuse_hashes),
                seed: engine_seed(cfg.seed, i, 0),
                restarts: 0,
                seq: 0,
                since_heartbeat: 0,
            })
            .collect();
        for (d, dep) in workload.deployments.iter().enumerate() {
            for &e in &dep.engines {
                engines[e].deployment = d;
            }
        }
        Fleet {
            cfg,
            rng,
            workload,
            engines,
            clock_us: EPOCH_US,
            tick: 0,
            stats: FleetStats::default(),
        }
    }

    pub fn config(&self) -> &FleetSettings {
        &self.cfg
    }

    /// The events of the next simulated request (may be empty if everything was cached).
    pub fn next_request(&mut self) -> Vec<Event> {
        self.tick += 1;
        self.stats.requests += 1;
        self.clock_us += 1 + self.rng.below(2000) as i64;
        let mut out = Vec::new();
        if self.cfg.clear_every > 0 && self.rng.below(self.cfg.clear_every as usize) == 0 {
            let e = self.rng.below(self.engines.len());
            self.restart(e, &mut out);
        }
        let req = self.workload.next_request(&mut self.rng);
        self.serve(&req, &mut out);
        out
    }

    /// A lookup query (partition + token ids) that real traffic would send now: a prompt of a
    /// random live conversation or system prompt, so lookups hit.
    pub fn sample_query(&mut self) -> (PartitionKey, Vec<u32>) {
        self.workload.sample_query(&mut self.rng)
    }

    pub fn stats(&self) -> FleetStats {
        FleetStats {
            blocks_cached: self.engines.iter().map(|e| e.cache.len() as u64).sum(),
            ..self.stats.clone()
        }
    }

    /// Blocks each engine holds now, by engine id (what the index should show per engine).
    pub fn engine_blocks(&self) -> Vec<(String, usize)> {
        self.engines
            .iter()
            .map(|e| (e.name.clone(), e.cache.len()))
            .collect()
    }

    /// The engine ids and the (tenant, model) each serves (for per-engine encodings such as
    /// vLLM's, whose payloads name neither).
    pub fn engines(&self) -> Vec<(String, PartitionKey)> {
        self.engines
            .iter()
            .map(|e| (e.name.clone(), self.base_partition(e.deployment)))
            .collect()
    }

    fn base_partition(&self, deployment: usize) -> PartitionKey {
        self.workload.partition(deployment, 0)
    }

    /// Stamps and emits one event of engine `e`, plus its heartbeat when one is due.
    fn emit(&mut self, e: usize, mut ev: Event, out: &mut Vec<Event>) {
        match ev.kind {
            EventKind::Stored => {
                self.stats.stored_events += 1;
                self.stats.blocks_stored += ev.block_hashes.len() as u64;
            }
            EventKind::Removed => {
                self.stats.removed_events += 1;
                self.stats.blocks_removed += ev.block_hashes.len() as u64;
            }
            EventKind::AllCleared | EventKind::AdapterCleared => self.stats.cleared_events += 1,
            EventKind::ReplicaUpdated | EventKind::Unknown(_) => self.stats.heartbeat_events += 1,
        }
        let heartbeat_partition = self.base_partition(self.engines[e].deployment);
        let engine = &mut self.engines[e];
        engine.seq += 1;
        engine.since_heartbeat += 1;
        ev.seq = engine.seq;
        ev.timestamp_us = self.clock_us;
        out.push(ev);
        if engine.since_heartbeat >= HEARTBEAT_EVERY {
            engine.since_heartbeat = 0;
            engine.seq += 1;
            let mut hb = Event::new(
                EventKind::ReplicaUpdated,
                engine.name.clone(),
                heartbeat_partition,
            );
            hb.seq = engine.seq;
            hb.timestamp_us = self.clock_us;
            self.stats.heartbeat_events += 1;
            out.push(hb);
        }
    }

    /// Engine `e` restarts: `AllCleared`, an empty cache and a new hash seed.
    fn restart(&mut self, e: usize, out: &mut Vec<Event>) {
        let partition = self.base_partition(self.engines[e].deployment);
        let engine = &mut self.engines[e];
        self.stats.blocks_cleared += engine.cache.clear() as u64;
        engine.restarts += 1;
        engine.seed = engine_seed(self.cfg.seed, e, engine.restarts);
        let ev = Event::new(EventKind::AllCleared, engine.name.clone(), partition);
        self.emit(e, ev, out);
    }

    /// Engine `req.engine` runs the request: reuses the cached prefix, evicts what it must and
    /// stores the rest of the sequence's full blocks.
    fn serve(&mut self, req: &Request, out: &mut Vec<Event>) {
        let bs = self.cfg.block_size.max(1) as usize;
        let e = req.engine;
        let engine = &self.engines[e];
        // The engine's chained hashes of every full block (a sequence longer than the whole
        // cache keeps only what fits, as a real engine could not hold more either).
        let blocks = (req.tokens.len() / bs).min(engine.cache.capacity);
        let adapter = &self.workload.adapters[req.adapter];
        let mut h = xxh3_64_with_seed(adapter.as_bytes(), engine.seed);
        let mut bytes = Vec::with_capacity(bs * 4);
        let hashes: Vec<u64> = req.tokens[..blocks * bs]
            .chunks_exact(bs)
            .map(|block| {
                bytes.clear();
                bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
                h = xxh3_64_with_seed(&bytes, h);
                h
            })
            .collect();
        let hit = engine.cache.cached_prefix(&hashes);
        self.stats.prompt_blocks += blocks as u64;
        self.stats.hit_blocks += hit as u64;
        let tick = self.tick;
        self.engines[e].cache.touch(&hashes[..hit], tick);
        if hit == blocks {
            return;
        }

        // Make room. The chain just touched is the most recently used, so it is never a victim.
        let mut evicted: Vec<(u64, u16)> = Vec::new();
        let cache = &mut self.engines[e].cache;
        while cache.len() + (blocks - hit) > cache.capacity {
            match cache.evict_one() {
                Some(v) => evicted.push(v),
                None => break,
            }
        }
        // One Removed event per run of blocks of the same adapter, leaves first.
        let mut start = 0;
        while start < evicted.len() {
            let a = evicted[start].1;
            let end = evicted[start..]
                .iter()
                .position(|v| v.1 != a)
                .map_or(evicted.len(), |p| start + p);
            let mut partition = req.partition.clone();
            partition.adapter = self.workload.adapters[a as usize].clone();
            let mut ev = Event::new(EventKind::Removed, self.engines[e].name.clone(), partition);
            ev.adapter_scoped = a != 0 || self.rng.chance(0.5);
            if self.cfg.cpu_offload {
                ev.tier = Some(Tier::Gpu);
            }
            ev.block_hashes = evicted[start..end]
                .iter()
                .map(|v| EngineHash(v.0))
                .collect();
            self.emit(e, ev, out);
            start = end;
        }

        let cache = &mut self.engines[e].cache;
        for (i, &hash) in hashes.iter().enumerate().skip(hit) {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            cache.insert(hash, parent, req.adapter as u16, i as u32, tick);
        }
        let published: Vec<u64> = hashes.iter().map(|&h| cache.published(h)).collect();
        let mut ev = Event::new(
            EventKind::Stored,
            self.engines[e].name.clone(),
            req.partition.clone(),
        );
        ev.block_hashes = published[hit..].iter().map(|&h| EngineHash(h)).collect();
        ev.parent_hash = hit.checked_sub(1).map(|p| EngineHash(published[p]));
        ev.content = BlockContent::Tokens {
            token_ids: req.tokens[hit * bs..blocks * bs].to_vec(),
            block_size: bs as u32,
        };
        ev.tier = Some(Tier::Gpu);
        let offloaded = (self.cfg.cpu_offload && self.rng.chance(0.3)).then(|| {
            let mut copy = ev.clone();
            copy.tier = Some(Tier::Cpu);
            copy
        });
        self.emit(e, ev, out);
        if let Some(copy) = offloaded {
            self.emit(e, copy, out);
        }
    }
}
