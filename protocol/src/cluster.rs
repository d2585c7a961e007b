//! Cluster administration on the client port: STATUS, INIT, ADD and REMOVE (PROTOCOL.md 3.8),
//! their bodies and the CLUSTER reply.
//!
//! ```text
//! member (in INIT, ADD and the CLUSTER reply):
//! +--------+-------------------+---------------------+
//! | id u64 | peer_addr bytes16 | client_addr bytes16 |
//! +--------+-------------------+---------------------+
//!
//! CLUSTER reply:
//! +-------------+---------+----------+---------------+---------------------+
//! | node_id u64 | role u8 | term u64 | leader_id u64 | leader_addr bytes16 |
//! +-------------+---------+----------+---------------+---------------------+
//! +--------------------+------------------------+-----------+-------------------------------+
//! | last_log_index u64 | last_applied_index u64 | count u16 | count x (voter u8, member)    |
//! +--------------------+------------------------+-----------+-------------------------------+
//!
//! then, only when CLUSTER_STATUS asked for it (flags bit 0), the extension:
//! +-------------+-----------------------+-----------------+---------------------+--------+
//! | ext_len u16 | identities_digest [8] | trust_digest [8] | last_contact_ms u64 | (more) |
//! +-------------+-----------------------+-----------------+---------------------+--------+
//! ```
//!
//! `ext_len` counts the bytes after it: a later server may append fields, which a reader
//! skips; one shorter than [`STATUS_EXTENSION_LEN`] is refused.

use bytes::{BufMut, BytesMut};

use crate::error::{ErrorCode, FrameError};
use crate::limits::{CLUSTER_ADDR_LEN_MAX, CLUSTER_MEMBERS_MAX};

/// What a node is in its cluster, as openraft says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Not a voter: a learner catching up, or a node not yet initialised (no members).
    Learner = 0,
    /// A voter following a leader.
    Follower = 1,
    /// A voter asking for votes.
    Candidate = 2,
    /// The leader.
    Leader = 3,
    /// Stopping.
    Shutdown = 4,
}

impl Role {
    /// The role for a wire byte, `None` for one this version does not know.
    pub fn from_u8(value: u8) -> Option<Role> {
        [
            Role::Learner,
            Role::Follower,
            Role::Candidate,
            Role::Leader,
            Role::Shutdown,
        ]
        .into_iter()
        .find(|r| *r as u8 == value)
    }

    /// The lower-case word the console and the command line print.
    pub fn name(self) -> &'static str {
        match self {
            Role::Learner => "learner",
            Role::Follower => "follower",
            Role::Candidate => "candidate",
            Role::Leader => "leader",
            Role::Shutdown => "shutdown",
        }
    }
}

/// A node of the membership: its id and where peers and clients reach it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The node's id, at least 1.
    pub id: u64,
    /// Its peer port (Raft traffic), `host:port`.
    pub peer_addr: String,
    /// Its client port, `host:port`.
    pub client_addr: String,
}

/// CLUSTER_STATUS's flags bit asking for the reply's [`StatusExtension`].
pub const STATUS_FLAG_EXTENDED: u8 = 0x01;
/// Bytes of the extension this version writes (and the least it reads), after `ext_len`.
pub const STATUS_EXTENSION_LEN: usize = 8 + 8 + 8;
/// `last_contact_ms` on the wire when the node knows of no contact.
pub const LAST_CONTACT_UNKNOWN: u64 = u64::MAX;

/// A short digest of a node's security files as parsed and in force; all zeros when the
/// file is not configured. Nodes of one cluster should report the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 8]);

impl Digest {
    /// Whether this is the "not configured" digest.
    pub fn is_none(&self) -> bool {
        self.0 == [0; 8]
    }

    /// 16 lowercase hex digits, or `-` when not configured.
    pub fn to_hex(&self) -> String {
        if self.is_none() {
            return "-".to_string();
        }
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What a CLUSTER reply adds when CLUSTER_STATUS asks for it: the digests of the answering
/// node's security configuration, and when it last heard from its cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatusExtension {
    /// Of the identities in force (the `--identities` file as parsed); none without one.
    pub identities_digest: Digest,
    /// Of the client CA certificates in force (`--tls-client-ca`); none without them.
    pub trust_digest: Digest,
    /// Milliseconds since this node last heard its cluster: on the leader, since a quorum
    /// last acknowledged it; on another node, since its last AppendEntries (heartbeats
    /// included). `None` when it never has (or not since it started).
    pub last_contact_ms: Option<u64>,
}

/// A node's own view of its cluster: the CLUSTER reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// The answering node's id.
    pub node_id: u64,
    /// Its role.
    pub role: Role,
    /// Its current Raft term.
    pub term: u64,
    /// The leader it knows of; 0 for none.
    pub leader_id: u64,
    /// The leader's client address; empty for none.
    pub leader_addr: String,
    /// Its last log index (0: an empty log).
    pub last_log_index: u64,
    /// The last index it applied (0: none).
    pub last_applied_index: u64,
    /// The membership it knows of, each with `true` for a voter, `false` for a learner; in
    /// id order. Empty on a node that is not initialised.
    pub members: Vec<(Member, bool)>,
    /// The extension, when CLUSTER_STATUS asked for it (and the server has it); boxed, so
    /// that it does not grow every [`crate::Response`].
    pub extension: Option<Box<StatusExtension>>,
}

