//! The peer port: openraft's vote, append-entries and snapshot messages between nodes.
//!
//! One request, one reply, on a TCP connection kept open between calls (pooled per peer). A frame
//! is a u32 big-endian length and that many bytes of postcard ([`PeerRequest`] one way,
//! [`PeerReply`] the other); a length over [`FRAME_LEN_MAX`] ends the connection before
//! anything is allocated. Every call is bounded by openraft's time limit for it, and a
//! connection that fails in any way is dropped and made again on the next call.
//!
//! The connection is plain TCP, or mutual TLS ([`super::peer_tls`]) when the node has peer
//! TLS: then its certificate's node id is the only sender its Raft frames may name. Every
//! request and reply is checked ([`super::peer_check`]) before openraft sees it; a frame
//! that fails closes its connection. The listener's slots keep strangers from taking the
//! places members need ([`serve_peers`]). Every connection opens, before any frame, with
//! the exchange of cluster ids ([`super::cluster_id`]).

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::catch_up::CatchUp;
use super::cluster_id::{self, ClusterId};
use super::peer_check::{self, Known, Refused};
use super::peer_tls::PeerTls;
use super::prevote::{PreVote, PreVoteReply, PreVoteRequest};
use super::{NodeId, NodeInfo, Raft, TypeConfig};

/// Largest frame either side sends or accepts, in bytes: an append of the most entries the
/// node's Raft config sends at once, each a batch at its byte cap, fits with room to spare.
pub const FRAME_LEN_MAX: usize = 64 << 20;
/// Longest wait to connect to a peer, whatever time the call has.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// A message to a peer.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// A candidate asks for a vote.
    Vote(VoteRequest<NodeId>),
    /// The leader appends entries (or sends a heartbeat).
    Append(AppendEntriesRequest<TypeConfig>),
    /// The leader sends a chunk of a snapshot.
    Snapshot(InstallSnapshotRequest<TypeConfig>),
    /// An operator makes this the cluster's first membership (`tenured cluster-init`);
    /// openraft refuses it on a node that is initialised already.
    Initialize(BTreeMap<NodeId, NodeInfo>),
    /// A node bootstrapping with `--initial-cluster` asks whether this one is initialised
    /// (has a log or a vote). Last, so the earlier variants keep their postcard tags.
    Probe,
    /// The node initialising a new cluster tells this one: if it is fresh, it lifts its vote
    /// guard ([`super::catch_up`]) so that it can vote in the first election. Answered as
    /// [`PeerRequest::Probe`] is.
    Bootstrap,
    /// A voter asks whether this node would vote for it ([`super::prevote`]). Last, so the
    /// earlier variants keep their postcard tags; a node of a version without it closes
    /// the connection, which the asker counts as a refusal.
    PreVote(PreVoteRequest),
}

/// A peer's answer, as its Raft gave it.
#[derive(Debug, Serialize, Deserialize)]
pub enum PeerReply {
    /// To [`PeerRequest::Vote`].
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    /// To [`PeerRequest::Append`].
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    /// To [`PeerRequest::Snapshot`].
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>),
    /// To [`PeerRequest::Initialize`]: why it was refused, if it was.
    Initialize(Result<(), String>),
    /// To [`PeerRequest::Probe`]: whether this node is initialised; an error if openraft
    /// could not say.
    Probe(Result<bool, String>),
    /// To [`PeerRequest::Bootstrap`]: as to a probe.
    Bootstrap(Result<bool, String>),
    /// To [`PeerRequest::PreVote`].
    PreVote(PreVoteReply),
}

/// What the peer port serves besides Raft: the vote guard, and where initialisation asks
/// the other members from.
#[derive(Clone)]
pub struct PeerService {
    /// This node's id.
    pub me: NodeId,
    /// The vote guard of a node started on an empty data directory.
    pub catch_up: Arc<CatchUp>,
    /// How this node dials its peers (from the peer listener's address, with peer TLS if
    /// configured); its TLS also serves the peer port.
    pub dialer: Dialer,
    /// Where the snapshot being received has got to ([`peer_check::SnapshotProgress`]).
    pub snapshots: Arc<peer_check::SnapshotProgress>,
    /// The rate limit on log lines about refused frames.
    pub refusals: Arc<peer_check::RefusalLog>,
    /// What this node answers pre-votes with.
    pub prevote: Arc<PreVote>,
    /// How long AppendEntries take here and how far apart they come (`/metrics`).
    pub appends: Arc<super::observe::AppendTimes>,
}

/// A peer connection's bytes: TCP, or TLS over TCP.
pub trait PeerIo: AsyncRead + AsyncWrite + Unpin + Send + Sync {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync> PeerIo for T {}
/// A peer connection, either way.
pub type PeerStream = Box<dyn PeerIo>;

/// How a node reaches its peers: from which address (the peer listener's), with which
/// TLS (`None`: plain TCP, loopback clusters only), saying which cluster id.
#[derive(Clone, Debug, Default)]
pub struct Dialer {
    source: Option<IpAddr>,
    tls: Option<Arc<PeerTls>>,
    ids: Arc<ClusterId>,
}

impl Dialer {
    /// Connections leave from `source` when it is a specific address: peer traffic then
    /// comes from one address per node both ways, which a firewall rule, or a test's proxy
    /// cutting one node off, can tell apart on loopback (`127.0.0.N` per node).
    pub fn new(source: IpAddr, tls: Option<Arc<PeerTls>>) -> Dialer {
        Dialer {
            source: (!source.is_unspecified()).then_some(source),
            tls,
            ids: Arc::default(),
        }
    }

    /// This dialer saying the cluster id `ids` holds (a node's own: the peer port's
    /// acceptor checks against it too). Without it, a dialer says none.
    pub fn with_cluster_id(self, ids: Arc<ClusterId>) -> Dialer {
        Dialer { ids, ..self }
    }

    /// The cluster id this dialer says.
    pub fn cluster_id(&self) -> &Arc<ClusterId> {
        &self.ids
    }

    /// The peer TLS this node uses, if any.
    pub fn tls(&self) -> Option<&Arc<PeerTls>> {
        self.tls.as_ref()
    }

