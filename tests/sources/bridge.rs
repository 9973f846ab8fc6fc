//! The engine bridge against publishers that behave like vLLM's and SGLang's
//! (`support::engine`: libzmq PUB + ROUTER, bounded replay buffer, both reply forms, DP ranks
//! at port + rank, array and map encodings), driven through the real `kvindex serve` (bridge
//! in-process, embedded broker) and `kvindex bridge` (sidecar into Kafka or NATS).
//!
//! After each disturbance the index must answer exactly like a reference model folded over
//! what the engine published, with fenced engines cleared: nothing lost while the engine's
//! buffer covers a gap, nothing stale after a fence.

use crate::support::{Kvindex, TestRng, spawn_kvindex, wait_for, write_config};
use kvindex::bench::engine::{
    Encoding, EngineEvent, EngineSpec, FakeEngine, SeqStart, block_hashes_of, chain,
};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

const BLOCK: u32 = 16;
const MODEL: &str = "llama";
const WAIT: Duration = Duration::from_secs(30);

/// What one engine rank holds per adapter (`""`: the base model), folded over its batches.
#[derive(Default)]
struct Model {
    held: HashSet<(String, u64)>,
}

impl Model {
    fn fold<'a>(batches: impl IntoIterator<Item = &'a (u64, Vec<EngineEvent>)>) -> Model {
        let mut m = Model::default();
        for (_, events) in batches {
            for ev in events {
                match ev {
                    EngineEvent::Stored {
                        hashes, lora_name, ..
                    } => {
                        let adapter = lora_name.clone().unwrap_or_default();
                        m.held.extend(hashes.iter().map(|h| (adapter.clone(), *h)));
                    }
                    // No LoRA name: an unscoped removal, from every adapter.
                    EngineEvent::Removed { hashes, .. } => {
                        m.held.retain(|(_, h)| !hashes.contains(h));
                    }
                    EngineEvent::Cleared => m.held.clear(),
                }
            }
        }
        m
    }

    fn matched(&self, adapter: &str, tokens: &[u32]) -> u64 {
        block_hashes_of(tokens, BLOCK, None, adapter_salt(adapter))
            .iter()
            .take_while(|h| self.held.contains(&(adapter.to_string(), **h)))
            .count() as u64
    }
}

/// A workload: prompts sharing prefixes, stored, some evicted.
struct Prompts {
    rng: TestRng,
    prompts: Vec<Vec<u32>>,
}

impl Prompts {
    fn new(seed: u64) -> Prompts {
        Prompts {
            rng: TestRng::new(seed),
            prompts: Vec::new(),
        }
    }

    /// A batch: store a new prompt (sharing a prefix with an earlier one half the time) and
    /// sometimes evict the tail of an earlier one.
    fn batch(&mut self) -> Vec<EngineEvent> {
        let mut tokens: Vec<u32> = match self.prompts.len() {
            0 => Vec::new(),
            n if self.rng.below(2) == 0 => {
                let base = &self.prompts[self.rng.below(n as u64) as usize];
                base[..(BLOCK as usize * (1 + self.rng.below(2) as usize)).min(base.len())].to_vec()
            }
            _ => Vec::new(),
        };
        let extra = BLOCK as usize * (1 + self.rng.below(4) as usize);
        tokens.extend((0..extra).map(|_| self.rng.below(50_000) as u32));
        let mut events = vec![chain(&tokens, BLOCK, None, 0)];
        if self.prompts.len() > 2 && self.rng.below(3) == 0 {
            let victim = &self.prompts[self.rng.below(self.prompts.len() as u64) as usize];
            let hashes = block_hashes_of(victim, BLOCK, None, 0);
            events.push(EngineEvent::removed(vec![*hashes.last().unwrap()]));
        }
        self.prompts.push(tokens);
        events
    }
}