fn bad(message: String) -> FrameError {
    FrameError::new(ErrorCode::BadFrame, message)
}

/// Checks a node id: 0 is not one (the CLUSTER reply's `leader_id` uses it for "none").
///
/// # Errors
/// [`ErrorCode::BadArgs`] for id 0.
pub fn validate_id(id: u64) -> Result<(), FrameError> {
    if id == 0 {
        return Err(FrameError::new(
            ErrorCode::BadArgs,
            "node id 0 is not allowed; ids start at 1".into(),
        ));
    }
    Ok(())
}

/// Checks a member against the wire limits.
///
/// # Errors
/// [`ErrorCode::BadArgs`] for id 0, or an address that is empty or over
/// [`CLUSTER_ADDR_LEN_MAX`] bytes.
pub fn validate_member(member: &Member) -> Result<(), FrameError> {
    validate_id(member.id)?;
    for (what, addr) in [("peer", &member.peer_addr), ("client", &member.client_addr)] {
        if addr.is_empty() || addr.len() > CLUSTER_ADDR_LEN_MAX {
            return Err(FrameError::new(
                ErrorCode::BadArgs,
                format!(
                    "node {}: {what} address must be 1 to {CLUSTER_ADDR_LEN_MAX} bytes",
                    member.id
                ),
            ));
        }
        if !is_host_port(addr) {
            // Caught here, not after a 30 s wait for a learner nobody can reach.
            return Err(FrameError::new(
                ErrorCode::BadArgs,
                format!(
                    "node {}: {what} address {addr:?} is not <host>:<port> (port 1-65535)",
                    member.id
                ),
            ));
        }
    }
    Ok(())
}

/// Whether `addr` reads as `host:port`: a host without spaces or slashes (an IPv6 address
/// in brackets), a colon, a port from 1 to 65535.
fn is_host_port(addr: &str) -> bool {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return false;
    };
    let host_ok = !host.is_empty()
        && !host
            .chars()
            .any(|c| c.is_whitespace() || c == '/' || c.is_control());
    host_ok && port.parse::<u16>().is_ok_and(|port| port > 0)
}

/// Refuses a member that would share an address with another node (`others`): the peer
/// port that answers is one node, so a second id there would be a phantom voter, counted
/// in every quorum and lost with the node it aliases.
///
/// # Errors
/// [`ErrorCode::BadArgs`] naming the node whose address it is.
pub fn validate_distinct<'a>(
    member: &Member,
    others: impl IntoIterator<Item = &'a Member>,
) -> Result<(), FrameError> {
    for other in others.into_iter().filter(|o| o.id != member.id) {
        let shared = [
            (&member.peer_addr, &other.peer_addr, "peer"),
            (&member.client_addr, &other.client_addr, "client"),
        ]
        .into_iter()
        .find(|(a, b, _)| a == b);
        if let Some((addr, _, what)) = shared {
            let message = format!(
                "node {}: {what} address {addr} is node {}'s already",
                member.id, other.id
            );
            return Err(FrameError::new(ErrorCode::BadArgs, message));
        }
    }
    Ok(())
}

/// Checks an INIT membership: 1 to [`CLUSTER_MEMBERS_MAX`] members, each valid, no id twice.
///
/// # Errors
/// [`ErrorCode::BadArgs`] naming what is wrong.
pub fn validate_members(members: &[Member]) -> Result<(), FrameError> {
    if members.is_empty() || members.len() > CLUSTER_MEMBERS_MAX {
        return Err(FrameError::new(
            ErrorCode::BadArgs,
            format!("a membership has 1 to {CLUSTER_MEMBERS_MAX} nodes"),
        ));
    }
    for (i, member) in members.iter().enumerate() {
        validate_member(member)?;
        if members[..i].iter().any(|m| m.id == member.id) {
            let message = format!("node {} is given twice", member.id);
            return Err(FrameError::new(ErrorCode::BadArgs, message));
        }
        validate_distinct(member, &members[..i])?;
    }
    Ok(())
}

