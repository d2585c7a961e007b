//! A TCP proxy in front of each node's peer listener, so a test can cut a node off.
//!
//! Every node's peer listener is on a loopback address of its own, and peer connections
//! leave from that address, so the proxy knows which node a connection comes from by its
//! source IP. [`Proxy::isolate`] cuts every link to and from one node, existing and new,
//! both ways; [`Proxy::heal`] lets new links through again.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

/// One forwarded connection: from node `from` (`None`: not from a node) to node `to`.
struct Link {
    from: Option<usize>,
    to: usize,
    task: AbortHandle,
}

struct Shared {
    /// The node cut off, if any.
    isolated: Mutex<Option<usize>>,
    links: Mutex<Vec<Link>>,
    /// Each node's peer listener address, whose IP its connections leave from.
    targets: Vec<SocketAddr>,
}

impl Shared {
    fn cut(&self, from: Option<usize>, to: usize) -> bool {
        let isolated = *self.isolated.lock().expect("proxy mutex poisoned");
        isolated.is_some_and(|n| n == to || Some(n) == from)
    }

    fn node_at(&self, ip: IpAddr) -> Option<usize> {
        self.targets.iter().position(|t| t.ip() == ip)
    }
}

/// The proxy: one listener per node, forwarding to its peer listener.
pub struct Proxy {
    shared: Arc<Shared>,
    addrs: Vec<SocketAddr>,
    accepts: Vec<JoinHandle<()>>,
}

impl Proxy {
    /// Listens on a free loopback port per node of `targets` (the nodes' peer listeners).
    pub async fn start(targets: Vec<SocketAddr>) -> Proxy {
        let shared = Arc::new(Shared {
            isolated: Mutex::new(None),
            links: Mutex::new(Vec::new()),
            targets,
        });
        let mut addrs = Vec::new();
        let mut accepts = Vec::new();
        for to in 0..shared.targets.len() {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
            addrs.push(listener.local_addr().expect("proxy addr"));
            accepts.push(tokio::spawn(accept_loop(listener, to, shared.clone())));
        }
        Proxy {
            shared,
            addrs,
            accepts,
        }
    }

    /// The address that stands for node `node`'s peer listener.
    pub fn addr(&self, node: usize) -> SocketAddr {
        self.addrs[node]
    }

    /// Cuts every link to and from `node`, now and until [`Proxy::heal`].
    pub fn isolate(&self, node: usize) {
        *self.shared.isolated.lock().expect("proxy mutex poisoned") = Some(node);
        let mut links = self.shared.links.lock().expect("proxy mutex poisoned");
        links.retain(|link| {
            let cut = link.to == node || link.from == Some(node);
            if cut {
                link.task.abort();
            }
            !cut && !link.task.is_finished()
        });
    }

    /// Lets new links through again.
    pub fn heal(&self) {
        *self.shared.isolated.lock().expect("proxy mutex poisoned") = None;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for task in &self.accepts {
            task.abort();
        }
        for link in self
            .shared
            .links
            .lock()
            .expect("proxy mutex poisoned")
            .iter()
        {
            link.task.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, to: usize, shared: Arc<Shared>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let from = shared.node_at(peer.ip());
        if shared.cut(from, to) {
            continue; // dropped: the connection closes at once
        }
        let task = tokio::spawn(forward(stream, shared.targets[to]));
        let mut links = shared.links.lock().expect("proxy mutex poisoned");
        links.retain(|link| !link.task.is_finished());
        // Checked again under the lock: an isolate() between the first check and here
        // would otherwise miss this link.
        if shared.cut(from, to) {
            task.abort();
        } else {
            links.push(Link {
                from,
                to,
                task: task.abort_handle(),
            });
        }
    }
}

async fn forward(mut inbound: TcpStream, target: SocketAddr) {
    let Ok(mut outbound) = TcpStream::connect(target).await else {
        return;
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
}