fn lookup(kv: &Kvindex, adapter: &str, tokens: &[u32]) -> BTreeMap<String, u64> {
    let (status, body) = kv.post(
        "/v1/lookup",
        &json!({"model": MODEL, "adapter": adapter, "token_ids": tokens, "block_size": BLOCK}),
    );
    assert_eq!(status, 200, "{body}");
    body["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["engine_id"].as_str().unwrap().to_string(),
                e["matched_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Waits until every prompt's answer equals the models' (engine id → model) in the base model.
fn assert_converges(kv: &Kvindex, models: &[(String, Model)], prompts: &[Vec<u32>], what: &str) {
    assert_converges_in(kv, &[""], models, prompts, what);
}

/// Waits until every prompt's answer in every adapter of `adapters` equals the models'.
fn assert_converges_in(
    kv: &Kvindex,
    adapters: &[&str],
    models: &[(String, Model)],
    prompts: &[Vec<u32>],
    what: &str,
) {
    let mut last = String::new();
    let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_for(what, WAIT, || {
            for adapter in adapters {
                for tokens in prompts {
                    let got = lookup(kv, adapter, tokens);
                    let want: BTreeMap<String, u64> = models
                        .iter()
                        .map(|(id, m)| (id.clone(), m.matched(adapter, tokens)))
                        .filter(|(_, n)| *n > 0)
                        .collect();
                    if got != want {
                        last = format!("adapter `{adapter}`: got {got:?}, want {want:?}");
                        return None;
                    }
                }
            }
            Some(())
        })
    }));
    if ok.is_err() {
        panic!("{what}: {last}\nbridge: {}", kv.stats()["bridge"]);
    }
}

fn bridge_row(kv: &Kvindex, engine: &str, rank: u32) -> Value {
    kv.stats()["bridge"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["engine"] == engine && r["dp_rank"] == rank)
        .cloned()
        .unwrap_or(Value::Null)
}

fn engine_toml(id: &str, engine: &FakeEngine, extra: &str) -> String {
    let replay = engine
        .replay_endpoint()
        .map(|r| format!("replay_endpoint = \"{r}\"\n"))
        .unwrap_or_default();
    format!(
        "[[bridge.engines]]\nid = \"{id}\"\nendpoint = \"{}\"\n{replay}model = \"{MODEL}\"\ndp_size = {}\n{extra}",
        engine.endpoint(),
        engine.spec().dp_size
    )
}

fn serve_with(dir: &std::path::Path, bridge_toml: &str) -> Kvindex {
    let config = write_config(
        dir,
        &format!("[index]\nshards = 2\n[bridge]\ngone_after_s = 0\n{bridge_toml}"),
    );
    spawn_kvindex(&["serve", "--config", &config], dir, &[], WAIT)
}

fn subscribed(engine: &FakeEngine) {
    assert!(
        engine.wait_for_subscribers(1, WAIT),
        "the bridge never subscribed"
    );
}

