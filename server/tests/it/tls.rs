//! TLS on the client port, with certificates made at test time: a trusted certificate serves
//! both surfaces; an untrusted one, or the wrong name, is refused; plain text to a TLS port is
//! told so and closed while other connections keep their locks; mutual TLS, where a client
//! certificate can stand for an identity; certificate rotation on SIGHUP; the loopback rule.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tenure::{AcquireOptions, Client, ClientConfig, Error, RenewOutcome, TlsOptions};
use tenure_protocol::handshake::{Hello, HelloAck, VERSION};
use tenure_protocol::{ErrorCode, ProtocolError};
use tenure_server::identity::hash_secret;
use tenure_server::Config;
use tenure_testkit::tls::Issued;
use tenure_testkit::{signal, Server, TestCa};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Most time any one reply or handshake may take.
const REPLY_WAIT_MAX: Duration = Duration::from_secs(10);

/// A CA and a server certificate from it, in `dir`.
struct Pki {
    ca: TestCa,
    server: tenure_testkit::tls::Issued,
}

fn pki(dir: &Path) -> Pki {
    let ca = TestCa::new(dir, "trusted");
    let server = ca.server(dir, "server");
    Pki { ca, server }
}

async fn tls_server(dir: &Path, pki: &Pki, tweak: impl FnOnce(&mut Config)) -> Server {
    let files = pki.ca.server_files(&pki.server, None);
    Server::start_in(dir, |config| {
        config.tls = Some(files);
        tweak(config);
    })
    .await
}

async fn client(server: &Server, tls: TlsOptions) -> Result<Client, Error> {
    let config = ClientConfig::default().with_tls(tls);
    Client::connect_with(server.addr.to_string(), config).await
}

/// A console connection over TLS, trusting `ca`, presenting `client` if given.
pub(crate) struct TlsConsole {
    read: BufReader<tokio::io::ReadHalf<tokio_rustls::client::TlsStream<TcpStream>>>,
    write: tokio::io::WriteHalf<tokio_rustls::client::TlsStream<TcpStream>>,
}

impl TlsConsole {
    async fn connect(server: &Server, ca: &TestCa, client: Option<&Issued>) -> TlsConsole {
        TlsConsole::connect_to(&server.addr.to_string(), ca, client).await
    }

    /// [`TlsConsole::connect`] to any address, such as a cluster node's client port.
    pub(crate) async fn connect_to(addr: &str, ca: &TestCa, client: Option<&Issued>) -> TlsConsole {
        let mut roots = rustls::RootCertStore::empty();
        let ca_cert = CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap();
        roots.add(ca_cert).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some(issued) => {
                let chain = CertificateDer::pem_file_iter(&issued.cert)
                    .unwrap()
                    .collect::<Result<Vec<_>, _>>()
                    .unwrap();
                let key = PrivateKeyDer::from_pem_file(&issued.key).unwrap();
                builder.with_client_auth_cert(chain, key).unwrap()
            }
        };
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        let (read, write) = tokio::io::split(stream);
        TlsConsole {
            read: BufReader::new(read),
            write,
        }
    }

    /// One line out, one line back.
    pub(crate) async fn cmd(&mut self, line: &str) -> String {
        let text = format!("{line}\n");
        self.write.write_all(text.as_bytes()).await.unwrap();
        let mut reply = String::new();
        tokio::time::timeout(REPLY_WAIT_MAX, self.read.read_line(&mut reply))
            .await
            .expect("no console reply in time")
            .unwrap();
        reply.trim_end().to_string()
    }
}

/// The console over TLS: one line out, one line back.
async fn tls_console_line(server: &Server, ca: &TestCa, line: &str) -> String {
    TlsConsole::connect(server, ca, None).await.cmd(line).await
}

