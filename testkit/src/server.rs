//! Servers inside the test process: [`Server`] in the test's own runtime, [`ThreadServer`] in a
//! runtime of its own.
//!
//! # Virtual time
//! [`Server::start_virtual`] runs the server in the runtime of a test whose clock is paused
//! (`#[tokio::test(start_paused = true)]`). The server's clock, ticker and timeouts are then
//! virtual, like the client's; tokio moves the clock to the next timer whenever every task is
//! idle, so a lease runs out without waiting for it. Two things keep that exact:
//! - tokio also moves the clock to the next timer when the runtime parks while a loopback
//!   reply is already readable (it polls I/O without blocking, then advances). The server's
//!   ticker (every 2 ms) is always due soon, so a hop over loopback costs at most one tick of
//!   virtual time, not a jump to some far timeout; a test that turns the ticker off keeps a
//!   [`Heartbeat`] instead;
//! - nothing may wait on another thread, or virtual time would race ahead while it does: the
//!   WAL's syncer is a thread, so the virtual server logs only fencing-token reservations
//!   (token-only durability, one reservation big enough for any test) and replies never
//!   wait for a sync.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tenure_server::{Config, Durability};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::oneshot;

/// The period of a [`Heartbeat`]: the most virtual time one idle moment may skip.
const HEARTBEAT_PERIOD: Duration = Duration::from_millis(1);

/// A task that keeps a timer due every millisecond while it lives, for tests on a paused
/// clock whose server has no ticker of its own to bound how far tokio skips ahead while a
/// reply is on its way (see the module comment). Stops when dropped.
pub struct Heartbeat(tokio::task::JoinHandle<()>);

impl Heartbeat {
    /// Starts beating on the current runtime.
    pub fn start() -> Heartbeat {
        Heartbeat(tokio::spawn(async {
            loop {
                tokio::time::sleep(HEARTBEAT_PERIOD).await;
            }
        }))
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long [`Server::start_at`] tries to bind an address a previous server just left.
const REBIND_WAIT_MAX: Duration = Duration::from_secs(10);
/// How often it tries.
const REBIND_RETRY: Duration = Duration::from_millis(20);

/// A server running in the test's own runtime.
pub struct Server {
    /// Where it listens (127.0.0.1, a port the kernel chose).
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tenure_server::ServerError>>,
    _data: Option<tempfile::TempDir>,
}

impl Server {
    /// Starts a server with the test defaults, data in `dir`.
    pub async fn start(dir: &Path) -> Server {
        Server::start_with(Config::for_tests(dir)).await
    }

    /// Starts a server with the test defaults and `tweak` applied, data in `dir`.
    pub async fn start_in(dir: &Path, tweak: impl FnOnce(&mut Config)) -> Server {
        let mut config = Config::for_tests(dir);
        tweak(&mut config);
        Server::start_with(config).await
    }

    /// Starts a server with `config`. It may still be recovering when this returns: the
    /// listener is bound, so connections wait in its backlog.
    pub async fn start_with(config: Config) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind port 0");
        Server::serve(config, listener)
    }

    /// Starts a server with `config` on `addr`, as a restart on the same address does; the
    /// port may take a moment to be free again after the previous server closed it.
    pub async fn start_at(config: Config, addr: SocketAddr) -> Server {
        let deadline = tokio::time::Instant::now() + REBIND_WAIT_MAX;
        loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(listener) => return Server::serve(config, listener),
                Err(_) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(REBIND_RETRY).await;
                }
                Err(e) => panic!("cannot bind {addr} again: {e}"),
            }
        }
    }

    fn serve(config: Config, listener: tokio::net::TcpListener) -> Server {
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tenure_server::run(config, listener, async move {
            let _ = stopped.await;
        }));
        Server {
            addr,
            stop: Some(stop),
            task,
            _data: None,
        }
    }

    /// Starts a server with `config` and its WAL in `storage` (`tenure_server::run_with_storage`).
    pub async fn start_with_storage(
        config: Config,
        storage: Arc<dyn tenure_server::wal::Storage>,
    ) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind port 0");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let task = tokio::spawn(tenure_server::run_with_storage(
            config, storage, listener, shutdown,
        ));
        Server {
            addr,
            stop: Some(stop),
            task,
            _data: None,
        }
    }

    /// Starts a server for a test on a paused clock (see the module comment), with data in a
    /// temporary directory of its own, and returns once it answers.
    pub async fn start_virtual() -> Server {
        Server::start_virtual_with(|_| {}).await
    }

    /// [`Server::start_virtual`] with `tweak` applied to the configuration.
    pub async fn start_virtual_with(tweak: impl FnOnce(&mut Config)) -> Server {
        let data = tempfile::tempdir().expect("temp dir");
        let mut server = Server::start_virtual_at(data.path(), tweak).await;
        server._data = Some(data);
        server
    }

    /// [`Server::start_virtual_with`], data in `dir` (to restart on it).
    pub async fn start_virtual_at(dir: &Path, tweak: impl FnOnce(&mut Config)) -> Server {
        let mut config = Config::for_tests(dir);
        config.durability = Durability::Tokens;
        config.token_block = 1 << 20;
        tweak(&mut config);
        let server = Server::start_with(config).await;
        server.wait_ready().await;
        server
    }

    /// Waits for a console PING to be answered. No timeout of its own: start-up waits for
    /// the WAL's syncer thread, and a timer would let virtual time race past it. A server
    /// that fails to start drops its listener, which ends the wait with an error.
    async fn wait_ready(&self) {
        let stream = tokio::net::TcpStream::connect(self.addr)
            .await
            .expect("connect to the test server");
        let (read, mut write) = stream.into_split();
        write.write_all(b"PING\n").await.expect("send PING");
        let mut line = String::new();
        BufReader::new(read)
            .read_line(&mut line)
            .await
            .expect("read PONG");
        assert_eq!(line.trim_end(), "PONG", "the test server did not start");
    }

    /// The address as the client crate takes it.
    pub fn addr_string(&self) -> String {
        self.addr.to_string()
    }

    /// A client connected to this server.
    pub async fn client(&self) -> tenure::Client {
        tenure::Client::connect(self.addr_string())
            .await
            .expect("connect to the test server")
    }

    /// Starts shutting down without waiting for it.
    pub fn trigger_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Shuts the server down cleanly and checks it stopped without an error.
    pub async fn stop(self) {
        self.stop_result().await.expect("server stopped cleanly");
    }

    /// Shuts the server down and returns what `run` returned.
    pub async fn stop_result(mut self) -> Result<(), tenure_server::ServerError> {
        self.trigger_stop();
        (&mut self.task).await.expect("server task")
    }
}