    /// Connects to node `target` at `addr`, the TLS handshake (whose certificate must name
    /// `target`) and the cluster ids' exchange included.
    ///
    /// # Errors
    /// When the connection or the handshake fails, or the node is of another cluster.
    pub async fn dial(&self, target: NodeId, addr: &str) -> std::io::Result<PeerStream> {
        let tcp = connect_from(self.source, addr).await?;
        let _ = tcp.set_nodelay(true);
        let mut stream: PeerStream = match &self.tls {
            None => Box::new(tcp),
            Some(tls) => Box::new(tls.connect(tcp, target).await?),
        };
        cluster_id::greet(&mut stream, &self.ids, addr).await?;
        Ok(stream)
    }
}

/// `value` as one frame, length prefix included.
pub(crate) fn encode_frame(value: &impl Serialize) -> std::io::Result<Vec<u8>> {
    let mut frame = vec![0u8; 4];
    let mut frame =
        postcard::to_extend(value, std::mem::take(&mut frame)).map_err(std::io::Error::other)?;
    let len = frame.len() - 4;
    if len > FRAME_LEN_MAX {
        return Err(std::io::Error::other("peer frame over FRAME_LEN_MAX"));
    }
    frame[..4].copy_from_slice(&(len as u32).to_be_bytes());
    Ok(frame)
}

/// Writes `value` as one frame.
async fn write_frame(
    stream: &mut (impl AsyncWrite + Unpin),
    value: &impl Serialize,
) -> std::io::Result<()> {
    stream.write_all(&encode_frame(value)?).await
}

/// Reads one frame; `Ok(None)` if the peer closed cleanly before it.
async fn read_frame<T: DeserializeOwned>(
    stream: &mut (impl AsyncRead + Unpin),
) -> std::io::Result<Option<T>> {
    match read_len(stream).await? {
        Some(len) => read_body(stream, len, None).await.map(Some),
        None => Ok(None),
    }
}

/// Reads a frame's length; `Ok(None)` if the peer closed cleanly before it.
async fn read_len(stream: &mut (impl AsyncRead + Unpin)) -> std::io::Result<Option<usize>> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > FRAME_LEN_MAX {
        return Err(std::io::Error::other(format!(
            "peer frame of {len} bytes over FRAME_LEN_MAX"
        )));
    }
    Ok(Some(len))
}

/// Reads a frame's `len` bytes of body and decodes them. The buffer grows as bytes arrive
/// (doubling from [`FRAME_READ_CHUNK`], never past `len`), so memory follows what was sent,
/// not what was announced; on the peer port each growth is first taken from the node's
/// [`FrameBudget`] (`budget`: it, and whether the connection is a member's).
async fn read_body<T: DeserializeOwned>(
    stream: &mut (impl AsyncRead + Unpin),
    len: usize,
    budget: Option<(&FrameBudget, bool)>,
) -> std::io::Result<T> {
    let mut body: Vec<u8> = Vec::new();
    let mut held = Vec::new();
    while body.len() < len {
        if body.len() == body.capacity() {
            let grow = body.capacity().max(FRAME_READ_CHUNK).min(len - body.len());
            if let Some((budget, member)) = budget {
                held.push(budget.take(grow, member).await?);
            }
            body.reserve_exact(grow);
        }
        let room = (body.capacity() - body.len()).min(len - body.len());
        let read = (&mut *stream).take(room as u64).read_buf(&mut body).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    let decoded = postcard::from_bytes(&body).map_err(std::io::Error::other);
    drop((body, held));
    decoded
}

/// Bytes a frame's buffer first grows by, and the least it grows by after.
const FRAME_READ_CHUNK: usize = 64 << 10;
/// Most bytes the buffers of not-yet-complete peer frames hold at once, over all of a
/// node's peer connections: what a flood of announced-but-unsent frames can make it use.
pub const PEER_PENDING_BYTES_MAX: usize = 256 << 20;
/// Of [`PEER_PENDING_BYTES_MAX`], the most that connections not yet a member's (opening:
/// strangers, probes, a node's connection before its first frame) hold together; the rest
/// is the members' alone.
pub const PEER_OPENING_PENDING_BYTES_MAX: usize = 64 << 20;

const _: () = assert!(
    PEER_OPENING_PENDING_BYTES_MAX + 2 * FRAME_LEN_MAX <= PEER_PENDING_BYTES_MAX,
    "past any flood of opening connections, members must have room for two largest frames"
);
const _: () =
    assert!(FRAME_READ_CHUNK <= FRAME_LEN_MAX && FRAME_LEN_MAX <= PEER_OPENING_PENDING_BYTES_MAX);

/// The peer port's budget of bytes buffered by incomplete frames (see [`read_body`]). An
/// opening connection that finds its share spent is closed at once; a member's connection
/// waits for room (within [`PEER_BODY_TIMEOUT`]): members' traffic first.
struct FrameBudget {
    total: Arc<tokio::sync::Semaphore>,
    opening: Arc<tokio::sync::Semaphore>,
}

impl Default for FrameBudget {
    fn default() -> FrameBudget {
        FrameBudget {
            total: Arc::new(tokio::sync::Semaphore::new(PEER_PENDING_BYTES_MAX)),
            opening: Arc::new(tokio::sync::Semaphore::new(PEER_OPENING_PENDING_BYTES_MAX)),
        }
    }
}

/// Bytes taken from a [`FrameBudget`], given back when dropped.
type Held = (
    tokio::sync::OwnedSemaphorePermit,
    Option<tokio::sync::OwnedSemaphorePermit>,
);

impl FrameBudget {
    /// Takes `bytes` for a frame's buffer: a member waits for them, an opening connection
    /// gets them now or an error (its connection is closed).
    async fn take(&self, bytes: usize, member: bool) -> std::io::Result<Held> {
        let n = u32::try_from(bytes).expect("a frame's growth is under FRAME_LEN_MAX");
        let total = Arc::clone(&self.total);
        if member {
            let held = total.acquire_many_owned(n).await;
            return Ok((held.expect("the frame budget is never closed"), None));
        }
        let spent = || {
            let why = "opening peer connections' share of PEER_PENDING_BYTES_MAX is spent";
            std::io::Error::other(why)
        };
        let opening = Arc::clone(&self.opening).try_acquire_many_owned(n);
        let opening = opening.map_err(|_| spent())?;
        let held = total.try_acquire_many_owned(n).map_err(|_| spent())?;
        Ok((held, Some(opening)))
    }

    /// Bytes held by incomplete frames now.
    #[cfg(test)]
    fn held(&self) -> usize {
        PEER_PENDING_BYTES_MAX - self.total.available_permits()
    }
}

/// Serves the peer port on `listener` for `raft` until `stop`; while `isolated` is set,
/// connections are closed unanswered.
///
/// Slots: at most [`PEER_CONNECTIONS_MAX`] connections at once (past it one is closed at
/// once: a flood must not take the file descriptors Raft needs for its log and vote, which
/// stops its core). Of these, a connection is *opening* until it carries a Raft frame from a
/// member (`Slots`): at most [`PEER_OPENING_MAX`] are, the oldest silent one is closed to
/// make way for a newcomer, and each must send every frame's length within
/// [`PEER_OPENING_TIMEOUT`]. A member's connections (at most
/// [`PEER_CONNECTIONS_PER_NODE_MAX`] each) are then never taken by strangers: a flood of
/// silent sockets cannot hold the slots the candidates need in an election.
pub async fn serve_peers(
    listener: TcpListener,
    raft: Raft,
    stop: CancellationToken,
    isolated: Arc<AtomicBool>,
    service: PeerService,
) {
    let tracker = TaskTracker::new();
    let total = Arc::new(tokio::sync::Semaphore::new(PEER_CONNECTIONS_MAX));
    let slots = Arc::new(Slots::default());
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "peer accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&total).try_acquire_owned() else {
            tracing::warn!("peer connection refused: {PEER_CONNECTIONS_MAX} are open");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (raft, stop, isolated) = (raft.clone(), stop.clone(), Arc::clone(&isolated));
        let service = service.clone();
        let (slot, evicted) = Slots::open(&slots);
        tracker.spawn(async move {
            let _permit = permit;
            let serve = async {
                let Some((stream, conn)) = open_conn(stream, &service, slot).await else {
                    return Ok(());
                };
                serve_peer(stream, conn, raft, isolated, service).await
            };
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = evicted.cancelled() => tracing::debug!("opening peer connection made way"),
                result = serve => if let Err(e) = result {
                    tracing::debug!(error = %e, "peer connection ended");
                },
            }
        });
        // Lets the new connection's task read what it sent before the next accept: under a
        // flood, a member's connection must not be made to give way before it could speak.
        tokio::task::yield_now().await;
    }
    tracker.close();
    tracker.wait().await;
}

