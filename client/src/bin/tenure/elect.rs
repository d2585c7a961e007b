//! Leader election from the shell: `tenure elect` runs a command only while leading a group
//! (supervised like `tenure run`), `tenure observe` prints each new leader.

use tenure::{Client, Election, ElectionOptions};

use crate::cli::ElectArgs;
use crate::exit::EXIT_OK;
use crate::output::{kv_value, Line, Out};
use crate::run::supervise;

/// `tenure elect`: campaigns until leading, then runs the command while leadership lasts.
pub async fn elect(client: Client, out: &Out, args: ElectArgs) -> anyhow::Result<u8> {
    let options = ElectionOptions {
        ttl: args.ttl,
        ..ElectionOptions::default()
    };
    let election = Election::with_options(client, &args.group, options);
    let leadership = election.campaign(&args.value).await?;
    out.print(
        Line::new("LEADING")
            .text("group", args.group.as_str())
            .number("term", leadership.term())
            .text("value", args.value.as_str()),
    );
    let key = String::from_utf8_lossy(election.key()).into_owned();
    supervise(
        leadership.into_guard(),
        out,
        &key,
        &args.command,
        args.grace,
    )
    .await
}

/// `tenure observe`: one `term= value=` line per new leader, until the stream ends.
pub async fn observe(client: Client, out: &Out, group: String) -> anyhow::Result<u8> {
    let mut leaders = Election::new(client, &group).observe();
    while let Some(leader) = leaders.next().await {
        match leader {
            Ok(leader) => out.print(
                Line::default()
                    .number("term", leader.term)
                    .text("value", String::from_utf8_lossy(&leader.value)),
            ),
            Err(e) => eprintln!("error={}", kv_value(&e.to_string())),
        }
    }
    Ok(EXIT_OK)
}