fn put_str16(dst: &mut BytesMut, text: &str) {
    let len = u16::try_from(text.len()).expect("address longer than u16 passed to encoder");
    dst.put_u16(len);
    dst.put_slice(text.as_bytes());
}

/// Appends a member's fields.
pub(crate) fn put_member(dst: &mut BytesMut, member: &Member) {
    dst.put_u64(member.id);
    put_str16(dst, &member.peer_addr);
    put_str16(dst, &member.client_addr);
}

/// Appends INIT's body: a count, then the members.
pub(crate) fn put_members(dst: &mut BytesMut, members: &[Member]) {
    assert!(members.len() <= CLUSTER_MEMBERS_MAX, "too many members");
    dst.put_u16(members.len() as u16);
    for member in members {
        put_member(dst, member);
    }
}

/// Appends the CLUSTER reply's body.
pub(crate) fn put_status(dst: &mut BytesMut, status: &Status) {
    assert!(
        status.members.len() <= CLUSTER_MEMBERS_MAX,
        "too many members"
    );
    dst.put_u64(status.node_id);
    dst.put_u8(status.role as u8);
    dst.put_u64(status.term);
    dst.put_u64(status.leader_id);
    put_str16(dst, &status.leader_addr);
    dst.put_u64(status.last_log_index);
    dst.put_u64(status.last_applied_index);
    dst.put_u16(status.members.len() as u16);
    for (member, voter) in &status.members {
        dst.put_u8(u8::from(*voter));
        put_member(dst, member);
    }
    if let Some(ext) = &status.extension {
        dst.put_u16(STATUS_EXTENSION_LEN as u16);
        dst.put_slice(&ext.identities_digest.0);
        dst.put_slice(&ext.trust_digest.0);
        dst.put_u64(ext.last_contact_ms.unwrap_or(LAST_CONTACT_UNKNOWN));
    }
}

/// Reads CLUSTER_STATUS's body: empty, or a flags byte; whether it asks for the extension.
pub(crate) fn get_status_flags(b: &mut impl Read) -> Result<bool, FrameError> {
    if b.remaining() == 0 {
        return Ok(false);
    }
    let flags = b.u8("flags")?;
    if flags & !STATUS_FLAG_EXTENDED != 0 {
        return Err(bad(format!("unknown CLUSTER_STATUS flags {flags:#04x}")));
    }
    Ok(flags & STATUS_FLAG_EXTENDED != 0)
}

/// Reads the extension, if the reply carries one, skipping fields a later server appended.
fn get_extension(b: &mut impl Read) -> Result<Option<Box<StatusExtension>>, FrameError> {
    if b.remaining() == 0 {
        return Ok(None);
    }
    let len = usize::from(b.u16("extension length")?);
    if len < STATUS_EXTENSION_LEN || len != b.remaining() {
        return Err(bad(format!(
            "extension of {len} bytes: at least {STATUS_EXTENSION_LEN}, and the rest of the body"
        )));
    }
    let identities_digest = Digest(b.array8("identities digest")?);
    let trust_digest = Digest(b.array8("trust digest")?);
    let last_contact = b.u64("last contact")?;
    b.skip(len - STATUS_EXTENSION_LEN, "extension")?;
    Ok(Some(Box::new(StatusExtension {
        identities_digest,
        trust_digest,
        last_contact_ms: (last_contact != LAST_CONTACT_UNKNOWN).then_some(last_contact),
    })))
}

