//! The management port's HTTP API (RabbitMQ's management API, CMQ's API, the UI's files) as the
//! server builds it (`warren_server::http::standalone_router`), on a real standalone broker in a
//! data directory of its own: arbitrary requests may be refused, never panic the server, never
//! answer 500 (bad input is the client's error, 4xx), and always answer within the deadline.
//!
//! Input: `flags u8 | path \n | body`. flags: bits 0-1 the method (GET, PUT, POST, DELETE), bit 2
//! no credentials, bit 3 `X-Requested-With`, bit 4 a form body (CMQ's) rather than JSON. The broker
//! lives for the whole run, so what one input declares the next can use.

use std::sync::OnceLock;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use tower::ServiceExt;

struct World {
    runtime: tokio::runtime::Runtime,
    router: Router,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/http_api-data");
        // Data directories of runs that have ended (their process is gone) are removed.
        if let Ok(dirs) = std::fs::read_dir(&root) {
            for d in dirs.flatten() {
                let pid = d.file_name().to_string_lossy().into_owned();
                if !std::path::Path::new("/proc").join(&pid).exists() {
                    let _ = std::fs::remove_dir_all(d.path());
                }
            }
        }
        let dir = root.join(std::process::id().to_string());
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the fuzz broker's data directory");
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("a tokio runtime");
        let router = runtime.block_on(async { warren_server::http::standalone_router(&dir) }).expect("open the fuzz broker");
        World { runtime, router }
    })
}

const METHODS: [&str; 4] = ["GET", "PUT", "POST", "DELETE"];
/// guest:guest
const CREDENTIALS: &str = "Basic Z3Vlc3Q6Z3Vlc3Q=";
/// Longer than any handler may take on any input (the API's own waits are at most 10 s, and only
/// for a queue's disk read or commit).
const DEADLINE: Duration = Duration::from_secs(8);

pub fn check_http(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else { return };
    let split = rest.iter().position(|b| *b == b'\n').unwrap_or(rest.len());
    let (path, body) = (&rest[..split], rest.get(split + 1..).unwrap_or(&[]));
    let Ok(path) = std::str::from_utf8(path) else { return };
    let mut builder = axum::http::Request::builder().method(METHODS[(flags & 3) as usize]).uri(path).header("host", "127.0.0.1:15672");
    if flags & 4 == 0 {
        builder = builder.header("authorization", CREDENTIALS);
    }
    if flags & 8 != 0 {
        builder = builder.header("x-requested-with", "XMLHttpRequest");
    }
    let content_type = if flags & 16 != 0 { "application/x-www-form-urlencoded" } else { "application/json" };
    // A path hyper would refuse never reaches the router.
    let Ok(mut request) = builder.header("content-type", content_type).body(Body::from(body.to_vec())) else { return };
    warren_server::http::prepare(&mut request, "127.0.0.1:40000".parse().expect("an address"));
    let world = world();
    let (status, answer) = world.runtime.block_on(async {
        let answered = tokio::time::timeout(DEADLINE, async {
            let response = world.router.clone().oneshot(request).await.expect("the router's error type is Infallible");
            let status = response.status();
            let bytes = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            (status, bytes)
        });
        answered.await.unwrap_or_else(|_| panic!("no answer within {DEADLINE:?} to {} {path}", METHODS[(flags & 3) as usize]))
    });
    assert!(
        !status.is_server_error() || status == axum::http::StatusCode::SERVICE_UNAVAILABLE,
        "{} {path} answered {status}: {}",
        METHODS[(flags & 3) as usize],
        String::from_utf8_lossy(&answer)
    );
}

