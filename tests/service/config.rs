//! The configuration contract: key names, precedence, and errors that name their field.

use kvindex::config::{Config, ConfigError, Overrides, SourceKind, StartPosition};
use kvindex::event::{DecodeSettings, Format};
use kvindex::index::IndexSettings;
use kvindex::util::parse_rfc3339_us;
use std::io::Write;
use std::path::{Path, PathBuf};

fn no_env() -> Vec<(String, String)> {
    Vec::new()
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("temp file");
    f.write_all(text.as_bytes()).expect("write");
    f
}

fn load_text(text: &str) -> Result<Config, ConfigError> {
    let f = file(text);
    Config::load(Some(f.path()), no_env(), &Overrides::default())
}

fn load_env(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::load(None, env(pairs), &Overrides::default())
}

/// Asserts `r` failed with a message that starts with / names `field`.
fn assert_names(r: Result<Config, ConfigError>, field: &str) -> String {
    let err = r.expect_err(&format!("expected an error naming {field}"));
    let msg = err.to_string();
    assert!(msg.contains(field), "error `{msg}` does not name `{field}`");
    msg
}

#[test]
fn defaults() {
    let c = Config::default();
    c.validate().expect("defaults are valid");
    assert_eq!(c.data_dir, PathBuf::from("./kvindex-data"));
    assert_eq!(c.http.listen, "127.0.0.1:8080");
    assert_eq!(c.http.max_body_bytes, 1_048_576);
    assert_eq!(c.source.kind, SourceKind::Embedded);
    assert_eq!(c.source.format, Format::Auto);
    assert_eq!(c.source.max_payload_bytes, 4_194_304);
    assert_eq!(c.source.kafka.brokers, "127.0.0.1:9092");
    assert_eq!(c.source.kafka.topic, "kv-events");
    assert_eq!(c.source.kafka.group_id, "kvindex-{replica_id}");
    assert_eq!(c.source.kafka.start, "earliest");
    assert!(c.source.kafka.properties.is_empty());
    assert_eq!(c.source.nats.url, "nats://127.0.0.1:4222");
    assert_eq!(c.source.nats.stream, "KV_EVENTS");
    assert_eq!(c.source.nats.subjects, vec!["kv.events.>".to_string()]);
    assert_eq!(c.source.nats.durable, "kvindex-{replica_id}");
    assert_eq!(c.cluster.replica_id, "");
    assert_eq!(c.source.nats.engine_token, -1);
    assert!(c.source.nats.jetstream);
    assert_eq!(c.source.vllm.model, "");
    assert_eq!(c.source.vllm.tenant, "");
    assert!(c.source.vllm.lora_names.is_empty());
    assert_eq!(c.index.shards, 0);
    assert_eq!(c.index.seed, 0x6b76696e64657831);
    assert_eq!(c.index.default_block_size, 0);
    assert_eq!(c.index.l1_max_bytes, 1_073_741_824);
    assert_eq!(c.index.high_watermark, 0.8);
    assert_eq!(c.index.low_watermark, 0.6);
    assert!(c.writeback.write_back_on_evict);
    assert_eq!(c.writeback.batch_size, 128);
    assert_eq!(c.writeback.periodic_flush_interval, 0);
    assert!(c.writeback.restore_on_read);
    assert!(c.writeback.emergency_evict_for_restore);
    assert_eq!(c.checkpoint.interval_ms, 100);
    assert_eq!(c.checkpoint.max_events, 10_000);

    // Nothing at all given = the defaults.
    assert_eq!(
        Config::load(None, no_env(), &Overrides::default()).expect("loads"),
        c
    );
    // An empty file too.
    assert_eq!(load_text("").expect("loads"), c);

    let ic = IndexSettings::from(&c.index);
    assert!(ic.shards >= 1, "shards 0 means the number of cores");
    assert_eq!(ic.seed, 0x6b76696e64657831);
    let d = DecodeSettings::from(&c.source);
    assert_eq!(d, kvindex::event::DecodeSettings::default());
    assert_eq!(
        c.source.kafka.start_position().expect("valid"),
        StartPosition::Earliest
    );
    assert_eq!(c.writeback.periodic_flush(), None);
    assert_eq!(c.listen_addr().expect("valid").port(), 8080);
}

