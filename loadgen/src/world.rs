//! [`World`]: the state every task of a run shares on its one thread, the connections, the
//! counters and the scenario, and the three ways it moves: bytes arrive, the clock ticks,
//! the run starts. It sits below the driver (`run`) and the socket tasks (`socket`), which
//! both hold it in an `Rc<RefCell<World>>`, and above the connections and scenarios it holds.

use std::time::Instant;

use anyhow::bail;

use crate::conn::{Conn, BACKLOG_MAX};
use crate::scenario::{Ctx, Scenario};
use crate::stats::Stats;

/// Everything the tasks of a run share.
pub struct World {
    /// One entry per connection.
    pub conns: Vec<Conn>,
    /// Counters and histograms.
    pub stats: Stats,
    /// The workload.
    pub scenario: Box<dyn Scenario>,
    /// The window has closed.
    pub stopping: bool,
    /// The run's time origin: every `_ns` figure counts from here.
    start: Instant,
}

impl World {
    /// A world whose clock starts now, with no window placed yet.
    pub fn new(conns: Vec<Conn>, stats: Stats, scenario: Box<dyn Scenario>) -> World {
        World {
            conns,
            stats,
            scenario,
            stopping: false,
            start: Instant::now(),
        }
    }

    /// Nanoseconds since the run's time origin.
    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Decodes every complete reply in `input` for connection `index` and lets the scenario act.
    ///
    /// # Errors
    /// When the stream is broken or a reply matches no request.
    pub fn on_bytes(&mut self, index: usize, input: &mut bytes::BytesMut) -> anyhow::Result<()> {
        let now_ns = self.now_ns();
        let World {
            conns,
            stats,
            scenario,
            stopping,
            ..
        } = self;
        let mut ctx = Ctx {
            now_ns,
            conns,
            stopping: *stopping,
        };
        while let Some((id, decoded)) = ctx.conns[index].proto.decode(input)? {
            let conn = &mut ctx.conns[index];
            let op = conn.take(id)?;
            let outcome = conn.proto.outcome(&op, decoded);
            stats.record(&op, &outcome, now_ns);
            scenario.on_reply(&mut ctx, &op, &outcome);
            ctx.conns[index].refill(now_ns);
        }
        ctx.conns.iter().for_each(Conn::flush);
        Ok(())
    }

    /// Lets the scenario do its timed sends, then wakes the writers.
    pub fn tick(&mut self) {
        let now_ns = self.now_ns();
        let mut ctx = Ctx {
            now_ns,
            conns: &mut self.conns,
            stopping: self.stopping,
        };
        self.scenario.tick(&mut ctx);
        ctx.conns.iter().for_each(Conn::flush);
    }

    /// Starts the scenario at the time origin.
    pub fn start_scenario(&mut self) {
        let mut ctx = Ctx {
            now_ns: self.now_ns(),
            conns: &mut self.conns,
            stopping: false,
        };
        self.scenario.start(&mut ctx);
        ctx.conns.iter().for_each(Conn::flush);
    }

    /// Ops sent and not answered, plus ops waiting for pipeline room.
    pub fn outstanding(&self) -> usize {
        self.conns.iter().map(|c| c.in_flight() + c.backlog()).sum()
    }

    /// Whether every connection still works and keeps up.
    ///
    /// # Errors
    /// The first connection that failed or overflowed its backlog.
    pub fn check_health(&self) -> anyhow::Result<()> {
        for (i, conn) in self.conns.iter().enumerate() {
            if let Some(why) = &conn.failed {
                bail!("connection {i}: {why}");
            }
            if conn.overloaded {
                bail!(
                    "connection {i}: over {} ops waiting for pipeline room; the target is not \
                     keeping up with the offered load (lower --rate or raise --pipeline)",
                    BACKLOG_MAX
                );
            }
        }
        Ok(())
    }
}