/// Most connections at once that have not yet carried a Raft frame from a member: probes,
/// `tenured cluster-init`, a node's connection before its first frame, and strangers.
pub const PEER_OPENING_MAX: usize = 32;
/// How long an opening connection may take to send each frame's length: a node sends its
/// frame as soon as it has connected.
pub const PEER_OPENING_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a frame's body may take once its length came: the largest frame at 10 MB/s.
pub const PEER_BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections at once from one member: a replication stream, elections, and the
/// pooled connections of confirmation rounds (at most `IDLE_PER_PEER_MAX`, 4, idle).
pub const PEER_CONNECTIONS_PER_NODE_MAX: usize = 24;

const _: () = assert!(
    PEER_OPENING_MAX
        + (tenure_protocol::limits::CLUSTER_MEMBERS_MAX - 1) * PEER_CONNECTIONS_PER_NODE_MAX
        <= PEER_CONNECTIONS_MAX,
    "the members' and the opening slots must fit the peer port's cap"
);
const _: () = assert!(IDLE_PER_PEER_MAX * 4 <= PEER_CONNECTIONS_PER_NODE_MAX);

/// The peer port's opening and member slots (see [`serve_peers`]).
#[derive(Default)]
struct Slots {
    inner: Mutex<SlotsInner>,
    /// What the connections' incomplete frames may hold.
    budget: FrameBudget,
}

#[derive(Default)]
struct SlotsInner {
    /// The number the next connection gets: connections by age.
    next: u64,
    /// Opening connections by age: what closes each, and whether it has sent a length.
    opening: BTreeMap<u64, (CancellationToken, bool)>,
    /// Connections per member.
    members: HashMap<NodeId, usize>,
}

/// One connection's place in [`Slots`]; given back when dropped.
struct Slot {
    slots: Arc<Slots>,
    seq: u64,
    member: Option<NodeId>,
}

impl Slots {
    /// A new connection's opening slot, and what closes it if it has to make way: when all
    /// are taken, the oldest silent one (or else the oldest) is closed.
    fn open(slots: &Arc<Slots>) -> (Slot, CancellationToken) {
        let mut inner = slots.lock();
        if inner.opening.len() >= PEER_OPENING_MAX {
            let silent = inner.opening.iter().find(|(_, (_, talked))| !talked);
            let oldest = silent.or(inner.opening.iter().next()).map(|(seq, _)| *seq);
            if let Some((evicted, _)) = oldest.and_then(|seq| inner.opening.remove(&seq)) {
                evicted.cancel();
            }
        }
        let seq = inner.next;
        inner.next += 1;
        let evicted = CancellationToken::new();
        inner.opening.insert(seq, (evicted.clone(), false));
        let slot = Slot {
            slots: Arc::clone(slots),
            seq,
            member: None,
        };
        (slot, evicted)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotsInner> {
        self.inner.lock().expect("peer slots poisoned")
    }
}

impl Slot {
    /// Notes that the connection sent a frame's length: it is not silent.
    fn talked(&self) {
        if let Some((_, talked)) = self.slots.lock().opening.get_mut(&self.seq) {
            *talked = true;
        }
    }

    /// Moves the connection from the opening slots to `member`'s.
    ///
    /// # Errors
    /// When `member` has [`PEER_CONNECTIONS_PER_NODE_MAX`] already.
    fn promote(&mut self, member: NodeId) -> Result<(), Refused> {
        let mut inner = self.slots.lock();
        let count = inner.members.entry(member).or_default();
        if *count >= PEER_CONNECTIONS_PER_NODE_MAX {
            let why = format!("node {member} has {PEER_CONNECTIONS_PER_NODE_MAX} connections");
            return Err(Refused(why));
        }
        *count += 1;
        inner.opening.remove(&self.seq);
        self.member = Some(member);
        Ok(())
    }