#[test]
fn example_file_is_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("kvindex.example.toml");
    let c = Config::load(Some(&path), no_env(), &Overrides::default()).expect("example loads");
    assert_eq!(c, Config::default());
}

#[test]
fn the_deployment_configs_load() {
    let load = |name: &str| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy")
            .join(name);
        Config::load(Some(&path), no_env(), &Overrides::default())
            .unwrap_or_else(|e| panic!("deploy/{name}: {e}"))
    };
    // One consumer per replica.
    assert_eq!(
        load("kvindex.toml").source.kafka.group_id,
        "kvindex-{replica_id}"
    );
    assert_eq!(
        load("kvindex-nats.toml").source.nats.durable,
        "kvindex-{replica_id}"
    );
}

#[test]
fn full_file() {
    let c = load_text(
        r#"
data_dir = "/var/lib/kvindex"
[http]
listen = "0.0.0.0:9000"
max_body_bytes = 2048
[source]
kind = "kafka"
format = "vllm"
max_payload_bytes = 1000
[source.kafka]
brokers = "k1:9092,k2:9092"
topic = "events"
group_id = "g"
start = 2025-01-31T12:00:00Z
[source.kafka.properties]
"security.protocol" = "SASL_SSL"
"fetch.min.bytes" = 1000
[source.nats]
subjects = ["a.>", "b.>"]
engine_token = 2
[source.vllm]
model = "llama"
tenant = "acme"
[source.vllm.lora_names]
3 = "sql-lora"
"-1" = "neg"
[index]
shards = 4
seed = 7
default_block_size = 32
l1_max_bytes = 1000000
high_watermark = 1
low_watermark = 0.5
[writeback]
write_back_on_evict = false
emergency_evict_for_restore = false
batch_size = 65536
periodic_flush_interval = 30
[checkpoint]
interval_ms = 5
max_events = 1
"#,
    )
    .expect("loads");
    assert_eq!(c.data_dir, PathBuf::from("/var/lib/kvindex"));
    assert_eq!(c.http.listen, "0.0.0.0:9000");
    assert_eq!(c.source.kind, SourceKind::Kafka);
    assert_eq!(c.source.format, Format::Vllm);
    assert_eq!(c.source.kafka.start, "2025-01-31T12:00:00Z");
    assert_eq!(
        c.source.kafka.start_position().expect("valid"),
        StartPosition::TimeUs(1_738_324_800_000_000)
    );
    assert_eq!(c.source.kafka.properties["security.protocol"], "SASL_SSL");
    assert_eq!(c.source.kafka.properties["fetch.min.bytes"], "1000");
    assert_eq!(c.source.nats.subjects, vec!["a.>", "b.>"]);
    assert_eq!(c.source.nats.engine_token, 2);
    assert_eq!(c.source.vllm.lora_names[&3], "sql-lora");
    assert_eq!(c.source.vllm.lora_names[&-1], "neg");
    assert_eq!(c.index.shards, 4);
    assert_eq!(c.index.high_watermark, 1.0);
    assert_eq!(c.writeback.periodic_flush_interval, 30);
    assert_eq!(
        c.writeback.periodic_flush(),
        Some(std::time::Duration::from_secs(30))
    );
    let ic = IndexSettings::from(&c.index);
    assert_eq!((ic.shards, ic.seed), (4, 7));
    let d = DecodeSettings::from(&c.source);
    assert_eq!(d.format, Format::Vllm);
    assert_eq!(d.max_payload_bytes, 1000);
    assert_eq!(d.vllm.model.as_deref(), Some("llama"));
    assert_eq!(d.vllm.tenant, "acme");
    assert_eq!(
        d.vllm.lora_names.get(&3).map(String::as_str),
        Some("sql-lora")
    );
}

