//! `tenure cluster status|init|add|remove`: a cluster's membership from the command line.
//! Each prints the answering node's view after the request: one `result=CLUSTER` line (or a
//! JSON object), then, without `--json`, a table of the members.
//!
//! `status` also asks every member's client address for its own view, at once, and prints
//! one `result=MEMBER` line per member and a table with each member's role, term, leader,
//! log position, lag behind the leader's log, last contact and whether its identities and
//! trust set digests match the leader's: a partition or a node configured differently shows
//! at a glance.

use clap::Subcommand;
use std::time::Duration;

use tenure::cluster::{Member, Status, StatusExtension};
use tenure::{Client, ClientConfig};
use tenure_protocol::Request;

use crate::exit::EXIT_OK;
use crate::output::{stdout_line, Line, Out};

/// One `tenure cluster` subcommand.
#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// The answering node's view (role, term, leader, members), then every member's own
    /// view, asked at its client address: role, term, leader, log, lag, last contact, and
    /// whether its security configuration matches the leader's.
    Status,
    /// Make the first membership on the node at --addr (not yet initialised, and among
    /// them); every node is a voter. `tenured --initial-cluster` does this by itself.
    Init {
        /// Every member: `1=<peer addr>/<client addr>,2=...`.
        #[arg(long)]
        nodes: String,
    },
    /// Add a node: a learner until it has caught up, then a voter. Start it first (with
    /// --cluster, its --node-id, and no --initial-cluster).
    Add {
        /// The new node's id.
        id: u64,
        /// Its addresses: `<peer addr>/<client addr>`.
        addrs: String,
    },
    /// Remove a node (the leader too: it steps down); stop it afterwards. To replace a
    /// node, add the new one, then remove the old one.
    Remove {
        /// The node's id.
        id: u64,
    },
}

/// Runs `command` and prints the status it answers.
pub async fn cluster(client: &Client, out: &Out, command: ClusterCommand) -> anyhow::Result<u8> {
    let status = match command {
        ClusterCommand::Status => {
            let status = client.cluster_status().await?;
            print_status(out, &status);
            print_table(out, &status);
            let views = ask_members(client, &status).await;
            print_members(out, &status, &views);
            return Ok(EXIT_OK);
        }
        ClusterCommand::Init { nodes } => {
            let members = tenure_protocol_members(&nodes)?;
            client.cluster_init(members).await?
        }
        ClusterCommand::Add { id, addrs } => {
            let member =
                tenure::cluster::parse_addrs(id, &addrs).map_err(|e| anyhow::anyhow!(e.message))?;
            client.cluster_add(member).await?
        }
        ClusterCommand::Remove { id } => client.cluster_remove(id).await?,
    };
    print_status(out, &status);
    print_table(out, &status);
    Ok(EXIT_OK)
}

/// `tenure console`'s CLUSTER lines: the status line only, one line per answer.
pub async fn console(client: &Client, out: &Out, request: Request) -> anyhow::Result<()> {
    let status = match request {
        Request::ClusterStatus { .. } => client.cluster_status().await?,
        Request::ClusterInit { members } => client.cluster_init(members).await?,
        Request::ClusterAdd { member } => client.cluster_add(member).await?,
        Request::ClusterRemove { id } => client.cluster_remove(id).await?,
        other => anyhow::bail!("{} is not a cluster request", other.kind()),
    };
    print_status(out, &status);
    Ok(())
}

fn tenure_protocol_members(spec: &str) -> anyhow::Result<Vec<Member>> {
    tenure::cluster::parse_members(spec).map_err(|e| anyhow::anyhow!("--nodes: {}", e.message))
}

/// `-` for nothing, so that every field is one word.
fn or_dash(text: String) -> String {
    if text.is_empty() {
        "-".to_string()
    } else {
        text
    }
}

/// The status line.
fn print_status(out: &Out, status: &Status) {
    let members = |voters: bool| {
        let chosen = status.members.iter().filter(|(_, v)| *v == voters);
        or_dash(tenure::cluster::format_members(chosen.map(|(m, _)| m)))
    };
    let line = Line::new("CLUSTER")
        .number("node_id", status.node_id)
        .text("role", status.role.name())
        .number("term", status.term)
        .number("leader_id", status.leader_id)
        .text("leader_addr", or_dash(status.leader_addr.clone()))
        .number("last_log_index", status.last_log_index)
        .number("last_applied_index", status.last_applied_index)
        .text("voters", members(true))
        .text("learners", members(false));
    out.print(with_extension(line, status.extension.as_deref()));
}

/// `line` with the extension's fields appended, when the server sent it.
fn with_extension(line: Line, extension: Option<&StatusExtension>) -> Line {
    let Some(ext) = extension else {
        return line;
    };
    line.text("identities_digest", ext.identities_digest.to_hex())
        .text("trust_digest", ext.trust_digest.to_hex())
        .text("last_contact_ms", contact(ext))
}