    fn is_member(&self) -> bool {
        self.member.is_some()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut inner = self.slots.lock();
        inner.opening.remove(&self.seq);
        if let Some(member) = self.member {
            if let Some(count) = inner.members.get_mut(&member) {
                *count -= 1;
                if *count == 0 {
                    inner.members.remove(&member);
                }
            }
        }
    }
}

/// Reads the next request: its length within [`PEER_OPENING_TIMEOUT`] on an opening
/// connection, [`PEER_IDLE_MAX`] on a member's, its body within [`PEER_BODY_TIMEOUT`].
/// `Ok(None)` when the connection is to be closed quietly (closed by the peer, or idle).
async fn read_request(
    stream: &mut PeerStream,
    slot: &Slot,
) -> std::io::Result<Option<PeerRequest>> {
    let idle_max = if slot.is_member() {
        PEER_IDLE_MAX
    } else {
        PEER_OPENING_TIMEOUT
    };
    let Ok(len) = tokio::time::timeout(idle_max, read_len(stream)).await else {
        return Ok(None);
    };
    let Some(len) = len? else {
        return Ok(None);
    };
    slot.talked();
    let budget = Some((&slot.slots.budget, slot.is_member()));
    match tokio::time::timeout(PEER_BODY_TIMEOUT, read_body(stream, len, budget)).await {
        Ok(body) => body.map(Some),
        Err(_) => Err(timed_out(format!(
            "a {len}-byte peer frame took over {PEER_BODY_TIMEOUT:?}"
        ))),
    }
}

/// How long the TLS handshake of a peer connection may take.
pub const PEER_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection's stream once opened: the TLS handshake done if the node has peer TLS (then
/// with the node id the client's certificate names), the TCP stream as it is if not.
///
/// # Errors
/// The handshake failed or took over [`PEER_HANDSHAKE_TIMEOUT`]: no certificate, one the
/// cluster's CA did not sign, one naming no node.
async fn open_stream(
    tcp: TcpStream,
    service: &PeerService,
    slot: &Slot,
) -> Result<(PeerStream, Option<NodeId>), Refused> {
    let Some(tls) = service.dialer.tls() else {
        return Ok((Box::new(tcp), None));
    };
    let handshake = async {
        // A peer that has sent its hello is not silent: under a flood, the handshake of a
        // member's connection must not be the one that makes way.
        if tcp.peek(&mut [0u8; 1]).await.is_ok_and(|n| n > 0) {
            slot.talked();
        }
        tls.accept(tcp).await
    };
    match tokio::time::timeout(PEER_HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok((stream, id))) => Ok((Box::new(stream), Some(id))),
        Ok(Err(why)) => Err(Refused(why)),
        Err(_) => Err(Refused(format!(
            "peer TLS handshake took over {PEER_HANDSHAKE_TIMEOUT:?}"
        ))),
    }
}

/// An accepted connection opened: the TLS handshake ([`open_stream`]) and the cluster ids'
/// exchange ([`open_cluster`]); `None` if either refused it (logged).
async fn open_conn(
    tcp: TcpStream,
    service: &PeerService,
    slot: Slot,
) -> Option<(PeerStream, Conn)> {
    let peer = tcp.peer_addr().map_or("?".to_string(), |a| a.to_string());
    let (stream, sender) = match open_stream(tcp, service, &slot).await {
        Ok(opened) => opened,
        Err(why) => {
            service.refusals.refused(now_ms(), &peer, &why);
            return None;
        }
    };
    // Refusals here are logged by the cluster id's own log.
    let (stream, cluster) = open_cluster(stream, service, &slot, &peer).await.ok()?;
    let conn = Conn {
        peer,
        slot,
        sender,
        cluster,
    };
    Some((stream, conn))
}

/// The cluster ids' exchange on an opened connection, within [`PEER_OPENING_TIMEOUT`]:
/// the stream and the id the dialer said.
async fn open_cluster(
    mut stream: PeerStream,
    service: &PeerService,
    slot: &Slot,
    peer: &str,
) -> Result<(PeerStream, Option<u128>), Refused> {
    let ids = service.dialer.cluster_id();
    let exchange = cluster_id::answer(&mut stream, ids, peer);
    match tokio::time::timeout(PEER_OPENING_TIMEOUT, exchange).await {
        Ok(Ok(cluster)) => {
            slot.talked();
            Ok((stream, cluster))
        }
        Ok(Err(why)) => Err(why),
        Err(_) => Err(Refused("no opening in time".into())),
    }
}

/// One served peer connection: where it comes from, its slot, and the node it speaks for.
struct Conn {
    /// The remote address, for the log.
    peer: String,
    slot: Slot,
    /// The node the connection's certificate names (peer TLS), or else its first Raft
    /// frame: every Raft frame on it must be from that node (a node sends its own votes and
    /// appends on its connections, nobody else's).
    sender: Option<NodeId>,
    /// The cluster id its opening said: its Raft frames are admitted by it.
    cluster: Option<u128>,
}

async fn serve_peer(
    mut stream: PeerStream,
    mut conn: Conn,
    raft: Raft,
    isolated: Arc<AtomicBool>,
    service: PeerService,
) -> std::io::Result<()> {
    loop {
        // An idle connection is closed: the nodes' own pooled connections are used every
        // heartbeat or reconnect once, and a silent stranger must not hold a slot.
        let Some(request) = read_request(&mut stream, &conn.slot).await? else {
            return Ok(());
        };
        if isolated.load(Ordering::Relaxed) {
            return Ok(());
        }
        let slot = &mut conn.slot;
        let admitted = admit(&request, &raft, &service, &mut conn.sender)
            .and_then(|member| admit_cluster(&request, &service, conn.cluster).map(|()| member))
            .and_then(|member| match member {
                Some(member) if !slot.is_member() => slot.promote(member),
                _ => Ok(()),
            });
        if let Err(why) = admitted {
            service.refusals.refused(now_ms(), &conn.peer, &why);
            return Ok(());
        }
        let reply = answer(request, &raft, &service).await?;
        write_frame(&mut stream, &reply).await?;
    }
}

