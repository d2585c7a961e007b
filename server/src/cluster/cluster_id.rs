//! The cluster id and the opening of every peer connection that carries it.
//!
//! A cluster gets a random 128-bit id when it is initialised (`tenured cluster-init`,
//! CLUSTER INIT, `--initial-cluster`: [`ClusterId::mint`], on the node that initialises,
//! just before openraft does). It is stored beside the Raft log, in [`ID_FILE`] (written
//! atomically and synced), so it survives restarts. Every other node learns it from the
//! first Raft frame a member sends it ([`ClusterId::admit_raft`]): the initialising node's
//! vote request, or the leader's first append to a node added later or wiped.
//!
//! Every peer connection opens with an exchange of [`OPENING_LEN`] bytes each way, before
//! any frame: the dialer says its cluster id ([`greet`]), the acceptor checks it and answers
//! with its own ([`answer`]), and the dialer checks that. Two different ids end the
//! connection on both sides, logged and counted ([`ClusterId::refused`]): nodes of two
//! clusters never mix, even at reused addresses and with certificates from one CA. A side
//! that has no id yet (a fresh node, `tenured cluster-init`) passes the opening, but a
//! node that has an id takes no Raft frame from a connection that said none, and a fresh
//! node takes the id of the first connection that sends it a Raft frame, and from then on
//! only that one. What keeps a stranger from being that first connection is peer TLS (only
//! holders of a cluster certificate reach the peer port at all); on loopback without peer
//! TLS, any local process that reaches a fresh node's peer port before its cluster does
//! can claim it (CLUSTER.md says so).
//!
//! The opening starts with [`MAGIC`], which read as a frame length is over
//! `FRAME_LEN_MAX`: a node of an earlier version closes such a connection at once, and
//! this one refuses a connection that starts with a frame, so versions with and without
//! the opening never talk (a cluster is upgraded all at once).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::peer_check::{RefusalLog, Refused};

/// The file, in the data directory, that holds the cluster id.
pub const ID_FILE: &str = "cluster.id";
/// What the opening starts with: `TNRC`, as a frame length 1.4 GB, over any frame's cap.
pub const MAGIC: [u8; 4] = *b"TNRC";
/// The opening's version: a later one may add fields after these.
const OPENING_VERSION: u8 = 1;
/// Bytes of the opening, each way: magic, version, whether an id follows, the id.
pub const OPENING_LEN: usize = MAGIC.len() + 2 + 16;
/// What the file holds before the id's hex digits.
const FILE_PREFIX: &str = "tenure-cluster-id v1 ";

const _: () = assert!(
    u32::from_be_bytes(MAGIC) as usize > super::network::FRAME_LEN_MAX,
    "the opening must not read as a frame length an earlier node would accept"
);

/// A node's cluster id (none until it is initialised or learns it), where it is stored,
/// and the connections refused for another cluster's.
#[derive(Debug, Default)]
pub struct ClusterId {
    /// The data directory; `None` for a node's stand-in that stores nothing (`tenured
    /// cluster-init`).
    dir: Option<PathBuf>,
    id: Mutex<Option<u128>>,
    refused: AtomicU64,
    log: RefusalLog,
}