#[test]
fn serve_indexes_vllm_and_sglang_publishers_of_every_encoding_and_rank() {
    let dir = tempfile::tempdir().unwrap();
    let specs = [
        ("vllm", EngineSpec::vllm()),
        ("vllm-old", EngineSpec::vllm_legacy()),
        (
            "vllm-09",
            EngineSpec {
                encoding: Encoding::ArrayV09,
                ..EngineSpec::vllm_legacy()
            },
        ),
        (
            "sglang",
            EngineSpec {
                dp_size: 2,
                ..EngineSpec::sglang()
            },
        ),
    ];
    let engines: Vec<(&str, FakeEngine)> = specs
        .into_iter()
        .map(|(id, spec)| (id, FakeEngine::start(spec)))
        .collect();
    let toml: String = engines
        .iter()
        .map(|(id, e)| engine_toml(id, e, ""))
        .collect();
    let kv = serve_with(dir.path(), &toml);
    let mut prompts = Prompts::new(7);
    let mut models = Vec::new();
    for (id, engine) in &engines {
        subscribed(engine);
        for rank in 0..engine.spec().dp_size {
            for _ in 0..20 {
                engine.publish(rank, prompts.batch());
            }
            let model_id = if rank == 0 {
                id.to_string()
            } else {
                format!("{id}#dp{rank}")
            };
            models.push((model_id, Model::fold(&engine.history(rank))));
        }
    }
    assert_converges(&kv, &models, &prompts.prompts, "every engine indexed");
    let row = bridge_row(&kv, "sglang", 1);
    assert_eq!(row["connected"], true, "{row}");
    assert_eq!(row["last_seq"], 19, "{row}");
    // /v1/engines carries each engine's bridge state.
    let (_, engines_body) = kv.get("/v1/engines");
    let sg1 = engines_body["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["engine_id"] == "sglang#dp1")
        .expect("sglang rank 1 listed");
    assert_eq!(sg1["bridge"]["dp_rank"], 1);
    let (_, metrics) = kv.get("/metrics");
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(
        metrics
            .contains("kvindex_bridge_batches_forwarded_total{engine=\"sglang\",dp_rank=\"1\"} 20"),
        "{metrics}"
    );
    crate::support::assert_promtool_accepts(&metrics);
    kv.terminate();
}

#[test]
fn gaps_are_replayed_and_truncated_gaps_fence_without_leaving_stale_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let engine = FakeEngine::start(EngineSpec::vllm());
    let kv = serve_with(dir.path(), &engine_toml("e", &engine, ""));
    subscribed(&engine);
    let mut prompts = Prompts::new(11);
    for i in 0..40 {
        let batch = prompts.batch();
        // Every fifth batch is dropped on the live socket: only replay brings it.
        if i % 5 == 2 {
            engine.publish_unsent(0, batch);
        } else {
            engine.publish(0, batch);
        }
    }
    let history = engine.history(0);
    assert_converges(
        &kv,
        &[("e".into(), Model::fold(&history))],
        &prompts.prompts,
        "gaps repaired from the replay buffer",
    );
    let row = bridge_row(&kv, "e", 0);
    // One replay may cover several holes (it returns everything from the first one on).
    assert!(row["gaps"].as_u64().unwrap() >= 1, "{row}");
    assert!(row["replays"]["ok"].as_u64().unwrap() >= 2, "{row}");
    assert_eq!(row["fences"]["truncated"], 0, "{row}");
    assert_eq!(row["fences"]["unrepaired"], 0, "{row}");
    // What was forwarded becomes durable (checkpointed by the index): the position a
    // restart resumes from.
    wait_for("the durable position to reach the last batch", WAIT, || {
        (bridge_row(&kv, "e", 0)["durable_seq"] == 39).then_some(())
    });

    // Now lose batches the buffer no longer holds: the engine is fenced, and what its buffer
    // still holds is all the index may say about it.
    let lost_from = engine.publish_unsent(0, prompts.batch());
    for _ in 0..5 {
        engine.publish_unsent(0, prompts.batch());
    }
    engine.truncate_buffer(0, 3);
    engine.publish(0, prompts.batch());
    let history = engine.history(0);
    let kept: Vec<_> = history
        .iter()
        .filter(|(s, _)| *s > lost_from + 2)
        .cloned()
        .collect();
    assert_converges(
        &kv,
        &[("e".into(), Model::fold(&kept))],
        &prompts.prompts,
        "a truncated gap fences, then the buffer's batches",
    );
    let row = bridge_row(&kv, "e", 0);
    assert_eq!(row["fences"]["truncated"], 1, "{row}");
    kv.terminate();
}

#[test]
fn an_engine_restart_is_fenced_and_its_new_life_indexed() {
    for spec in [
        EngineSpec::sglang(),
        EngineSpec {
            seq_start: SeqStart::TimeNs,
            ..EngineSpec::vllm()
        },
    ] {
        let dir = tempfile::tempdir().unwrap();
        let engine = FakeEngine::start(spec);
        let kv = serve_with(dir.path(), &engine_toml("r", &engine, ""));
        subscribed(&engine);
        let mut prompts = Prompts::new(5);
        for _ in 0..15 {
            engine.publish(0, prompts.batch());
        }
        assert_converges(
            &kv,
            &[("r".into(), Model::fold(&engine.history(0)))],
            &prompts.prompts,
            "before the restart",
        );
        // The engine restarts (its cache is gone) and publishes again from seq 0 / a new
        // time: nothing from its first life may remain.
        engine.restart();
        subscribed(&engine);
        for _ in 0..4 {
            engine.publish(0, prompts.batch());
        }
        assert_converges(
            &kv,
            &[("r".into(), Model::fold(&engine.history(0)))],
            &prompts.prompts,
            "after the restart, only the new life",
        );
        let row = bridge_row(&kv, "r", 0);
        let fences = &row["fences"];
        assert!(
            fences["restarted"].as_u64().unwrap() + fences["truncated"].as_u64().unwrap() >= 1,
            "{row}"
        );
        kv.terminate();
    }
}