#[test]
fn precedence_defaults_file_env_flags() {
    let f = file(
        r#"
data_dir = "/from/file"
[http]
listen = "127.0.0.1:1111"
[source]
kind = "kafka"
[source.kafka]
brokers = "file:9092"
topic = "file-topic"
[index]
shards = 2
"#,
    );
    // File over defaults.
    let c = Config::load(Some(f.path()), no_env(), &Overrides::default()).expect("loads");
    assert_eq!(c.http.listen, "127.0.0.1:1111");
    assert_eq!(c.source.kafka.brokers, "file:9092");
    assert_eq!(
        c.source.kafka.group_id, "kvindex-{replica_id}",
        "unset keys keep their defaults"
    );
    assert_eq!(c.index.shards, 2);

    // Env over file.
    let vars = env(&[
        ("KVINDEX_SOURCE__KAFKA__BROKERS", "env:9092"),
        ("KVINDEX_HTTP__LISTEN", "127.0.0.1:2222"),
        ("KVINDEX_INDEX__SHARDS", "4"),
        ("KVINDEX_DATA_DIR", "/from/env"),
        ("KVINDEX_SOURCE__KIND", "nats"),
        ("KVINDEX_INDEX__HIGH_WATERMARK", "0.9"),
        ("KVINDEX_WRITEBACK__RESTORE_ON_READ", "false"),
        ("KVINDEX_SOURCE__NATS__SUBJECTS", "a.>, b.>"),
        ("KVINDEX_SOURCE__VLLM__MODEL", "123"),
        (
            "KVINDEX_SOURCE__KAFKA__PROPERTIES__SECURITY_PROTOCOL",
            "SASL_SSL",
        ),
        ("KVINDEX_SOURCE__VLLM__LORA_NAMES__3", "sql-lora"),
        ("KVINDEX_LOG", "debug"), // not a config key: ignored
        ("PATH", "/bin"),         // not ours: ignored
    ]);
    let c = Config::load(Some(f.path()), vars.clone(), &Overrides::default()).expect("loads");
    assert_eq!(c.source.kafka.brokers, "env:9092");
    assert_eq!(c.source.kafka.topic, "file-topic");
    assert_eq!(c.http.listen, "127.0.0.1:2222");
    assert_eq!(c.index.shards, 4);
    assert_eq!(c.data_dir, PathBuf::from("/from/env"));
    assert_eq!(c.source.kind, SourceKind::Nats);
    assert_eq!(c.index.high_watermark, 0.9);
    assert!(!c.writeback.restore_on_read);
    assert_eq!(c.source.nats.subjects, vec!["a.>", "b.>"]);
    assert_eq!(c.source.vllm.model, "123", "string keys take the raw text");
    assert_eq!(c.source.kafka.properties["security.protocol"], "SASL_SSL");
    assert_eq!(c.source.vllm.lora_names[&3], "sql-lora");

    // Flags over env.
    let flags = Overrides {
        data_dir: Some(PathBuf::from("/from/flag")),
        listen: Some("127.0.0.1:3333".into()),
        source_kind: Some(SourceKind::Embedded),
    };
    let c = Config::load(Some(f.path()), vars, &flags).expect("loads");
    assert_eq!(c.data_dir, PathBuf::from("/from/flag"));
    assert_eq!(c.http.listen, "127.0.0.1:3333");
    assert_eq!(c.source.kind, SourceKind::Embedded);
    assert_eq!(
        c.source.kafka.brokers, "env:9092",
        "no flag: env still wins"
    );
}