fn contact(ext: &StatusExtension) -> String {
    ext.last_contact_ms
        .map_or("-".to_string(), |ms| ms.to_string())
}

/// Without `--json`: a table of the members, for people.
fn print_table(out: &Out, status: &Status) {
    if out.json {
        return;
    }
    let width = |f: fn(&Member) -> usize| {
        let widest = status.members.iter().map(|(m, _)| f(m)).max();
        widest.unwrap_or(0).max("CLIENT ADDR".len())
    };
    let (peer_w, client_w) = (width(|m| m.peer_addr.len()), width(|m| m.client_addr.len()));
    let header = format!(
        "{:<6} {:<8} {:<peer_w$} {:<client_w$}",
        "ID", "MEMBER", "PEER ADDR", "CLIENT ADDR"
    );
    stdout_line(header.trim_end());
    for (member, voter) in &status.members {
        let kind = if *voter { "voter" } else { "learner" };
        let leader = if member.id == status.leader_id {
            "  (leader)"
        } else {
            ""
        };
        let row = format!(
            "{:<6} {kind:<8} {:<peer_w$} {:<client_w$}{leader}",
            member.id, member.peer_addr, member.client_addr
        );
        stdout_line(row.trim_end());
    }
}

/// Longest `status` waits for one member's answer: a member cut off must not hold up the
/// view of the others (they are asked at once).
const MEMBER_TIMEOUT_MAX: Duration = Duration::from_secs(3);

/// What one member answered about itself, or why it did not.
type View = Result<Status, String>;

/// Asks every member of `status` for its own view at its client address, all at once, with
/// the connection settings of `client` (TLS, identity).
async fn ask_members(client: &Client, status: &Status) -> Vec<(Member, bool, View)> {
    let mut config: ClientConfig = client.config().clone();
    config.connect_timeout = config.connect_timeout.min(MEMBER_TIMEOUT_MAX);
    config.request_timeout = config.request_timeout.min(MEMBER_TIMEOUT_MAX);
    let asks = status.members.iter().map(|(member, voter)| {
        let config = config.clone();
        async move {
            let ask = async {
                let member_client = Client::connect_with(member.client_addr.clone(), config)
                    .await
                    .map_err(|e| e.to_string())?;
                let view = member_client
                    .cluster_status()
                    .await
                    .map_err(|e| e.to_string());
                member_client.disconnect();
                view
            };
            let view = tokio::time::timeout(2 * MEMBER_TIMEOUT_MAX, ask)
                .await
                .unwrap_or_else(|_| Err(format!("no answer within {:?}", 2 * MEMBER_TIMEOUT_MAX)));
            (member.clone(), *voter, view)
        }
    });
    futures_util::future::join_all(asks).await
}

/// Whether a member's security configuration matches the reference's (the leader's).
fn config_match(view: &Status, reference: Option<&StatusExtension>) -> &'static str {
    match (view.extension.as_deref(), reference) {
        (Some(mine), Some(theirs)) => {
            let same = mine.identities_digest == theirs.identities_digest
                && mine.trust_digest == theirs.trust_digest;
            if same {
                "same"
            } else {
                "DIFFERS"
            }
        }
        _ => "unknown",
    }
}

/// The members' own answers that say they lead, the highest term first. More than one is
/// a node cut off from the others (its network, peer port or peer TLS) that still holds an
/// older term's leadership: it serves nothing (outside test a63, F4, where the table showed
/// two leaders with no word on which one was).
fn claimants(views: &[(Member, bool, View)]) -> Vec<&Status> {
    let mut leading: Vec<&Status> = views
        .iter()
        .filter_map(|(m, _, v)| {
            let v = v.as_ref().ok()?;
            (v.leader_id == m.id && v.node_id == m.id).then_some(v)
        })
        .collect();
    leading.sort_by_key(|v| std::cmp::Reverse(v.term));
    leading
}

/// The reference for the digests: the leader's own answer (of the highest term), else the
/// answering node's.
fn reference<'a>(
    status: &'a Status,
    views: &'a [(Member, bool, View)],
) -> (u64, Option<&'a StatusExtension>) {
    match claimants(views).first() {
        Some(v) => (v.node_id, v.extension.as_deref()),
        None => (status.node_id, status.extension.as_deref()),
    }
}

/// A warning for each member that says it leads an older term than the leader's.
fn warn_stale_leaders(views: &[(Member, bool, View)]) {
    let leading = claimants(views);
    let Some((leader, stale)) = leading.split_first() else {
        return;
    };
    for v in stale {
        crate::output::warn(&stale_leader_warning(v, leader));
    }
}

fn stale_leader_warning(stale: &Status, leader: &Status) -> String {
    format!(
        "node {} says it leads term {}, but node {} leads term {}: node {} is cut off from \
         the others (network, peer port or peer TLS) and serves nothing",
        stale.node_id, stale.term, leader.node_id, leader.term, stale.node_id
    )
}