#[test]
fn an_engine_gone_longer_than_gone_after_s_is_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let engine = FakeEngine::start(EngineSpec::vllm());
    let config = write_config(
        dir.path(),
        &format!(
            "[bridge]\ngone_after_s = 1\n{}",
            engine_toml("g", &engine, "")
        ),
    );
    let kv = spawn_kvindex(&["serve", "--config", &config], dir.path(), &[], WAIT);
    subscribed(&engine);
    let mut prompts = Prompts::new(3);
    for _ in 0..10 {
        engine.publish(0, prompts.batch());
    }
    assert_converges(
        &kv,
        &[("g".into(), Model::fold(&engine.history(0)))],
        &prompts.prompts,
        "indexed",
    );
    engine.stop();
    assert_converges(&kv, &[], &prompts.prompts, "a gone engine is cleared");
    assert_eq!(bridge_row(&kv, "g", 0)["fences"]["gone"], 1);
    kv.terminate();
}

#[test]
fn kill_9_of_serve_while_the_engine_publishes_resumes_from_the_durable_position() {
    let dir = tempfile::tempdir().unwrap();
    let engine = FakeEngine::start(EngineSpec::vllm());
    let toml = engine_toml("k", &engine, "");
    let prompts = std::sync::Mutex::new(Prompts::new(13));
    let publish = |n: usize, pause: Duration| {
        for _ in 0..n {
            let batch = prompts.lock().unwrap().batch();
            engine.publish(0, batch);
            std::thread::sleep(pause);
        }
    };
    for round in 0..3 {
        let kv = serve_with(dir.path(), &toml);
        subscribed(&engine);
        if round < 2 {
            // Killed while the engine keeps publishing, before, during and after the kill.
            std::thread::scope(|scope| {
                scope.spawn(|| publish(150, Duration::from_millis(5)));
                // Once a position is on disk (the index checkpointed it, the ledger wrote it),
                // at a moment that differs per round.
                let positions = dir.path().join("bridge").join("positions.json");
                wait_for("a durable position on disk", WAIT, || {
                    let text = std::fs::read_to_string(&positions).ok()?;
                    let file: Value = serde_json::from_str(&text).ok()?;
                    file["streams"][0]["seq"].as_u64()
                });
                std::thread::sleep(Duration::from_millis(50 + 100 * round));
                kv.kill9();
            });
        } else {
            publish(5, Duration::ZERO);
            let prompts = prompts.lock().unwrap();
            assert_converges(
                &kv,
                &[("k".into(), Model::fold(&engine.history(0)))],
                &prompts.prompts,
                "after two kill -9s, nothing lost",
            );
            // It resumed from its durable position: a probe, no fence.
            let row = bridge_row(&kv, "k", 0);
            let fences: u64 = row["fences"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_u64().unwrap())
                .sum();
            assert_eq!(fences, 0, "{row}");
            assert!(row["replays"]["ok"].as_u64().unwrap() >= 1, "{row}");
            kv.terminate();
        }
    }
}

const ADAPTERS: [&str; 3] = ["", "sql-lora", "chat-lora"];

/// Engines hash a block with its LoRA adapter (vLLM puts the LoRA name in the block's extra
/// keys), so the same tokens under two adapters are two blocks.
fn adapter_salt(adapter: &str) -> u64 {
    ADAPTERS.iter().position(|a| *a == adapter).unwrap_or(0) as u64
}