/// Milliseconds since the Unix epoch, for the refusal log's rate limit.
fn now_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| d.as_millis() as u64)
}

/// Checks `request` ([`peer_check`]) and that it comes from the connection's `sender`, whom
/// the first Raft frame sets; returns the sender if it is a member (or this node has no
/// membership yet).
fn admit(
    request: &PeerRequest,
    raft: &Raft,
    service: &PeerService,
    sender: &mut Option<NodeId>,
) -> Result<Option<NodeId>, Refused> {
    let known = Known::from_metrics(&raft.metrics().borrow());
    let from = peer_check::check_request(request, &known)?;
    match (from, *sender) {
        (Some(from), Some(before)) if from != before => {
            let why = format!("a frame from node {from} on node {before}'s connection");
            return Err(Refused(why));
        }
        (Some(from), None) => *sender = Some(from),
        _ => {}
    }
    if let PeerRequest::Snapshot(rpc) = request {
        let id = &rpc.meta.snapshot_id;
        service
            .snapshots
            .admit(id, rpc.offset, &rpc.data, rpc.done)?;
    }
    let member = |id: &NodeId| known.members.is_empty() || known.members.contains(id);
    Ok(from.filter(member))
}

/// Whether `request` may come on a connection whose opening said `cluster`: a Raft frame
/// only of this node's cluster ([`ClusterId::admit_raft`], which a fresh node joins by);
/// probes and the initialisation (whose sender has no id yet) from any.
fn admit_cluster(
    request: &PeerRequest,
    service: &PeerService,
    cluster: Option<u128>,
) -> Result<(), Refused> {
    match request {
        PeerRequest::Probe | PeerRequest::Bootstrap | PeerRequest::Initialize(_) => Ok(()),
        PeerRequest::Vote(_)
        | PeerRequest::Append(_)
        | PeerRequest::Snapshot(_)
        | PeerRequest::PreVote(_) => service.dialer.cluster_id().admit_raft(cluster),
    }
}

/// What this node answers to `request`; `Err` to close the connection unanswered.
async fn answer(
    request: PeerRequest,
    raft: &Raft,
    service: &PeerService,
) -> std::io::Result<PeerReply> {
    Ok(match request {
        // Unanswered while the guard is up: the candidate counts this node unreachable.
        PeerRequest::Vote(_) if service.catch_up.refuses_votes() => {
            return Err(std::io::Error::other("vote guard up"));
        }
        PeerRequest::Vote(rpc) => PeerReply::Vote(raft.vote(rpc).await),
        // As a vote: a node catching up must not help anyone stand.
        PeerRequest::PreVote(_) if service.catch_up.refuses_votes() => {
            return Err(std::io::Error::other("vote guard up"));
        }
        PeerRequest::PreVote(rpc) => PeerReply::PreVote(service.prevote.answer(raft, &rpc).await),
        PeerRequest::Append(rpc) => {
            service.catch_up.note_append(&rpc);
            let (arrived, heartbeat) = (service.appends.arrived(), rpc.entries.is_empty());
            let reply = raft.append_entries(rpc).await;
            service.appends.answered(arrived, heartbeat);
            PeerReply::Append(reply)
        }
        PeerRequest::Snapshot(rpc) => PeerReply::Snapshot(raft.install_snapshot(rpc).await),
        PeerRequest::Initialize(members) => {
            let result = super::bootstrap::initialize(raft, service, members).await;
            PeerReply::Initialize(result)
        }
        PeerRequest::Probe => {
            PeerReply::Probe(raft.is_initialized().await.map_err(|e| e.to_string()))
        }
        PeerRequest::Bootstrap => {
            let fresh = raft.is_initialized().await.map_err(|e| e.to_string());
            if fresh == Ok(false) {
                service
                    .catch_up
                    .lift(raft, "a new cluster is being initialised");
            }
            PeerReply::Bootstrap(fresh)
        }
    })
}

/// Most connections the peer port serves at once: the members' (at most
/// [`PEER_CONNECTIONS_PER_NODE_MAX`] each, and a cluster has at most 9 members) and the
/// opening ones ([`PEER_OPENING_MAX`]).
pub const PEER_CONNECTIONS_MAX: usize = 256;
/// A member's connection that sends no request for this long is closed.
pub const PEER_IDLE_MAX: Duration = Duration::from_secs(60);

/// Most idle connections kept per peer for later calls.
const IDLE_PER_PEER_MAX: usize = 4;

/// Idle connections by peer (id and address), shared by every [`PeerClient`] of a node.
type Idle = Arc<Mutex<HashMap<(NodeId, String), Vec<PeerStream>>>>;

/// Makes a [`PeerClient`] per peer openraft talks to. openraft makes a client per
/// replication stream and per election, and one per peer for every confirmation round
/// (`ensure_linearizable`), so connections are pooled: a client takes an idle one and gives
/// it back when it is done, if its last exchange completed.
#[derive(Clone, Default)]
pub struct PeerNetwork {
    idle: Idle,
    isolated: Arc<AtomicBool>,
    dialer: Dialer,
}

impl PeerNetwork {
    /// A network whose calls all fail (unreachable) while `isolated` is set: a partition of
    /// this node, for tests and fault drills. Connections are made by `dialer`.
    pub fn new(isolated: Arc<AtomicBool>, dialer: Dialer) -> PeerNetwork {
        PeerNetwork {
            idle: Idle::default(),
            isolated,
            dialer,
        }
    }
}

impl PeerNetwork {
    /// Asks node `target` (at `node`) for a pre-vote within `ttl`, on a pooled connection,
    /// as openraft's calls are (an isolated node reaches nobody).
    ///
    /// # Errors
    /// When the node could not be reached or answered something else in time.
    pub async fn ask_pre_vote(
        &mut self,
        target: NodeId,
        node: &NodeInfo,
        request: PreVoteRequest,
        ttl: Duration,
    ) -> Result<PreVoteReply, String> {
        let mut client = self.new_client(target, node).await;
        match client.call(PeerRequest::PreVote(request), ttl).await {
            Ok(PeerReply::PreVote(reply)) => Ok(reply),
            Ok(_) => Err("the peer answered a different request".to_string()),
            Err(CallError::Unreachable(e) | CallError::Network(e)) => Err(e.to_string()),
        }
    }
}