impl ClusterId {
    /// Reads the id stored in `dir`, if any.
    ///
    /// # Errors
    /// When the file exists but cannot be read or is not an id this version wrote.
    pub fn open(dir: &Path) -> std::io::Result<ClusterId> {
        let path = dir.join(ID_FILE);
        let id = match std::fs::read_to_string(&path) {
            Ok(text) => Some(parse_file(&text).ok_or_else(|| {
                let why = format!("{} holds no cluster id", path.display());
                std::io::Error::new(std::io::ErrorKind::InvalidData, why)
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        Ok(ClusterId {
            dir: Some(dir.to_path_buf()),
            id: Mutex::new(id),
            ..ClusterId::default()
        })
    }

    /// A stand-in that stores nothing and holds `id`: what a dialer that belongs to no
    /// node (or a test's forged peer) says.
    pub fn unstored(id: Option<u128>) -> ClusterId {
        ClusterId {
            id: Mutex::new(id),
            ..ClusterId::default()
        }
    }

    /// The id, if this node has one.
    pub fn get(&self) -> Option<u128> {
        *self.lock()
    }

    /// Connections refused because their opening named another cluster (or a Raft frame
    /// came on one that named none), either side.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// The id this node initialises a cluster with: the one it has, or a new random one,
    /// stored before it is used.
    ///
    /// # Errors
    /// When it cannot be stored.
    pub fn mint(&self) -> std::io::Result<u128> {
        let mut id = self.lock();
        if let Some(id) = *id {
            return Ok(id);
        }
        let new: u128 = rand::random();
        self.store(new)?;
        *id = Some(new);
        tracing::info!(cluster_id = %hex(new), "made the cluster id");
        Ok(new)
    }

    /// Whether a Raft frame may come on a connection whose opening said `claimed`: the
    /// same id as this node's, or, on a node that has none yet, any id, which it takes
    /// (stored before the frame is handled: once per node's life, so written in place).
    ///
    /// # Errors
    /// Another id, or none on a node that has one; or the id could not be stored.
    pub fn admit_raft(&self, claimed: Option<u128>) -> Result<(), Refused> {
        let mut id = self.lock();
        match (*id, claimed) {
            (Some(mine), Some(theirs)) if mine == theirs => Ok(()),
            (None, None) => Ok(()),
            (None, Some(theirs)) => {
                self.store(theirs)
                    .map_err(|e| Refused(format!("cannot store the cluster id: {e}")))?;
                *id = Some(theirs);
                tracing::info!(cluster_id = %hex(theirs), "joined the cluster: took its id");
                Ok(())
            }
            (Some(mine), theirs) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                Err(mismatch(Some(mine), theirs))
            }
        }
    }

    fn store(&self, id: u128) -> std::io::Result<()> {
        match &self.dir {
            Some(dir) => super::log_store::write_atomically(
                dir,
                ID_FILE,
                format!("{FILE_PREFIX}{}\n", hex(id)).as_bytes(),
            ),
            None => Ok(()),
        }
    }

    /// Counts and logs (rate-limited) a refused opening.
    fn refuse(&self, peer: &str, why: Refused) -> Refused {
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.log.refused(now_ms(), peer, &why);
        why
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<u128>> {
        self.id.lock().expect("cluster id poisoned")
    }
}

/// Whether `error` (from [`greet`], through a dial) says the other side is of another
/// cluster, rather than that it could not be reached.
pub fn is_refusal(error: &std::io::Error) -> bool {
    error
        .get_ref()
        .is_some_and(|inner| inner.downcast_ref::<Refused>().is_some())
}

/// An id as it is logged and stored: 32 hex digits.
pub fn hex(id: u128) -> String {
    format!("{id:032x}")
}

fn parse_file(text: &str) -> Option<u128> {
    let digits = text.strip_prefix(FILE_PREFIX)?.trim_end();
    (digits.len() == 32)
        .then(|| u128::from_str_radix(digits, 16).ok())
        .flatten()
}

fn mismatch(mine: Option<u128>, theirs: Option<u128>) -> Refused {
    let name = |id: Option<u128>| id.map_or("none".to_string(), hex);
    Refused(format!(
        "the connection is of cluster {}, this node is of cluster {}",
        name(theirs),
        name(mine)
    ))
}

/// The opening that says `id`.
pub fn encode(id: Option<u128>) -> [u8; OPENING_LEN] {
    let mut bytes = [0u8; OPENING_LEN];
    bytes[..4].copy_from_slice(&MAGIC);
    bytes[4] = OPENING_VERSION;
    if let Some(id) = id {
        bytes[5] = 1;
        bytes[6..].copy_from_slice(&id.to_be_bytes());
    }
    bytes
}

/// The id an opening says.
///
/// # Errors
/// Not an opening: another magic (a frame, say), version or flag, or an id with the flag
/// clear.
pub fn decode(bytes: &[u8; OPENING_LEN]) -> Result<Option<u128>, Refused> {
    if bytes[..4] != MAGIC || bytes[4] != OPENING_VERSION {
        return Err(Refused(
            "the connection did not open with a cluster id (a node of an earlier version?)".into(),
        ));
    }
    let id = u128::from_be_bytes(bytes[6..].try_into().expect("16 bytes"));
    match bytes[5] {
        0 if id == 0 => Ok(None),
        1 => Ok(Some(id)),
        _ => Err(Refused("a malformed cluster id in the opening".into())),
    }
}

/// Whether the two ends' ids may talk: different only if both have one.
fn compatible(mine: Option<u128>, theirs: Option<u128>) -> bool {
    mine.zip(theirs).is_none_or(|(a, b)| a == b)
}

/// The dialer's side: says this node's id, reads the acceptor's, and checks it.
///
/// # Errors
/// The connection failed, or the acceptor is of another cluster (counted and logged).
pub async fn greet(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    ids: &ClusterId,
    peer: &str,
) -> std::io::Result<Option<u128>> {
    let mine = ids.get();
    stream.write_all(&encode(mine)).await?;
    let reply = read_reply(stream, peer).await?;
    let refused = |why| std::io::Error::other(ids.refuse(peer, why));
    let theirs = decode(&reply).map_err(refused)?;
    if !compatible(mine, theirs) {
        return Err(refused(mismatch(mine, theirs)));
    }
    Ok(theirs)
}

/// The acceptor's side: reads the dialer's opening, answers with this node's id (even when
/// refusing, so that the dialer can say why), and checks it. Returns the id the dialer
/// said, which its Raft frames are admitted by ([`ClusterId::admit_raft`]).
///
/// # Errors
/// The connection failed or did not open with an opening, or the dialer is of another
/// cluster (counted and logged).
pub async fn answer(
    stream: &mut (impl AsyncRead + AsyncWrite + Unpin),
    ids: &ClusterId,
    peer: &str,
) -> Result<Option<u128>, Refused> {
    let mut opening = [0u8; OPENING_LEN];
    let io = |e: std::io::Error| Refused(format!("no opening: {e}"));
    stream.read_exact(&mut opening).await.map_err(io)?;
    let theirs = decode(&opening).map_err(|why| ids.refuse(peer, why))?;
    let mine = ids.get();
    stream.write_all(&encode(mine)).await.map_err(io)?;
    if !compatible(mine, theirs) {
        return Err(ids.refuse(peer, mismatch(mine, theirs)));
    }
    Ok(theirs)
}

/// The acceptor's opening, read by the dialer. A peer port with peer TLS answers a plain
/// opening with a TLS record (an alert) or by closing: said as such, since a dialer without
/// `--peer-tls-*` (`tenured cluster-init`, say) would otherwise report a bare end of file.
async fn read_reply(
    stream: &mut (impl AsyncRead + Unpin),
    peer: &str,
) -> std::io::Result<[u8; OPENING_LEN]> {
    let mut reply = [0u8; OPENING_LEN];
    let mut got = 0;
    while got < OPENING_LEN {
        match stream.read(&mut reply[got..]).await? {
            0 => break,
            n => got += n,
        }
    }
    // A TLS record: content type 21 (alert) or 22 (handshake), then version 3.x.
    if got >= 2 && matches!(reply[0], 0x15 | 0x16) && reply[1] == 0x03 {
        return Err(std::io::Error::other(format!(
            "the peer port at {peer} speaks TLS: give --peer-tls-cert, --peer-tls-key and \
             --peer-tls-ca"
        )));
    }
    if got < OPENING_LEN {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "the peer port at {peer} closed the opening after {got} bytes (a node with \
                 peer TLS closes a plain connection: does it need --peer-tls-*?)"
            ),
        ));
    }
    Ok(reply)
}

/// Milliseconds since the Unix epoch, for the refusal log's rate limit.
fn now_ms() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dialer without peer TLS at a port with it hears a TLS alert (or nothing): it says
    /// the port speaks TLS instead of an end of file.
    #[tokio::test]
    async fn a_tls_answer_to_the_opening_is_named() {
        let ids = ClusterId::default();
        let (mut dialer, mut acceptor) = tokio::io::duplex(1 << 10);
        let alert = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32];
        acceptor.write_all(&alert).await.unwrap();
        acceptor.shutdown().await.unwrap();
        let refused = greet(&mut dialer, &ids, "n1").await.unwrap_err();
        assert!(refused.to_string().contains("speaks TLS"), "{refused}");
        let (mut dialer, mut acceptor) = tokio::io::duplex(1 << 10);
        acceptor.shutdown().await.unwrap();
        let closed = greet(&mut dialer, &ids, "n1").await.unwrap_err();
        drop(acceptor);
        assert!(closed.to_string().contains("--peer-tls"), "{closed}");
    }

    #[test]
    fn openings_round_trip_and_anything_else_is_refused() {
        for id in [None, Some(0), Some(1), Some(u128::MAX)] {
            assert_eq!(decode(&encode(id)), Ok(id));
        }
        let mut frame = encode(Some(7));
        frame[..4].copy_from_slice(&16u32.to_be_bytes());
        assert!(decode(&frame).is_err(), "a frame length is no opening");
        let mut flag = encode(Some(7));
        flag[5] = 2;
        assert!(decode(&flag).is_err());
        let mut stray = encode(None);
        stray[21] = 1;
        assert!(decode(&stray).is_err(), "an id with the flag clear");
        let mut version = encode(None);
        version[4] = 0;
        assert!(decode(&version).is_err());
    }

    /// The id survives a reopening; a fresh node takes the first id a Raft frame brings
    /// and no other after it; a node with an id takes no frame from a connection without.
    #[test]
    fn the_id_is_stored_taken_once_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let fresh = ClusterId::open(dir.path()).unwrap();
        assert_eq!(fresh.get(), None);
        assert!(fresh.admit_raft(None).is_ok(), "neither has one");
        fresh.admit_raft(Some(5)).unwrap();
        assert!(fresh.admit_raft(Some(6)).is_err(), "captured twice");
        assert!(fresh.admit_raft(None).is_err(), "a frame of no cluster");
        assert_eq!(fresh.refused(), 2);
        assert_eq!(fresh.mint().unwrap(), 5, "mint keeps the id it has");
        let reopened = ClusterId::open(dir.path()).unwrap();
        assert_eq!(reopened.get(), Some(5));

        let other = tempfile::tempdir().unwrap();
        let minted = ClusterId::open(other.path()).unwrap().mint().unwrap();
        assert_eq!(ClusterId::open(other.path()).unwrap().get(), Some(minted));
        std::fs::write(other.path().join(ID_FILE), "garbage").unwrap();
        assert!(ClusterId::open(other.path()).is_err());
    }

    #[tokio::test]
    async fn two_clusters_refuse_each_other_both_ways_and_a_fresh_side_passes() {
        for (dialer, acceptor, ok) in [
            (Some(1), Some(1), true),
            (Some(1), Some(2), false),
            (None, Some(2), true),
            (Some(1), None, true),
            (None, None, true),
        ] {
            let (mut a, mut b) = tokio::io::duplex(256);
            let (dialing, accepting) = (ClusterId::unstored(dialer), ClusterId::unstored(acceptor));
            let (greeted, answered) = tokio::join!(
                greet(&mut a, &dialing, "acceptor"),
                answer(&mut b, &accepting, "dialer")
            );
            assert_eq!(greeted.is_ok(), ok, "{dialer:?} to {acceptor:?}");
            assert_eq!(greeted.as_ref().is_err_and(is_refusal), !ok);
            assert_eq!(answered.is_ok(), ok, "{dialer:?} to {acceptor:?}");
            assert_eq!(
                dialing.refused() + accepting.refused(),
                if ok { 0 } else { 2 }
            );
            if ok {
                assert_eq!(greeted.unwrap(), acceptor);
                assert_eq!(answered.unwrap(), dialer);
            }
        }
    }
}