/// A batch storing one prompt under a rotating adapter, and now and then an unscoped removal
/// (of a block of the base model's hashing).
fn adapter_batch(prompts: &mut Prompts, i: usize) -> Vec<EngineEvent> {
    let mut events = prompts.batch();
    let adapter = ADAPTERS[i % ADAPTERS.len()];
    if let Some(EngineEvent::Stored { lora_name, .. }) = events.first_mut() {
        let tokens = prompts.prompts.last().unwrap();
        let mut salted = chain(tokens, BLOCK, None, adapter_salt(adapter));
        if let EngineEvent::Stored { lora_name: l, .. } = &mut salted {
            *l = (!adapter.is_empty()).then(|| adapter.to_string());
        }
        let _ = lora_name;
        events[0] = salted;
    }
    events
}

/// A `kvindex bridge` sidecar publishing into `source`, and a `kvindex serve` consuming it.
fn sidecar_and_serve(
    source: &str,
    bridge_toml: &str,
) -> (Kvindex, Kvindex, [tempfile::TempDir; 2]) {
    let bridge_dir = tempfile::tempdir().unwrap();
    let bridge_config = write_config(bridge_dir.path(), &format!("{source}{bridge_toml}"));
    let bridge = spawn_kvindex(
        &["bridge", "--config", &bridge_config],
        bridge_dir.path(),
        &[],
        WAIT,
    );
    let serve_dir = tempfile::tempdir().unwrap();
    let serve_config = write_config(serve_dir.path(), &format!("{source}[index]\nshards = 2\n"));
    let kv = spawn_kvindex(
        &["serve", "--config", &serve_config],
        serve_dir.path(),
        &[],
        WAIT,
    );
    (bridge, kv, [bridge_dir, serve_dir])
}

#[test]
fn the_sidecar_bridge_keys_by_adapter_into_kafka_and_holds_while_the_broker_is_down() {
    let broker = kvindex::source::EmbeddedBroker::start("kv-bridge", 4).unwrap();
    let engine = FakeEngine::start(EngineSpec::vllm());
    let source = format!(
        "[source]\nkind = \"kafka\"\n[source.kafka]\nbrokers = \"{}\"\ntopic = \"kv-bridge\"\ngroup_id = \"\"\n",
        broker.bootstrap_servers()
    );
    let (bridge, kv, _dirs) = sidecar_and_serve(
        &source,
        &format!(
            "[bridge]\npartition_by = \"adapter\"\ngone_after_s = 0\n{}",
            engine_toml("pod-a", &engine, "")
        ),
    );
    subscribed(&engine);
    let mut prompts = Prompts::new(21);
    for i in 0..30 {
        engine.publish(0, adapter_batch(&mut prompts, i));
    }
    assert_converges_in(
        &kv,
        &ADAPTERS,
        &[("pod-a".into(), Model::fold(&engine.history(0)))],
        &prompts.prompts,
        "adapter partitions through Kafka",
    );
    // The records are spread over partitions by adapter key (the source's partition list in
    // `/v1/stats` is refreshed by the ingest loop, so it may trail the lookups briefly).
    wait_for("adapter keys on two partitions or more", WAIT, || {
        let (_, stats) = kv.get("/v1/stats");
        let busy = stats["sources"]["partitions"]
            .as_array()?
            .iter()
            .filter(|p| p["events_applied"].as_u64().unwrap_or(0) > 0)
            .count();
        (busy >= 2).then_some(())
    });

    // The broker goes down: the bridge holds (bounded), then drains; nothing is lost.
    broker.mock().broker_down(1).unwrap();
    for i in 30..50 {
        engine.publish(0, adapter_batch(&mut prompts, i));
    }
    std::thread::sleep(Duration::from_secs(2));
    broker.mock().broker_up(1).unwrap();
    assert_converges_in(
        &kv,
        &ADAPTERS,
        &[("pod-a".into(), Model::fold(&engine.history(0)))],
        &prompts.prompts,
        "after the broker came back",
    );
    let (_, bstats) = bridge.get("/v1/stats");
    let row = &bstats["bridge"][0];
    assert_eq!(row["batches_forwarded"], 50, "{bstats}");
    let fences: u64 = row["fences"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(fences, 1, "only the first contact fences: {bstats}");
    let (_, metrics) = bridge.get("/metrics");
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("kvindex_bridge_events_forwarded_total{engine=\"pod-a\",dp_rank=\"0\"}"),
        "{metrics}"
    );
    kv.terminate();
    bridge.terminate();
}