#[tokio::test]
async fn trusted_certificate_serves_the_binary_protocol_and_the_console() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = tls_server(dir.path(), &pki, |_| {}).await;
    let client = client(&server, pki.ca.trust()).await.unwrap();
    let lease = client
        .acquire(
            "tls/binary",
            Duration::from_secs(30),
            AcquireOptions::default(),
        )
        .await
        .unwrap()
        .granted()
        .expect("granted over TLS");
    assert!(lease.fencing_token() > 0);
    let reply = tls_console_line(&server, &pki.ca, "ACQUIRE tls/console 30000").await;
    assert!(reply.starts_with("OK token="), "{reply}");
    // The name can also be given explicitly (here: the certificate's DNS name).
    let named = pki.ca.trust().with_server_name("localhost");
    client_on(&server, named).await.ping().await.unwrap();
}

async fn client_on(server: &Server, tls: TlsOptions) -> Client {
    client(server, tls).await.unwrap()
}

#[tokio::test]
async fn untrusted_certificate_and_wrong_name_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = tls_server(dir.path(), &pki, |_| {}).await;
    let stranger = TestCa::new(dir.path(), "stranger");
    let err = client(&server, stranger.trust()).await.unwrap_err();
    assert!(matches!(err, Error::Tls(_)), "{err:?}");
    assert!(
        !err.is_transient(),
        "a certificate problem is not worth retrying"
    );
    assert!(err.to_string().contains("certificate"), "{err}");
    let wrong_name = pki.ca.trust().with_server_name("locks.example.com");
    let err = client(&server, wrong_name).await.unwrap_err();
    assert!(matches!(err, Error::Tls(_)), "{err:?}");
    // The server is unharmed.
    client(&server, pki.ca.trust())
        .await
        .unwrap()
        .ping()
        .await
        .unwrap();
}

