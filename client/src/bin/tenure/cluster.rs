//! `tenure cluster status|init|add|remove`: a cluster's membership from the command line.
//! Each prints the answering node's view after the request: one `result=CLUSTER` line (or a
//! JSON object), then, without `--json`, a table of the members.

use clap::Subcommand;
use tenure::cluster::{Member, Status};

use tenure::Client;
use tenure_protocol::Request;

use crate::exit::EXIT_OK;
use crate::output::{stdout_line, Line, Out};

/// One `tenure cluster` subcommand.
#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// The answering node's view: its role and term, the leader, the members.
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
        ClusterCommand::Status => client.cluster_status().await?,
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
        Request::ClusterStatus => client.cluster_status().await?,
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
    out.print(
        Line::new("CLUSTER")
            .number("node_id", status.node_id)
            .text("role", status.role.name())
            .number("term", status.term)
            .number("leader_id", status.leader_id)
            .text("leader_addr", or_dash(status.leader_addr.clone()))
            .number("last_log_index", status.last_log_index)
            .number("last_applied_index", status.last_applied_index)
            .text("voters", members(true))
            .text("learners", members(false)),
    );
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