/// One `result=MEMBER` line per member, then (without `--json`) the table; a warning on
/// stderr for each member whose configuration differs from the leader's.
fn print_members(out: &Out, status: &Status, views: &[(Member, bool, View)]) {
    let (reference_id, reference_ext) = reference(status, views);
    warn_stale_leaders(views);
    let leader_log = claimants(views).first().map(|v| v.last_log_index);
    let mut rows = Vec::new();
    for (member, voter, view) in views {
        let kind = if *voter { "voter" } else { "learner" };
        let line = Line::new("MEMBER")
            .number("id", member.id)
            .text("member", kind);
        let view = match view {
            Ok(view) => view,
            Err(why) => {
                out.print(line.text("reachable", "no").text("error", why.clone()));
                rows.push(row(member, None, "-".into(), "unknown"));
                continue;
            }
        };
        let lag = leader_log.map_or("-".to_string(), |l| {
            l.saturating_sub(view.last_log_index).to_string()
        });
        let config = config_match(view, reference_ext);
        if config == "DIFFERS" {
            crate::output::warn(&format!(
                "node {}: identities or trust set digest differs from node {reference_id}'s \
                 (the leader's): every node needs the same --identities and --tls-client-ca",
                member.id
            ));
        }
        let line = line
            .text("reachable", "yes")
            .text("role", view.role.name())
            .number("term", view.term)
            .number("leader_id", view.leader_id)
            .number("last_log_index", view.last_log_index)
            .number("last_applied_index", view.last_applied_index)
            .text("lag_entries", lag.clone());
        let line = with_extension(line, view.extension.as_deref()).text("config", config);
        out.print(line);
        rows.push(row(member, Some(view), lag, config));
    }
    print_member_table(out, &rows);
}

/// A table row's cells, in [`HEADERS`] order.
fn row(member: &Member, view: Option<&Status>, lag: String, config: &str) -> Vec<String> {
    let mut cells = vec![member.id.to_string()];
    match view {
        Some(v) => cells.extend([
            v.role.name().to_string(),
            v.term.to_string(),
            v.leader_id.to_string(),
            v.last_log_index.to_string(),
            v.last_applied_index.to_string(),
            lag,
            v.extension.as_deref().map_or("-".to_string(), contact),
        ]),
        None => {
            cells.push("UNREACHABLE".to_string());
            cells.extend(std::iter::repeat_n("-".to_string(), 6));
        }
    }
    cells.push(config.to_string());
    cells
}

/// The columns of the members' own views, after the membership table.
const HEADERS: [&str; 9] = [
    "ID",
    "ROLE",
    "TERM",
    "LEADER",
    "LOG",
    "APPLIED",
    "LAG",
    "CONTACT_MS",
    "CONFIG",
];

fn print_member_table(out: &Out, rows: &[Vec<String>]) {
    if out.json {
        return;
    }
    let widths: Vec<usize> = (0..HEADERS.len())
        .map(|i| {
            let widest = rows.iter().map(|r| r[i].len()).max().unwrap_or(0);
            widest.max(HEADERS[i].len())
        })
        .collect();
    let render = |cells: &[String]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join(" ").trim_end().to_string()
    };
    let headers: Vec<String> = HEADERS.iter().map(|h| h.to_string()).collect();
    stdout_line(&render(&headers));
    for row in rows {
        stdout_line(&render(row));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenure::cluster::Role;

    fn view(node_id: u64, role: Role, term: u64, leader_id: u64) -> (Member, bool, View) {
        let member = Member {
            id: node_id,
            peer_addr: format!("127.0.0.1:{}", 7100 + node_id),
            client_addr: format!("127.0.0.1:{}", 7800 + node_id),
        };
        let status = Status {
            node_id,
            role,
            term,
            leader_id,
            leader_addr: String::new(),
            last_log_index: 10 * term,
            last_applied_index: 10 * term,
            members: Vec::new(),
            extension: None,
        };
        (member, true, Ok(status))
    }

    /// A restarted ex-leader cut off by a wrong peer certificate still says it leads its
    /// old term (outside test a63, F4): the leader is the one of the highest term, and the
    /// other is named as cut off.
    #[test]
    fn of_two_nodes_that_say_they_lead_the_higher_term_is_the_leader() {
        let views = [
            view(1, Role::Leader, 1, 1),
            view(2, Role::Follower, 2, 4),
            view(4, Role::Leader, 2, 4),
        ];
        let leading = claimants(&views);
        let ids: Vec<u64> = leading.iter().map(|v| v.node_id).collect();
        assert_eq!(ids, [4, 1]);
        let status = views[1].2.as_ref().unwrap();
        assert_eq!(reference(status, &views).0, 4);
        assert_eq!(
            stale_leader_warning(leading[1], leading[0]),
            "node 1 says it leads term 1, but node 4 leads term 2: node 1 is cut off from the \
             others (network, peer port or peer TLS) and serves nothing"
        );
    }
}