#[test]
fn env_array_forms() {
    let c = load_env(&[("KVINDEX_SOURCE__NATS__SUBJECTS", r#"["x.>", "y"]"#)]).expect("loads");
    assert_eq!(c.source.nats.subjects, vec!["x.>", "y"]);
    let c = load_env(&[("KVINDEX_SOURCE__NATS__SUBJECTS", "only")]).expect("loads");
    assert_eq!(c.source.nats.subjects, vec!["only"]);
    let c = load_env(&[("KVINDEX_INDEX__SEED", "0x10")]).expect("loads");
    assert_eq!(c.index.seed, 16);
    let c = load_env(&[("KVINDEX_SOURCE__VLLM__TENANT", r#""quoted""#)]).expect("loads");
    assert_eq!(c.source.vllm.tenant, "quoted");
}

#[test]
fn unknown_keys_are_rejected() {
    assert_names(load_text("nope = 1"), "nope");
    assert_names(load_text("[index]\nshard = 4"), "index.shard");
    assert_names(
        load_text("[source.kafka]\nbroker = \"x\""),
        "source.kafka.broker",
    );
    assert_names(load_text("[sources]\nkind = \"nats\""), "sources");
    assert_names(
        load_env(&[("KVINDEX_INDEX__SHARD", "4")]),
        "KVINDEX_INDEX__SHARD",
    );
    assert_names(load_env(&[("KVINDEX_NOPE", "1")]), "KVINDEX_NOPE");
    assert_names(load_env(&[("KVINDEX_INDEX", "1")]), "index");
    assert_names(
        load_env(&[("KVINDEX_SOURCE_KIND", "nats")]),
        "KVINDEX_SOURCE_KIND",
    );
}

#[test]
fn type_errors_name_their_field() {
    assert_names(load_text("[index]\nshards = \"four\""), "index.shards");
    assert_names(load_text("[index]\nshards = -1"), "index.shards");
    assert_names(load_text("[http]\nlisten = 8080"), "http.listen");
    assert_names(load_text("[source]\nkind = \"redis\""), "source.kind");
    assert_names(load_text("[source]\nformat = \"xml\""), "source.format");
    assert_names(
        load_text("[source.nats]\nsubjects = \"a\""),
        "source.nats.subjects",
    );
    assert_names(
        load_text("[source.nats]\nsubjects = [1]"),
        "source.nats.subjects",
    );
    assert_names(load_text("http = 1"), "http");
    assert_names(
        load_text("[writeback]\nrestore_on_read = \"yes\""),
        "writeback.restore_on_read",
    );
    assert_names(
        load_env(&[("KVINDEX_INDEX__SHARDS", "many")]),
        "index.shards",
    );
    assert_names(
        load_env(&[("KVINDEX_SOURCE__KIND", "redis")]),
        "source.kind",
    );
    let msg = assert_names(load_text("[index\n"), "invalid TOML");
    assert!(msg.contains(".toml"), "parse errors name the file: {msg}");
}

#[test]
fn every_validation_error_names_its_field() {
    let cases: &[(&str, &str)] = &[
        ("data_dir = \"\"", "data_dir"),
        ("[cluster]\nreplica_id = \"a.b\"", "cluster.replica_id"),
        (
            "[cluster]\nreplica_id = \"0123456789012345678901234567890123456789012345678901234567890123x\"",
            "cluster.replica_id",
        ),
        (
            "[source.nats]\ndurable = \"kv.{replica_id}\"",
            "source.nats.durable",
        ),
        ("[source.nats]\ndurable = \"kv idx\"", "source.nats.durable"),
        ("[http]\nlisten = \"localhost\"", "http.listen"),
        ("[http]\nmax_body_bytes = 1023", "http.max_body_bytes"),
        (
            "[source]\nmax_payload_bytes = 0",
            "source.max_payload_bytes",
        ),
        (
            "[source.kafka]\nstart = \"yesterday\"",
            "source.kafka.start",
        ),
        (
            "[source.kafka]\nstart = \"2025-02-30T00:00:00Z\"",
            "source.kafka.start",
        ),
        (
            "[source]\nkind = \"kafka\"\n[source.kafka]\nbrokers = \"\"",
            "source.kafka.brokers",
        ),
        (
            "[source]\nkind = \"kafka\"\n[source.kafka]\ntopic = \"\"",
            "source.kafka.topic",
        ),
        ("[source.nats]\nsubjects = []", "source.nats.subjects"),
        ("[source.nats]\nsubjects = [\"\"]", "source.nats.subjects"),
        (
            "[source]\nkind = \"nats\"\n[source.nats]\nurl = \"\"",
            "source.nats.url",
        ),
        (
            "[source.vllm.lora_names]\n3 = \"\"",
            "source.vllm.lora_names.3",
        ),
        (
            "[source.vllm.lora_names]\nabc = \"x\"",
            "source.vllm.lora_names.abc",
        ),
        (
            "[source.vllm.lora_names]\n3 = 4",
            "source.vllm.lora_names.3",
        ),
        ("[index]\nl1_max_bytes = 0", "index.l1_max_bytes"),
        ("[index]\nhigh_watermark = 1.5", "index.high_watermark"),
        ("[index]\nhigh_watermark = 0", "index.high_watermark"),
        ("[index]\nlow_watermark = 0", "index.low_watermark"),
        ("[index]\nlow_watermark = 0.8", "index.low_watermark"),
        (
            "[index]\nhigh_watermark = 0.5\nlow_watermark = 0.6",
            "index.low_watermark",
        ),
        ("[writeback]\nbatch_size = 0", "writeback.batch_size"),
        ("[writeback]\nbatch_size = 65537", "writeback.batch_size"),
        (
            "[writeback]\nperiodic_flush_interval = -5",
            "writeback.periodic_flush_interval",
        ),
        (
            "[writeback]\nperiodic_flush_interval = 31536001",
            "writeback.periodic_flush_interval",
        ),
        (
            "[writeback]\nperiodic_flush_interval = 1.5",
            "writeback.periodic_flush_interval",
        ),
        ("[index]\nhigh_watermark = nan", "index.high_watermark"),
        ("[index]\nlow_watermark = nan", "index.low_watermark"),
        ("[index]\nhigh_watermark = inf", "index.high_watermark"),
        ("[index]\nhigh_watermark = -0.5", "index.high_watermark"),
        ("[index]\nlow_watermark = -0.1", "index.low_watermark"),
        ("[index]\nlow_watermark = 1.5", "index.low_watermark"),
        (
            "[index]\nhigh_watermark = 0.7\nlow_watermark = 0.7",
            "index.low_watermark",
        ),
        ("[writeback]\nbatch_size = -1", "writeback.batch_size"),
        (
            "[writeback]\nwrite_back_on_evict = false\nemergency_evict_for_restore = true",
            "writeback.emergency_evict_for_restore",
        ),
        (
            "[source.kafka]\npartitions = [0, -1]",
            "source.kafka.partitions",
        ),
        ("[checkpoint]\ninterval_ms = 0", "checkpoint.interval_ms"),
        ("[checkpoint]\nmax_events = 0", "checkpoint.max_events"),
    ];
    for (text, field) in cases {
        assert_names(load_text(text), field);
    }
    let msg = assert_names(
        load_text("[index]\nhigh_watermark = 1.5"),
        "index.high_watermark",
    );
    assert_eq!(msg, "index.high_watermark: must be in (0, 1], got 1.5");
    let msg = assert_names(
        load_text("[writeback]\nwrite_back_on_evict = false"),
        "writeback.emergency_evict_for_restore",
    );
    assert!(
        msg.contains("writeback.write_back_on_evict"),
        "names both fields: {msg}"
    );
    // The same rules hold for values from env and flags.
    assert_names(
        load_env(&[("KVINDEX_WRITEBACK__BATCH_SIZE", "0")]),
        "writeback.batch_size",
    );
    assert_names(
        load_env(&[("KVINDEX_WRITEBACK__PERIODIC_FLUSH_INTERVAL", "-1")]),
        "writeback.periodic_flush_interval",
    );
    assert_names(
        load_env(&[("KVINDEX_INDEX__LOW_WATERMARK", "0.9")]),
        "index.low_watermark",
    );
    assert_names(
        load_env(&[("KVINDEX_WRITEBACK__WRITE_BACK_ON_EVICT", "false")]),
        "writeback.emergency_evict_for_restore",
    );
    let bad_listen = Overrides {
        listen: Some("nowhere".into()),
        ..Overrides::default()
    };
    assert_names(Config::load(None, no_env(), &bad_listen), "http.listen");
    // validate() on a hand-built config.
    let mut c = Config::default();
    c.index.low_watermark = 0.9;
    let err = c.validate().expect_err("low above high");
    assert_eq!(err.field(), Some("index.low_watermark"));
}

#[test]
fn writeback_edges_that_are_valid() {
    // Boundaries that must load: high = 1, the longest interval, write-back off together
    // with emergency eviction off, batch_size 1.
    let c = load_text(
        "[index]\nhigh_watermark = 1.0\nlow_watermark = 0.99\n[writeback]\n\
         periodic_flush_interval = 31536000\nbatch_size = 1\n\
         write_back_on_evict = false\nemergency_evict_for_restore = false",
    )
    .expect("valid");
    assert_eq!(
        c.writeback.periodic_flush(),
        Some(std::time::Duration::from_secs(31_536_000))
    );
    let msg = assert_names(
        load_text("[writeback]\nperiodic_flush_interval = -5"),
        "writeback.periodic_flush_interval",
    );
    assert!(msg.contains("-5"), "{msg}");
    // validate() on hand-built configs, for values the TOML layer cannot produce.
    let mut c = Config::default();
    c.writeback.periodic_flush_interval = i64::MIN;
    assert_eq!(
        c.validate().expect_err("negative").field(),
        Some("writeback.periodic_flush_interval")
    );
    let mut c = Config::default();
    c.index.high_watermark = f64::NAN;
    assert_eq!(
        c.validate().expect_err("nan").field(),
        Some("index.high_watermark")
    );
}

#[test]
fn lora_names() {
    let c = load_text("[source.vllm.lora_names]\n1 = \"a\"\n\"2\" = \"b\"\n").expect("loads");
    assert_eq!(c.source.vllm.lora_names.len(), 2);
    assert_eq!(c.source.vllm.lora_names[&1], "a");
    assert_eq!(c.source.vllm.lora_names[&2], "b");
    let opts = DecodeSettings::from(&c.source);
    assert_eq!(opts.vllm.lora_names.get(&2).map(String::as_str), Some("b"));
    let msg = assert_names(
        load_text("[source.vllm.lora_names]\nsql = \"x\""),
        "source.vllm.lora_names.sql",
    );
    assert!(msg.contains("integer"), "{msg}");
    assert_names(
        load_env(&[("KVINDEX_SOURCE__VLLM__LORA_NAMES__X", "y")]),
        "lora_names.x",
    );
}

#[test]
fn rfc3339() {
    assert_eq!(parse_rfc3339_us("1970-01-01T00:00:00Z"), Some(0));
    assert_eq!(parse_rfc3339_us("1970-01-01T00:00:01.5Z"), Some(1_500_000));
    assert_eq!(parse_rfc3339_us("1970-01-01T00:00:00.000001Z"), Some(1));
    assert_eq!(
        parse_rfc3339_us("1970-01-01T00:00:00.0000019Z"),
        Some(1),
        "truncated"
    );
    assert_eq!(
        parse_rfc3339_us("2025-01-31T12:00:00Z"),
        Some(1_738_324_800_000_000)
    );
    assert_eq!(
        parse_rfc3339_us("2025-01-31T13:30:00+01:30"),
        Some(1_738_324_800_000_000)
    );
    assert_eq!(
        parse_rfc3339_us("2025-01-31T10:00:00-02:00"),
        Some(1_738_324_800_000_000)
    );
    assert_eq!(
        parse_rfc3339_us("2025-01-31t12:00:00z"),
        Some(1_738_324_800_000_000)
    );
    assert_eq!(
        parse_rfc3339_us("2024-02-29T00:00:00Z"),
        Some(1_709_164_800_000_000)
    );
    assert_eq!(parse_rfc3339_us("1969-12-31T23:59:59Z"), Some(-1_000_000));
    assert_eq!(
        parse_rfc3339_us("2000-03-01T00:00:00Z"),
        Some(951_868_800_000_000)
    );
    for bad in [
        "",
        "2025-01-31",
        "2025-01-31T12:00:00",
        "2025-01-31T12:00Z",
        "2025-1-31T12:00:00Z",
        "2025-13-01T00:00:00Z",
        "2025-02-29T00:00:00Z",
        "1900-02-29T00:00:00Z",
        "2025-01-32T00:00:00Z",
        "2025-01-31T24:00:00Z",
        "2025-01-31T12:60:00Z",
        "2025-01-31T12:00:00.Z",
        "2025-01-31T12:00:00+0100",
        "2025-01-31T12:00:00+01:00x",
        "2025-01-31X12:00:00Z",
        "+025-01-31T12:00:00Z",
        "2025-01-31T12:00:00ZZ",
    ] {
        assert_eq!(parse_rfc3339_us(bad), None, "{bad:?} must be rejected");
    }
}

#[test]
fn kafka_partitions_from_file_and_env() {
    let c = load_text("[source.kafka]\npartitions = [0, 3]").unwrap();
    assert_eq!(c.source.kafka.partitions, vec![0, 3]);
    let c = load_env(&[("KVINDEX_SOURCE__KAFKA__PARTITIONS", "1, 2")]).unwrap();
    assert_eq!(c.source.kafka.partitions, vec![1, 2]);
    let c = load_env(&[("KVINDEX_SOURCE__KAFKA__PARTITIONS", "[4]")]).unwrap();
    assert_eq!(c.source.kafka.partitions, vec![4]);
    assert_names(
        load_text("[source.kafka]\npartitions = [\"a\"]"),
        "source.kafka.partitions",
    );
    assert_names(
        load_env(&[("KVINDEX_SOURCE__KAFKA__PARTITIONS", "x")]),
        "source.kafka.partitions",
    );
}

#[test]
fn bridge_engines_from_the_file_and_the_environment() {
    let c = load_text(
        r#"
[bridge]
partition_by = "adapter"
gone_after_s = 5
[[bridge.engines]]
id = "engine-a"
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5558"
dp_size = 2
model = "meta-llama/Llama-3.1-8B"
[[bridge.engines]]
id = "engine-b"
endpoint = "tcp://*:6000"
model = "qwen"
tenant = "acme"
"#,
    )
    .expect("loads");
    assert_eq!(c.bridge.partition_by, "adapter");
    assert_eq!(c.bridge.gone_after_s, 5);
    assert_eq!(c.bridge.engines.len(), 2);
    let a = &c.bridge.engines[0];
    assert_eq!(
        (a.id.as_str(), a.dp_size, a.topic.as_str()),
        ("engine-a", 2, "")
    );
    let b = &c.bridge.engines[1];
    assert_eq!(
        (b.dp_size, b.tenant.as_str(), b.replay_endpoint.as_str()),
        (1, "acme", "")
    );

    let c = load_env(&[
        ("KVINDEX_BRIDGE__GONE_AFTER_S", "0"),
        ("KVINDEX_BRIDGE__ENGINES__0__ID", "e0"),
        ("KVINDEX_BRIDGE__ENGINES__0__ENDPOINT", "tcp://h:1"),
        ("KVINDEX_BRIDGE__ENGINES__0__MODEL", "m"),
        ("KVINDEX_BRIDGE__ENGINES__1__ID", "e1"),
        ("KVINDEX_BRIDGE__ENGINES__1__ENDPOINT", "tcp://h:2"),
        ("KVINDEX_BRIDGE__ENGINES__1__MODEL", "m"),
        ("KVINDEX_BRIDGE__ENGINES__1__DP_SIZE", "4"),
    ])
    .expect("loads");
    assert_eq!(c.bridge.gone_after_s, 0);
    assert_eq!(c.bridge.engines.len(), 2);
    assert_eq!(c.bridge.engines[1].dp_size, 4);
    let c = load_env(&[(
        "KVINDEX_BRIDGE__ENGINES",
        r#"[{id = "x", endpoint = "tcp://h:1", model = "m"}]"#,
    )])
    .expect("loads");
    assert_eq!(c.bridge.engines[0].id, "x");
    // The README's one-line form.
    let c = load_text(
        r#"bridge.engines = [{ id = "vllm-0", endpoint = "tcp://10.0.0.5:5557", replay_endpoint = "tcp://10.0.0.5:5558", model = "meta-llama/Llama-3.1-8B" }]"#,
    )
    .expect("loads");
    assert_eq!(c.bridge.engines[0].replay_endpoint, "tcp://10.0.0.5:5558");
}

#[test]
fn bridge_errors_name_their_field() {
    let engine = |body: &str| format!("[[bridge.engines]]\n{body}\n");
    assert_names(
        load_text(&engine(
            "id = \"a\"\nendpoint = \"tcp://h:1\"\nmodel = \"m\"\nport = 3",
        )),
        "bridge.engines[0].port",
    );
    assert_names(
        load_text(&engine(
            "id = \"a\"\nendpoint = \"tcp://h:1\"\nmodel = \"m\"\ndp_size = \"two\"",
        )),
        "bridge.engines[0].dp_size",
    );
    assert_names(
        load_text(&engine("id = \"a\"\nendpoint = \"tcp://h:1\"")),
        "bridge.engines[0].model",
    );
    assert_names(
        load_text(&format!(
            "{}{}",
            engine("id = \"a\"\nendpoint = \"tcp://h:1\"\nmodel = \"m\""),
            engine("id = \"a\"\nendpoint = \"tcp://h:2\"\nmodel = \"m\"")
        )),
        "bridge.engines[1].id",
    );
    assert_names(
        load_text(&engine(
            "id = \"a#1\"\nendpoint = \"tcp://h:1\"\nmodel = \"m\"",
        )),
        "bridge.engines[0].id",
    );
    assert_names(
        load_text("[bridge]\npartition_by = \"tenant\""),
        "bridge.partition_by",
    );
    assert_names(load_text("[bridge]\nengines = [1]"), "bridge.engines[0]");
    assert_names(
        load_env(&[("KVINDEX_BRIDGE__ENGINES__1__ID", "x")]),
        "bridge.engines[1]",
    );
    // Endpoint syntax per rank is checked when the bridge derives the ranks' endpoints.
    let c = load_text(&engine(
        "id = \"a\"\nendpoint = \"tcp://h\"\nmodel = \"m\"\ndp_size = 2",
    ))
    .expect("loads");
    let settings = kvindex::bridge::BridgeSettings::try_from(&c).expect("settings");
    let err = kvindex::bridge::validate(&settings).expect_err("no port");
    assert_eq!(err.field(), Some("bridge.engines[0].endpoint"));
}

/// `[source.nats]` credentials: secrets only from the environment (and never printed), one way
/// to authenticate, a user with its password, client certificate and key together.
#[test]
fn nats_credentials_rules() {
    for key in ["password", "token"] {
        let msg = assert_names(
            load_text(&format!("[source.nats]\n{key} = \"hunter2\"")),
            &format!("source.nats.{key}"),
        );
        assert!(
            msg.contains(&format!("KVINDEX_SOURCE__NATS__{}", key.to_uppercase())),
            "{msg}"
        );
    }
    let c = load_env(&[
        ("KVINDEX_SOURCE__NATS__USER", "kv"),
        ("KVINDEX_SOURCE__NATS__PASSWORD", "hunter2-secret"),
    ])
    .unwrap();
    assert_eq!(c.source.nats.password.expose(), "hunter2-secret");
    assert!(!format!("{c:?}").contains("hunter2-secret"));
    assert_names(
        load_env(&[("KVINDEX_SOURCE__NATS__PASSWORD", "p")]),
        "source.nats.user",
    );
    assert_names(
        load_text("[source.nats]\nuser = \"kv\""),
        "source.nats.user",
    );
    assert_names(
        load_env(&[
            ("KVINDEX_SOURCE__NATS__TOKEN", "t"),
            ("KVINDEX_SOURCE__NATS__CREDENTIALS_FILE", "/etc/kv.creds"),
        ]),
        "source.nats",
    );
    assert_names(
        load_text("[source.nats]\ntls_cert = \"client.pem\""),
        "source.nats.tls_cert",
    );
}