#[test]
fn the_sidecar_bridge_into_nats_survives_a_server_restart() {
    let mut nats = crate::support::PrivateServer::start();
    let engine = FakeEngine::start(EngineSpec::sglang());
    let stream = crate::support::unique_id("BRIDGE");
    let source = format!(
        "[source]\nkind = \"nats\"\n[source.nats]\nurl = \"{}\"\nstream = \"{stream}\"\nsubjects = [\"{stream}.kv.>\"]\ndurable = \"kvindex\"\n",
        nats.url()
    );
    let (bridge, kv, _dirs) = sidecar_and_serve(
        &source,
        &format!(
            "[bridge]\ngone_after_s = 0\n{}",
            engine_toml("sg", &engine, "")
        ),
    );
    subscribed(&engine);
    let mut prompts = Prompts::new(31);
    for _ in 0..20 {
        engine.publish(0, prompts.batch());
    }
    assert_converges(
        &kv,
        &[("sg".into(), Model::fold(&engine.history(0)))],
        &prompts.prompts,
        "through JetStream",
    );
    nats.kill();
    for _ in 0..10 {
        engine.publish(0, prompts.batch());
    }
    std::thread::sleep(Duration::from_secs(1));
    nats.spawn();
    for _ in 0..5 {
        engine.publish(0, prompts.batch());
    }
    assert_converges(
        &kv,
        &[("sg".into(), Model::fold(&engine.history(0)))],
        &prompts.prompts,
        "after NATS restarted",
    );
    kv.terminate();
    bridge.terminate();
}

#[test]
fn engines_that_connect_to_a_bound_bridge_each_get_their_own_stream_by_topic() {
    use kvindex::bench::engine::{HashForm, encode_batch};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    // Centralised mode (as llm-d runs it): the bridge binds, engines connect with their own
    // topic; the subscription is the common prefix.
    let kv = serve_with(
        dir.path(),
        &format!(
            "[[bridge.engines]]\nid = \"central\"\nendpoint = \"tcp://*:{port}\"\ntopic = \"kv@\"\nmodel = \"{MODEL}\"\n"
        ),
    );
    let ctx = zmq::Context::new();
    let publishers: Vec<(String, zmq::Socket)> = ["kv@pod-1", "kv@pod-2"]
        .iter()
        .map(|topic| {
            let s = ctx.socket(zmq::PUB).unwrap();
            s.set_linger(0).unwrap();
            s.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
            (topic.to_string(), s)
        })
        .collect();
    // Subscriptions travel to a connecting PUB once the handshake is done.
    std::thread::sleep(Duration::from_millis(500));
    let mut prompts = Prompts::new(41);
    let mut models = Vec::new();
    for (topic, socket) in &publishers {
        let mut history = Vec::new();
        for seq in 0..10u64 {
            let events = prompts.batch();
            let payload = encode_batch(0.0, &events, Some(0), Encoding::Map, HashForm::U64, BLOCK);
            socket
                .send_multipart([topic.as_bytes(), &seq.to_be_bytes(), &payload], 0)
                .unwrap();
            history.push((seq, events));
        }
        models.push((format!("central/{topic}"), Model::fold(&history)));
    }
    assert_converges(
        &kv,
        &models,
        &prompts.prompts,
        "each connecting engine indexed",
    );
    let stats = kv.stats();
    let streams = stats["bridge"].as_array().unwrap();
    for topic in ["kv@pod-1", "kv@pod-2"] {
        let row = streams
            .iter()
            .find(|r| r["topic"] == topic)
            .unwrap_or_else(|| panic!("no stream for {topic}: {stats}"));
        assert_eq!(row["last_seq"], 9, "{row}");
        assert_eq!(row["fences"]["first_contact"], 1, "{row}");
    }
    kv.terminate();
}