impl RaftNetworkFactory<TypeConfig> for PeerNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &NodeInfo) -> PeerClient {
        let peer = (target, node.peer_addr.clone());
        let stream = self
            .idle
            .lock()
            .expect("poisoned")
            .get_mut(&peer)
            .and_then(Vec::pop);
        PeerClient {
            peer,
            stream,
            idle: Arc::clone(&self.idle),
            isolated: Arc::clone(&self.isolated),
            dialer: self.dialer.clone(),
        }
    }
}

/// One peer, as the caller sees it: its id and address, and a connection to it whose last
/// exchange completed (a connection is never used after one that did not: a reply to an
/// abandoned request could still arrive on it).
pub struct PeerClient {
    peer: (NodeId, String),
    stream: Option<PeerStream>,
    idle: Idle,
    isolated: Arc<AtomicBool>,
    dialer: Dialer,
}

impl Drop for PeerClient {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take() {
            let mut idle = self.idle.lock().expect("poisoned");
            let kept = idle.entry(self.peer.clone()).or_default();
            if kept.len() < IDLE_PER_PEER_MAX {
                kept.push(stream);
            }
        }
    }
}

/// Why a call failed before the peer answered.
enum CallError {
    /// No connection could be made.
    Unreachable(std::io::Error),
    /// The connection failed or the time ran out mid-call.
    Network(std::io::Error),
}

impl CallError {
    fn into_rpc<E: std::error::Error>(self) -> RPCError<NodeId, NodeInfo, E> {
        match self {
            CallError::Unreachable(e) => RPCError::Unreachable(Unreachable::new(&e)),
            CallError::Network(e) => RPCError::Network(NetworkError::new(&e)),
        }
    }
}

/// Connects to `addr`, from `source` (any port) when given.
async fn connect_from(source: Option<IpAddr>, addr: &str) -> std::io::Result<TcpStream> {
    let Some(source) = source else {
        return TcpStream::connect(addr).await;
    };
    let mut last = None;
    for target in tokio::net::lookup_host(addr).await? {
        if target.is_ipv4() != source.is_ipv4() {
            continue;
        }
        let socket = if source.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.bind(SocketAddr::new(source, 0))?;
        match socket.connect(target).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        let why = format!("{addr} has no address of the peer listener's family ({source})");
        std::io::Error::new(std::io::ErrorKind::InvalidInput, why)
    }))
}

fn timed_out(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, what)
}

impl PeerClient {
    async fn connect(&self, deadline: tokio::time::Instant) -> Result<PeerStream, CallError> {
        let limit = tokio::time::Instant::now() + CONNECT_TIMEOUT;
        let connect = self.dialer.dial(self.peer.0, &self.peer.1);
        match tokio::time::timeout_at(limit.min(deadline), connect).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(CallError::Unreachable(e)),
            Err(_) => Err(CallError::Unreachable(timed_out(
                "connect timed out".into(),
            ))),
        }
    }

    /// Sends `request` and reads the reply, within `ttl`. A pooled connection that fails is
    /// replaced once by a new one (the peer may have restarted since; Raft's messages may be
    /// delivered twice).
    async fn call(&mut self, request: PeerRequest, ttl: Duration) -> Result<PeerReply, CallError> {
        if self.isolated.load(Ordering::Relaxed) {
            let e = std::io::Error::other("this node is isolated from its peers");
            return Err(CallError::Unreachable(e));
        }
        let deadline = tokio::time::Instant::now() + ttl;
        let sent_term = peer_check::request_term(&request);
        let frame = encode_frame(&request).map_err(CallError::Network)?;
        let pooled = self.stream.take();
        let was_pooled = pooled.is_some();
        let mut stream = match pooled {
            Some(stream) => stream,
            None => self.connect(deadline).await?,
        };
        let mut result = self
            .exchange(&mut stream, &frame, sent_term, deadline)
            .await;
        if result.is_err() && was_pooled && tokio::time::Instant::now() < deadline {
            stream = self.connect(deadline).await?;
            result = self
                .exchange(&mut stream, &frame, sent_term, deadline)
                .await;
        }
        let reply = result.map_err(CallError::Network)?;
        self.stream = Some(stream);
        Ok(reply)
    }

    async fn exchange(
        &self,
        stream: &mut PeerStream,
        frame: &[u8],
        sent_term: Option<u64>,
        deadline: tokio::time::Instant,
    ) -> std::io::Result<PeerReply> {
        let exchange = async {
            stream.write_all(frame).await?;
            let reply = read_frame::<PeerReply>(stream)
                .await?
                .ok_or_else(|| std::io::Error::other("peer closed the connection"))?;
            // A reply out of bounds (a term past TERM_MAX, say) is as good as none.
            peer_check::check_reply(&reply, sent_term).map_err(std::io::Error::other)?;
            Ok(reply)
        };
        match tokio::time::timeout_at(deadline, exchange).await {
            Ok(result) => result,
            Err(_) => Err(timed_out(format!("no answer from node {}", self.peer.0))),
        }
    }

    fn unexpected<E: std::error::Error>(&self) -> RPCError<NodeId, NodeInfo, E> {
        let e = std::io::Error::other("peer answered a different request");
        RPCError::Network(NetworkError::new(&e))
    }
}

/// First pause before openraft retries a peer it could not reach; doubled per failure up to
/// [`RETRY_PAUSE_MAX`]. openraft's own default is a constant 500 ms: a follower back from a
/// restart then waits up to half a second for the log it missed, and if the leader dies in
/// that window the lagging node campaigns in vain, term after term, and slows the
/// fail-over (seen in the fail-over benchmark).
const RETRY_PAUSE_MIN: Duration = Duration::from_millis(25);
/// See [`RETRY_PAUSE_MIN`]: a dead peer costs a refused connection every 100 ms per
/// replication stream, which is little.
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(100);