#[tokio::test]
async fn plain_text_to_a_tls_port_is_told_and_closed_while_others_keep_their_locks() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let server = tls_server(dir.path(), &pki, |_| {}).await;
    let holder = client(&server, pki.ca.trust()).await.unwrap();
    let lease = holder
        .acquire(
            "tls/held",
            Duration::from_secs(30),
            AcquireOptions::default(),
        )
        .await
        .unwrap()
        .granted()
        .unwrap();

    // A console line: an ERR line naming TLS, then the close.
    let mut plain = TcpStream::connect(server.addr).await.unwrap();
    plain.write_all(b"ACQUIRE tls/held 1000\n").await.unwrap();
    let mut text = String::new();
    tokio::time::timeout(REPLY_WAIT_MAX, plain.read_to_string(&mut text))
        .await
        .expect("not closed in time")
        .unwrap();
    assert!(
        text.starts_with("ERR BAD_HANDSHAKE this port requires TLS"),
        "{text:?}"
    );

    // A binary hello: a handshake refusal the binary client understands, then the close.
    let mut plain = TcpStream::connect(server.addr).await.unwrap();
    let mut hello = BytesMut::new();
    Hello { version: VERSION }.encode(&mut hello);
    plain.write_all(&hello).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(REPLY_WAIT_MAX, plain.read_to_end(&mut answer))
        .await
        .expect("not closed in time")
        .unwrap();
    let refusal = HelloAck::decode(&mut BytesMut::from(&answer[..])).unwrap_err();
    match refusal {
        ProtocolError::HandshakeRefused { code, message, .. } => {
            assert_eq!(code, ErrorCode::BadHandshake);
            assert!(message.contains("requires TLS"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    // The plain client library says the same.
    let err = Client::connect(server.addr.to_string()).await.unwrap_err();
    assert!(err.to_string().contains("requires TLS"), "{err}");

    // Garbage that is neither closes too; the holder never noticed any of it.
    let mut junk = TcpStream::connect(server.addr).await.unwrap();
    junk.write_all(&[0x16, 0x03, 0x01, 0xff, 0xff, 1, 2, 3])
        .await
        .unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(REPLY_WAIT_MAX, junk.read_to_end(&mut rest))
        .await
        .expect("a broken TLS hello is closed in time");
    let renewed = holder
        .renew("tls/held", lease.lease_id(), Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
}

/// `admin` may do everything; `orders` may lock `orders/` keys only.
fn identities(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("identities.toml");
    let text = format!(
        "[[identity]]\nname = \"admin\"\nsecret-hash = \"{}\"\nprefixes = [\"*\"]\nstats = true\n\n\
         [[identity]]\nname = \"orders\"\nsecret-hash = \"{}\"\nprefixes = [\"orders/\"]\n",
        hash_secret(b"admin-secret").unwrap(),
        hash_secret(b"orders-secret").unwrap(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// An acquire of `key` by `client` is refused with `code`.
async fn assert_refused(client: &Client, key: &str, code: ErrorCode) {
    let err = client
        .acquire(key, Duration::from_secs(30), AcquireOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Server { code: got, .. } if *got == code),
        "{err:?}"
    );
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_whose_name_can_be_an_identity() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let clients = TestCa::new(dir.path(), "clients");
    let files = pki.ca.server_files(&pki.server, Some(&clients));
    let ids = identities(dir.path());
    let server = Server::start_in(dir.path(), |config| {
        config.tls = Some(files);
        config.identities = Some(ids);
    })
    .await;

    // No certificate, or one from a CA the server does not trust: refused.
    assert!(client(&server, pki.ca.trust()).await.is_err());
    let rogue_ca = TestCa::new(dir.path(), "rogue");
    let rogue = rogue_ca.client(dir.path(), "admin");
    let rogue = TlsOptions::from_files(&pki.ca.path, Some((&rogue.cert, &rogue.key))).unwrap();
    assert!(client(&server, rogue).await.is_err());

    // A certificate named after an identity is that identity, without AUTH.
    let orders = clients.client(dir.path(), "orders");
    let orders = client(&server, pki.ca.trust_as(&orders)).await.unwrap();
    let granted = orders
        .acquire(
            "orders/1",
            Duration::from_secs(30),
            AcquireOptions::default(),
        )
        .await
        .unwrap();
    assert!(granted.granted().is_some());
    assert_refused(&orders, "payroll/1", ErrorCode::Forbidden).await;

    // A client that also sends AUTH as its certificate's identity still connects.
    let orders_cert = clients.client(dir.path(), "orders");
    let config = ClientConfig::default()
        .with_tls(pki.ca.trust_as(&orders_cert))
        .with_credentials("orders", "not-checked");
    let doubly = Client::connect_with(server.addr.to_string(), config)
        .await
        .expect("AUTH as the certificate's identity is AUTHENTICATED");
    doubly.ping().await.unwrap();

    // A trusted certificate with no identity's name must still AUTH.
    let nobody = clients.client(dir.path(), "nobody");
    let nobody = client(&server, pki.ca.trust_as(&nobody)).await.unwrap();
    assert_refused(&nobody, "orders/2", ErrorCode::Unauthenticated).await;
    let admin = clients.client(dir.path(), "nobody-admin");
    let config = ClientConfig::default()
        .with_tls(pki.ca.trust_as(&admin))
        .with_credentials("admin", "admin-secret");
    let admin = Client::connect_with(server.addr.to_string(), config)
        .await
        .unwrap();
    assert!(!admin.stats().await.unwrap().is_empty());
}

/// AUTH on a connection a certificate authenticated: as the certificate's own name it is
/// AUTHENTICATED whatever the secret (the connection already is that identity, and stays
/// it); as any other name it is BAD_ARGS, and the connection is still the certificate's.
#[tokio::test]
async fn auth_after_a_client_certificate_is_accepted_for_its_own_name_only() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let clients = TestCa::new(dir.path(), "clients");
    let files = pki.ca.server_files(&pki.server, Some(&clients));
    let ids = identities(dir.path());
    let server = Server::start_in(dir.path(), |config| {
        config.tls = Some(files);
        config.identities = Some(ids);
    })
    .await;
    let orders = clients.client(dir.path(), "orders");
    let mut console = TlsConsole::connect(&server, &pki.ca, Some(&orders)).await;
    assert_eq!(
        console.cmd("AUTH orders wrong-secret").await,
        "OK authenticated orders"
    );
    assert_eq!(
        console.cmd("AUTH admin admin-secret").await,
        "ERR BAD_ARGS this connection is already authenticated"
    );
    let granted = console.cmd("ACQUIRE orders/tls 30000").await;
    assert!(granted.starts_with("OK token="), "{granted}");
    // Still `orders`, not `admin`: outside its prefixes, and no STATS permission.
    let refused = console.cmd("ACQUIRE payroll/1 30000").await;
    assert!(refused.starts_with("ERR FORBIDDEN "), "{refused}");
    let refused = console.cmd("STATS").await;
    assert!(refused.starts_with("ERR FORBIDDEN "), "{refused}");
    server.stop().await;
}

#[tokio::test]
async fn mutual_tls_stands_in_for_identities_on_a_non_loopback_address() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let clients = TestCa::new(dir.path(), "clients");
    let mut config = Config::for_tests(dir.path());
    config.tls = Some(pki.ca.server_files(&pki.server, Some(&clients)));
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(tenure_server::run(config, listener, async move {
        let _ = stopped.await;
    }));
    let me = clients.client(dir.path(), "me");
    let config = ClientConfig::default().with_tls(pki.ca.trust_as(&me));
    let client = Client::connect_with(format!("127.0.0.1:{port}"), config)
        .await
        .expect("served 0.0.0.0 with mutual TLS and no identities");
    client.ping().await.unwrap();
    drop(client);
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

#[test]
fn sighup_rotates_the_certificate_for_new_connections() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let cert = dir.path().join("live.pem");
    let key = dir.path().join("live.key");
    std::fs::copy(&pki.server.cert, &cert).unwrap();
    std::fs::copy(&pki.server.key, &key).unwrap();
    let data = dir.path().join("data");
    let args = [
        "--no-fsync",
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ];
    let daemon = crate::tenured(&data, &args);
    let addr = daemon.addr.to_string();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let connect = |tls: TlsOptions| {
        let addr = addr.clone();
        runtime.block_on(async move {
            let config = ClientConfig::default().with_tls(tls);
            Client::connect_with(addr, config).await
        })
    };
    let old_client = connect(pki.ca.trust()).unwrap();

    let next = TestCa::new(dir.path(), "next");
    let rotated = next.server(dir.path(), "rotated");
    std::fs::copy(&rotated.cert, &cert).unwrap();
    std::fs::copy(&rotated.key, &key).unwrap();
    signal(daemon.pid(), "HUP");
    // The reload takes a moment: wait, bounded, until the new CA is accepted.
    let deadline = std::time::Instant::now() + REPLY_WAIT_MAX;
    while connect(next.trust()).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "new certificate not served"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(matches!(connect(pki.ca.trust()), Err(Error::Tls(_))));
    // The connection made before the rotation is still open and served.
    runtime.block_on(old_client.ping()).unwrap();

    // A broken file on the next SIGHUP leaves the rotated certificate in force.
    std::fs::write(&key, "not a key").unwrap();
    signal(daemon.pid(), "HUP");
    std::thread::sleep(Duration::from_millis(200));
    let client = connect(next.trust()).unwrap();
    runtime.block_on(client.ping()).unwrap();
}

#[tokio::test]
async fn missing_or_broken_files_stop_the_start_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let mut config = Config::for_tests(dir.path());
    let mut files = pki.ca.server_files(&pki.server, None);
    files.key = dir.path().join("missing.key");
    config.tls = Some(files);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = tenure_server::run(config, listener, std::future::pending())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("missing.key"), "{err}");
}

/// The `sh` block after `<!-- recipe: NAME -->` in README.md, its indentation removed.
fn readme_recipe(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let marker = format!("<!-- recipe: {name} -->");
    let mut lines = readme.lines().skip_while(|l| l.trim() != marker).skip(1);
    let fence = lines.next().expect("README.md has the recipe");
    assert_eq!(
        fence.trim(),
        "```sh",
        "the recipe marker is followed by a sh block"
    );
    let indent = fence.len() - fence.trim_start().len();
    let body: Vec<&str> = lines
        .take_while(|l| l.trim() != "```")
        .map(|l| l.get(indent..).unwrap_or(""))
        .collect();
    body.join("\n") + "\n"
}

/// README's certificate recipe, run as written in a temporary directory, makes a CA, a
/// server certificate and an X.509 v3 client certificate that mutual TLS accepts as the
/// identity its name gives. Needs `openssl` (.ci/run installs it): fails without it.
#[tokio::test]
async fn readme_certificate_recipe_makes_a_client_certificate_that_authenticates() {
    let found = std::process::Command::new("sh")
        .args(["-c", "command -v openssl"])
        .output()
        .unwrap();
    assert!(
        found.status.success(),
        "openssl is needed: .ci/run installs it"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new("sh")
        .args(["-e", "-c", &readme_recipe("tls-certificates")])
        .current_dir(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the recipe failed:\n{stderr}");
    let file = |name: &str| dir.path().join(name);
    let files = tenure_server::tls::TlsFiles {
        cert: file("server.pem"),
        key: file("server.key"),
        client_ca: Some(file("ca.pem")),
    };
    let ids = identities(dir.path());
    let server = Server::start_in(dir.path(), |config| {
        config.tls = Some(files);
        config.identities = Some(ids);
    })
    .await;
    let cert = (file("orders.pem"), file("orders.key"));
    let tls = TlsOptions::from_files(&file("ca.pem"), Some((&cert.0, &cert.1))).unwrap();
    let orders = client(&server, tls)
        .await
        .expect("the recipe's client certificate is accepted");
    // No AUTH was sent: a grant means the certificate authenticated the connection.
    let granted = orders
        .acquire(
            "orders/1",
            Duration::from_secs(30),
            AcquireOptions::default(),
        )
        .await
        .unwrap();
    assert!(granted.granted().is_some());
    assert_refused(&orders, "payroll/1", ErrorCode::Forbidden).await;
    server.stop().await;
}

/// A console over mutual TLS as the holder of `cert`, its opening line sent: the connection.
async fn tls_console_as(
    server: &Server,
    ca: &TestCa,
    cert: &tenure_testkit::tls::Issued,
    line: &str,
) -> BufReader<tokio_rustls::client::TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem.as_bytes()).unwrap())
        .unwrap();
    let chain = CertificateDer::pem_file_iter(&cert.cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&cert.key).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let mut stream = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    stream
        .write_all(format!("{line}\n").as_bytes())
        .await
        .unwrap();
    BufReader::new(stream)
}

/// The next console line, or `None` once the server closed the connection.
async fn next_line(
    conn: &mut BufReader<tokio_rustls::client::TlsStream<TcpStream>>,
) -> Option<String> {
    let mut line = String::new();
    let read = tokio::time::timeout(REPLY_WAIT_MAX, conn.read_line(&mut line));
    let n = read.await.expect("no console line in time").unwrap_or(0);
    (n > 0).then(|| line.trim_end().to_string())
}

/// A client certificate authenticates within its identity's `connections-max` too.
#[tokio::test]
async fn a_certificate_over_its_identity_s_connections_max_is_refused_and_closed() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki(dir.path());
    let clients = TestCa::new(dir.path(), "clients");
    let files = pki.ca.server_files(&pki.server, Some(&clients));
    let ids = dir.path().join("identities.toml");
    let text = format!(
        "[[identity]]\nname = \"orders\"\nsecret-hash = \"{}\"\nprefixes = [\"orders/\"]\n\
         connections-max = 1\n",
        hash_secret(b"orders-secret").unwrap(),
    );
    std::fs::write(&ids, text).unwrap();
    let server = Server::start_in(dir.path(), |config| {
        config.tls = Some(files);
        config.identities = Some(ids);
    })
    .await;
    let orders = clients.client(dir.path(), "orders");
    let mut first = tls_console_as(&server, &pki.ca, &orders, "INSPECT orders/1").await;
    assert_eq!(next_line(&mut first).await.as_deref(), Some("FREE"));
    let mut second = tls_console_as(&server, &pki.ca, &orders, "INSPECT orders/1").await;
    let refused = next_line(&mut second).await;
    assert_eq!(
        refused.as_deref(),
        Some("ERR CONNECTIONS_LIMIT connections-max: identity `orders` has 1 connections already"),
        "the request is not run"
    );
    assert_eq!(next_line(&mut second).await, None, "then closed");
    first
        .get_mut()
        .write_all(b"INSPECT orders/2\n")
        .await
        .unwrap();
    assert_eq!(next_line(&mut first).await.as_deref(), Some("FREE"));
}