/// The reading side of a frame body that the cluster bodies need.
pub(crate) trait Read {
    fn u8(&mut self, what: &'static str) -> Result<u8, FrameError>;
    fn u16(&mut self, what: &'static str) -> Result<u16, FrameError>;
    fn u64(&mut self, what: &'static str) -> Result<u64, FrameError>;
    fn bytes16(&mut self, what: &'static str) -> Result<bytes::Bytes, FrameError>;
    fn remaining(&self) -> usize;
    fn skip(&mut self, n: usize, what: &'static str) -> Result<(), FrameError>;
    fn array8(&mut self, what: &'static str) -> Result<[u8; 8], FrameError>;
}

fn str16(b: &mut impl Read, what: &'static str) -> Result<String, FrameError> {
    let bytes = b.bytes16(what)?;
    if bytes.len() > CLUSTER_ADDR_LEN_MAX {
        return Err(bad(format!("{what} over {CLUSTER_ADDR_LEN_MAX} bytes")));
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| bad(format!("{what} is not UTF-8")))
}

/// Reads a member's fields.
pub(crate) fn get_member(b: &mut impl Read) -> Result<Member, FrameError> {
    Ok(Member {
        id: b.u64("node id")?,
        peer_addr: str16(b, "peer address")?,
        client_addr: str16(b, "client address")?,
    })
}

fn get_count(b: &mut impl Read) -> Result<usize, FrameError> {
    let count = b.u16("member count")? as usize;
    if count > CLUSTER_MEMBERS_MAX {
        return Err(bad(format!("{count} members, limit {CLUSTER_MEMBERS_MAX}")));
    }
    Ok(count)
}

/// Reads INIT's body.
pub(crate) fn get_members(b: &mut impl Read) -> Result<Vec<Member>, FrameError> {
    let count = get_count(b)?;
    (0..count).map(|_| get_member(b)).collect()
}

/// Reads the CLUSTER reply's body.
pub(crate) fn get_status(b: &mut impl Read) -> Result<Status, FrameError> {
    let node_id = b.u64("node id")?;
    let role = b.u8("role")?;
    let role = Role::from_u8(role).ok_or_else(|| bad(format!("unknown role {role}")))?;
    let term = b.u64("term")?;
    let leader_id = b.u64("leader id")?;
    let leader_addr = str16(b, "leader address")?;
    let last_log_index = b.u64("last log index")?;
    let last_applied_index = b.u64("last applied index")?;
    let count = get_count(b)?;
    let mut members = Vec::with_capacity(count);
    for _ in 0..count {
        let voter = b.u8("voter")? != 0;
        members.push((get_member(b)?, voter));
    }
    let extension = get_extension(b)?;
    Ok(Status {
        node_id,
        role,
        term,
        leader_id,
        leader_addr,
        last_log_index,
        last_applied_index,
        members,
        extension,
    })
}

/// Parses a member as the console and the command lines write it: `<peer addr>/<client
/// addr>`, for node `id`.
///
/// # Errors
/// [`ErrorCode::BadArgs`] for another shape or an address out of range.
pub fn parse_addrs(id: u64, addrs: &str) -> Result<Member, FrameError> {
    let shape = || {
        let message = format!("{addrs:?} is not <peer addr>/<client addr>");
        FrameError::new(ErrorCode::BadArgs, message)
    };
    let (peer, client) = addrs.split_once('/').ok_or_else(shape)?;
    let member = Member {
        id,
        peer_addr: peer.to_string(),
        client_addr: client.to_string(),
    };
    validate_member(&member)?;
    Ok(member)
}

/// Parses a membership as INIT and `--initial-cluster` write it: `1=<peer>/<client>,2=...`.
///
/// # Errors
/// [`ErrorCode::BadArgs`] for a member of another shape, an id given twice, or none.
pub fn parse_members(spec: &str) -> Result<Vec<Member>, FrameError> {
    let mut members = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|m| !m.is_empty()) {
        let shape = || {
            let message = format!("{item:?} is not <id>=<peer addr>/<client addr>");
            FrameError::new(ErrorCode::BadArgs, message)
        };
        let (id, addrs) = item.split_once('=').ok_or_else(shape)?;
        let id: u64 = id.trim().parse().map_err(|_| shape())?;
        members.push(parse_addrs(id, addrs)?);
    }
    validate_members(&members)?;
    Ok(members)
}

/// Members as [`parse_members`] reads them: `1=<peer>/<client>,2=...`.
pub fn format_members<'a>(members: impl IntoIterator<Item = &'a Member>) -> String {
    let items: Vec<String> = members
        .into_iter()
        .map(|m| format!("{}={}/{}", m.id, m.peer_addr, m.client_addr))
        .collect();
    items.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_parse_and_bad_ones_are_named() {
        let members = parse_members("1=127.0.0.1:7001/127.0.0.1:7878, 2=h:1/h:2").unwrap();
        assert_eq!(members.len(), 2);
        assert_eq!(members[0].peer_addr, "127.0.0.1:7001");
        assert_eq!(members[1].client_addr, "h:2");
        let long = format!("1=a/{}", "x".repeat(CLUSTER_ADDR_LEN_MAX + 1));
        for bad in [
            "",
            "1=a",
            "x=a/b",
            "1=/b",
            "1=a/",
            "0=a:1/b:2",
            "1=a:1/b:2,1=c:3/d:4",
            "1=a/b",
            "1=a:1/b:2/c:3",
            "1=a:99999/b:2",
            "1=a:0/b:2",
            "1=a b:1/c:2",
            "1=a:1/b:2,2=a:1/c:3",
            "1=a:1/b:2,2=c:3/b:2",
            &long,
        ] {
            let e = parse_members(bad).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadArgs, "{bad:?}");
        }
    }

    #[test]
    fn roles_round_trip_and_unknown_ones_are_none() {
        for value in 0..=4u8 {
            assert_eq!(Role::from_u8(value).unwrap() as u8, value);
        }
        assert_eq!(Role::from_u8(5), None);
    }
}