impl RaftNetwork<TypeConfig> for PeerClient {
    fn backoff(&self) -> openraft::network::Backoff {
        let pauses = std::iter::successors(Some(RETRY_PAUSE_MIN), |pause| {
            Some((*pause * 2).min(RETRY_PAUSE_MAX))
        });
        openraft::network::Backoff::new(pauses)
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId>>> {
        match self.call(PeerRequest::Append(rpc), option.hard_ttl()).await {
            Ok(PeerReply::Append(Ok(reply))) => Ok(reply),
            Ok(PeerReply::Append(Err(e))) => Err(RemoteError::new(self.peer.0, e).into()),
            Ok(_) => Err(self.unexpected()),
            Err(e) => Err(e.into_rpc()),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, NodeInfo, RaftError<NodeId, InstallSnapshotError>>,
    > {
        match self
            .call(PeerRequest::Snapshot(rpc), option.hard_ttl())
            .await
        {
            Ok(PeerReply::Snapshot(Ok(reply))) => Ok(reply),
            Ok(PeerReply::Snapshot(Err(e))) => Err(RemoteError::new(self.peer.0, e).into()),
            Ok(_) => Err(self.unexpected()),
            Err(e) => Err(e.into_rpc()),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, NodeInfo, RaftError<NodeId>>> {
        match self.call(PeerRequest::Vote(rpc), option.hard_ttl()).await {
            Ok(PeerReply::Vote(Ok(reply))) => Ok(reply),
            Ok(PeerReply::Vote(Err(e))) => Err(RemoteError::new(self.peer.0, e).into()),
            Ok(_) => Err(self.unexpected()),
            Err(e) => Err(e.into_rpc()),
        }
    }
}

/// How long [`probe_remote`] waits for the node's answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Asks node `id`, whose peer port is `peer_addr`, whether it is initialised (has a log or
/// a vote), for `--initial-cluster`'s bootstrap; dialled as Raft's connections are.
///
/// # Errors
/// When the node cannot be reached, or did not answer within [`PROBE_TIMEOUT`].
pub async fn probe_remote(dialer: &Dialer, id: NodeId, peer_addr: &str) -> Result<bool, String> {
    ask_initialised(dialer, id, peer_addr, PeerRequest::Probe).await
}

/// As [`probe_remote`], and a fresh node lifts its vote guard for the first election
/// ([`PeerRequest::Bootstrap`]).
///
/// # Errors
/// As [`probe_remote`].
pub async fn bootstrap_remote(
    dialer: &Dialer,
    id: NodeId,
    peer_addr: &str,
) -> Result<bool, String> {
    ask_initialised(dialer, id, peer_addr, PeerRequest::Bootstrap).await
}

async fn ask_initialised(
    dialer: &Dialer,
    id: NodeId,
    peer_addr: &str,
    request: PeerRequest,
) -> Result<bool, String> {
    let ask = async {
        let mut stream = dialer
            .dial(id, peer_addr)
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        write_frame(&mut stream, &request)
            .await
            .map_err(|e| format!("cannot send: {e}"))?;
        match read_frame::<PeerReply>(&mut stream).await {
            Ok(Some(PeerReply::Probe(result) | PeerReply::Bootstrap(result))) => result,
            // A node of a version without the probe closes the connection on it.
            Ok(_) => Err("no answer to the probe".to_string()),
            Err(e) => Err(format!("no answer: {e}")),
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, ask)
        .await
        .unwrap_or_else(|_| Err(format!("no answer in {PROBE_TIMEOUT:?}")))
}

/// How long `initialize_remote` waits for the node's answer.
const INITIALIZE_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks the node whose peer port is `peer_addr` to make `members` the cluster's first
/// membership (what `tenured cluster-init` sends), dialled by `dialer` (with peer TLS, the
/// node's certificate must name a member: `dial_member`).
///
/// # Errors
/// When the node cannot be reached or answered in time, or refused (it is initialised
/// already, or is not among `members`); with peer TLS, when its certificate names no
/// member.
pub async fn initialize_remote(
    dialer: &Dialer,
    peer_addr: &str,
    members: BTreeMap<NodeId, NodeInfo>,
) -> Result<(), String> {
    let ask = async {
        let mut stream = dial_member(dialer, peer_addr, &members).await?;
        write_frame(&mut stream, &PeerRequest::Initialize(members))
            .await
            .map_err(|e| format!("cannot send to {peer_addr}: {e}"))?;
        match read_frame::<PeerReply>(&mut stream).await {
            Ok(Some(PeerReply::Initialize(result))) => result,
            Ok(_) => Err(format!("{peer_addr} gave no answer to the initialisation")),
            Err(e) => Err(format!("no answer from {peer_addr}: {e}")),
        }
    };
    tokio::time::timeout(INITIALIZE_TIMEOUT, ask)
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "no answer from {peer_addr} in {INITIALIZE_TIMEOUT:?}"
            ))
        })
}

/// Connects to `peer_addr` for `initialize_remote`. With peer TLS the node's certificate
/// must name a member: the one at `peer_addr` if a member is listed there, else any (the
/// operator may reach a node at another address than the membership's, through a proxy
/// say), tried one after another. Without TLS nothing checks whom the address reaches (the
/// node itself refuses if it is not among the members).
async fn dial_member(
    dialer: &Dialer,
    peer_addr: &str,
    members: &BTreeMap<NodeId, NodeInfo>,
) -> Result<PeerStream, String> {
    let listed = members.iter().find(|(_, info)| info.peer_addr == peer_addr);
    let ids: Vec<NodeId> = match (listed, dialer.tls()) {
        (Some((id, _)), _) => vec![*id],
        (None, None) => vec![0],
        (None, Some(_)) => members.keys().copied().collect(),
    };
    let mut why = String::new();
    for id in ids {
        match dialer.dial(id, peer_addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => why = format!("cannot connect to {peer_addr}: {e}"),
        }
    }
    Err(why)
}

/// Parses a membership as `tenured cluster-init --nodes` and `--initial-cluster` take it:
/// `1=<peer addr>/<client addr>,2=...`, checked as INIT checks it
/// ([`tenure_protocol::cluster::parse_members`]).
///
/// # Errors
/// A member that does not have that shape (ids from 1, `host:port` addresses), an id given
/// twice, or an address shared by two nodes.
pub fn parse_members(spec: &str) -> Result<BTreeMap<NodeId, NodeInfo>, String> {
    let members = tenure_protocol::cluster::parse_members(spec).map_err(|e| e.message)?;
    Ok(members
        .into_iter()
        .map(|m| {
            let info = NodeInfo {
                peer_addr: m.peer_addr,
                client_addr: m.client_addr,
            };
            (m.id, info)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_parse_and_bad_ones_are_named() {
        let members = parse_members("1=127.0.0.1:7001/127.0.0.1:7878, 2=h:1/h:2").unwrap();
        assert_eq!(members.len(), 2);
        assert_eq!(members[&1].peer_addr, "127.0.0.1:7001");
        assert_eq!(members[&2].client_addr, "h:2");
        for bad in [
            "",
            "1=a",
            "x=a:1/b:2",
            "1=/b:2",
            "1=a:1/b:2,1=c:3/d:4",
            "0=a:1/b:2",
        ] {
            assert!(parse_members(bad).is_err(), "{bad:?}");
        }
    }

    /// Opening slots: a newcomer always gets one, the oldest silent connection gives way
    /// (one that sent a length only when all have), a member's connection never does, and a
    /// member has at most its own share.
    #[test]
    fn opening_slots_make_way_for_newcomers_and_members_keep_theirs() {
        let slots = Arc::new(Slots::default());
        let mut opened: Vec<(Slot, CancellationToken)> =
            (0..PEER_OPENING_MAX).map(|_| Slots::open(&slots)).collect();
        opened[0].0.talked();
        opened[2].0.promote(7).unwrap();
        let _filler = Slots::open(&slots);
        assert!(
            opened.iter().all(|(_, gone)| !gone.is_cancelled()),
            "a slot was free"
        );
        let _newcomer = Slots::open(&slots);
        assert!(!opened[0].1.is_cancelled(), "it had sent a length");
        assert!(
            opened[1].1.is_cancelled(),
            "the oldest silent one gives way"
        );
        let _another = Slots::open(&slots);
        assert!(!opened[2].1.is_cancelled(), "a member's connection stays");
        assert!(opened[3].1.is_cancelled());
        assert_eq!(slots.lock().opening.len(), PEER_OPENING_MAX);

        let talking = Arc::new(Slots::default());
        let all: Vec<(Slot, CancellationToken)> = (0..PEER_OPENING_MAX)
            .map(|_| Slots::open(&talking))
            .collect();
        all.iter().for_each(|(slot, _)| slot.talked());
        let _last = Slots::open(&talking);
        assert!(all[0].1.is_cancelled(), "once none is silent, the oldest");
        assert!(all[1..].iter().all(|(_, gone)| !gone.is_cancelled()));

        let mut members: Vec<Slot> = Vec::new();
        for _ in 1..PEER_CONNECTIONS_PER_NODE_MAX {
            let (mut slot, _) = Slots::open(&slots);
            slot.promote(7).unwrap();
            members.push(slot);
        }
        let (mut over, _) = Slots::open(&slots);
        assert!(over.promote(7).is_err(), "past node 7's share");
        over.promote(8).unwrap();
        drop(members.pop());
        over = Slots::open(&slots).0;
        over.promote(7).unwrap();
        drop((over, members, opened));
        let inner = slots.lock();
        assert!(inner.members.is_empty() && inner.opening.len() <= PEER_OPENING_MAX);
    }

    /// A frame announced at the largest length holds a buffer of about what was sent, taken
    /// from the budget; opening connections share their part of it and are refused past
    /// it, while members keep the rest and wait for room rather than fail.
    #[tokio::test]
    async fn frame_buffers_follow_bytes_sent_within_the_budget() {
        let budget = Arc::new(FrameBudget::default());
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let reading = Arc::clone(&budget);
        let reader = tokio::spawn(async move {
            read_body::<Vec<u8>>(&mut b, FRAME_LEN_MAX, Some((&reading, false))).await
        });
        a.write_all(&[7u8; 1 << 20]).await.unwrap();
        while budget.held() < 1 << 20 {
            tokio::task::yield_now().await;
        }
        assert!(budget.held() <= 2 << 20, "held {}", budget.held());
        drop(a);
        assert!(reader.await.unwrap().is_err(), "the frame was cut short");
        assert_eq!(budget.held(), 0, "given back");

        let openings = budget
            .take(PEER_OPENING_PENDING_BYTES_MAX, false)
            .await
            .unwrap();
        assert!(
            budget.take(1, false).await.is_err(),
            "the openings' part is spent"
        );
        let members = [
            budget.take(FRAME_LEN_MAX, true).await.unwrap(),
            budget.take(FRAME_LEN_MAX, true).await.unwrap(),
        ];
        let rest = PEER_PENDING_BYTES_MAX - budget.held();
        let full = budget.take(rest, true).await.unwrap();
        let waiting = budget.take(1, true);
        tokio::pin!(waiting);
        let wait = Duration::from_millis(50);
        assert!(
            tokio::time::timeout(wait, &mut waiting).await.is_err(),
            "it waits"
        );
        drop(full);
        let _room = waiting.await.unwrap();
        drop((openings, members));
    }

    #[tokio::test]
    async fn frames_round_trip_and_oversized_lengths_are_refused() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, &vec![1u32, 2, 3]).await.unwrap();
        let got: Option<Vec<u32>> = read_frame(&mut b).await.unwrap();
        assert_eq!(got, Some(vec![1, 2, 3]));
        a.write_all(&((FRAME_LEN_MAX + 1) as u32).to_be_bytes())
            .await
            .unwrap();
        let refused = read_frame::<Vec<u32>>(&mut b).await.unwrap_err();
        assert!(refused.to_string().contains("FRAME_LEN_MAX"), "{refused}");
        drop(a);
        assert!(read_frame::<Vec<u32>>(&mut b).await.unwrap().is_none());
    }
}