/// A WAL in `dir` that fails on cue: the configuration to run it with (fsync on), the handle
/// that arms its faults, and the storage for [`Server::start_with_storage`] or
/// `tenure_server::run_with_storage`.
pub fn faulty_storage(
    dir: &Path,
) -> (
    Config,
    Arc<tenure_server::wal::Faults>,
    Arc<dyn tenure_server::wal::Storage>,
) {
    use tenure_server::wal::{Faults, FaultyStorage, FsStorage};
    let faults = Arc::new(Faults::default());
    let files = FsStorage::new(dir).expect("WAL directory");
    let storage = FaultyStorage::new(files, Arc::clone(&faults));
    let config = Config {
        fsync: true,
        ..Config::for_tests(dir)
    };
    (config, faults, Arc::new(storage))
}

/// A server in a runtime of its own, on a thread of its own: [`ThreadServer::kill`] drops that
/// runtime, closing every socket at once as a crash would. Real time only.
pub struct ThreadServer {
    /// Where it listens, as the client crate and the command line take it.
    pub addr: String,
    kill: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    _data: tempfile::TempDir,
}

impl ThreadServer {
    /// Starts a server with the test defaults, data in a temporary directory.
    pub fn start() -> ThreadServer {
        ThreadServer::start_with(|_| {})
    }

    /// [`ThreadServer::start`] with `tweak` applied to the configuration.
    pub fn start_with(tweak: impl FnOnce(&mut Config)) -> ThreadServer {
        let data = tempfile::tempdir().expect("temp dir");
        let mut config = Config::for_tests(data.path());
        tweak(&mut config);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let addr = listener.local_addr().expect("local addr").to_string();
        let (kill, killed) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || serve_until_killed(config, listener, killed));
        ThreadServer {
            addr,
            kill: Some(kill),
            thread: Some(thread),
            _data: data,
        }
    }

    /// Kills the server without waiting for it (safe to call from async code).
    pub fn kill(&mut self) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
    }

    /// A client connected to this server.
    pub async fn client(&self) -> tenure::Client {
        tenure::Client::connect(self.addr.clone())
            .await
            .expect("connect to the test server")
    }
}

fn serve_until_killed(
    config: Config,
    listener: std::net::TcpListener,
    killed: oneshot::Receiver<()>,
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("server runtime");
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        let (_stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
        };
        let server = tenure_server::run(config, listener, shutdown);
        tokio::select! {
            result = server => eprintln!("test server stopped by itself: {result:?}"),
            _ = killed => {}
        }
    });
    // Dropping every task at once closes every socket: the server "crashes".
    runtime.shutdown_background();
}

impl Drop for ThreadServer {
    fn drop(&mut self) {
        self.kill();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