/// One request per route, valid, for the seed corpus: `(name, bytes)`.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let request = |flags: u8, path: &str, body: &str| {
        let mut out = vec![flags];
        out.extend_from_slice(path.as_bytes());
        out.push(b'\n');
        out.extend_from_slice(body.as_bytes());
        out
    };
    let (get, put, post, delete) = (0u8, 1u8, 2u8, 3u8);
    let list = [
        ("overview", get, "/api/overview?msg_rates_age=60&msg_rates_incr=5&lengths_age=60&lengths_incr=5", ""),
        ("whoami", get, "/api/whoami", ""),
        ("nodes", get, "/api/nodes", ""),
        ("vhosts", get, "/api/vhosts", ""),
        ("declare-queue", put, "/api/queues/%2F/fq", r#"{"durable":true,"arguments":{"x-max-length":10,"x-message-ttl":60000}}"#),
        ("declare-quorum", put, "/api/queues/%2F/fqq", r#"{"durable":true,"arguments":{"x-queue-type":"quorum"}}"#),
        ("queues", get, "/api/queues?columns=name,messages&sort=name&page=1&page_size=10&name=f", ""),
        ("queue", get, "/api/queues/%2F/fq", ""),
        ("queue-bindings", get, "/api/queues/%2F/fq/bindings", ""),
        ("publish", post, "/api/exchanges/%2F/amq.default/publish", r#"{"routing_key":"fq","payload":"aGk=","payload_encoding":"base64","properties":{"delivery_mode":2,"headers":{"a":1,"b":[1,"x"],"c":{"d":true}},"priority":3,"expiration":"60000"}}"#),
        ("get", post, "/api/queues/%2F/fq/get", r#"{"count":5,"ackmode":"ack_requeue_true","encoding":"auto","truncate":10}"#),
        ("purge", delete, "/api/queues/%2F/fq/contents", ""),
        ("declare-exchange", put, "/api/exchanges/%2F/fx", r#"{"type":"headers","durable":true,"arguments":{"alternate-exchange":"amq.fanout"}}"#),
        ("bind", post, "/api/bindings/%2F/e/fx/q/fq", r#"{"routing_key":"k","arguments":{"x-match":"any","a":"1"}}"#),
        ("bindings", get, "/api/bindings/%2F/e/fx/q/fq", ""),
        ("unbind", delete, "/api/bindings/%2F/e/fx/q/fq/k~", ""),
        ("exchanges", get, "/api/exchanges/%2F", ""),
        ("delete-exchange", delete, "/api/exchanges/%2F/fx?if-unused=true", ""),
        ("connections", get, "/api/connections", ""),
        ("channels", get, "/api/channels", ""),
        ("consumers", get, "/api/consumers/%2F", ""),
        ("definitions", get, "/api/definitions", ""),
        ("import", post, "/api/definitions", r#"{"queues":[{"name":"fi","vhost":"/","durable":true,"auto_delete":false,"arguments":{}}],"exchanges":[],"bindings":[]}"#),
        ("health", get, "/api/health/checks/alarms", ""),
        ("aliveness", get, "/api/aliveness-test/%2F", ""),
        ("delete-queue", delete, "/api/queues/%2F/fq?if-empty=true", ""),
        ("close-connection", delete, "/api/connections/nope", ""),
        ("ui", get, "/", ""),
        ("ui-script", get, "/ui/app.js", ""),
        ("unauthenticated", get | 4 | 8, "/api/overview", ""),
        ("cmq-send", post | 16, "/v2/index.php", "Action=SendMessage&queueName=fq&msgBody=hi&delaySeconds=0&SecretId=guest&Nonce=1&Timestamp=1795000000&SignatureMethod=HmacSHA256&Signature=abc"),
        ("cmq-batch", post | 16, "/v2/index.php", "Action=BatchReceiveMessage&queueName=fq&numOfMsg=16&pollingWaitSeconds=0&receiptHandle.1=x&msgBody.1=a&msgBody.2=%FF&SecretId=guest&Nonce=2&Timestamp=0&Signature=x"),
        ("cmq-get", get, "/v2/index.php?Action=ListQueue&SecretId=guest&Nonce=3&Timestamp=1&Signature=x", ""),
    ];
    list.iter().map(|(name, flags, path, body)| (name.to_string(), request(*flags, path, body))).collect()
}
