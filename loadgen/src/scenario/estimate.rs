//! The sizing estimate, open loop: acquires arrive at a constant rate whatever the server does.
//!
//! Lock number `n` is meant to be acquired at `t0 + n / rate`, renewed at every multiple of
//! `renew_every` up to and including `hold` after that, and released at `hold` after it. Every
//! send time is fixed in advance, so a slow server shows up as latency measured from those
//! times rather than as a quietly lower rate. All of a lock's ops go on connection
//! `n % connections`, so a release can never overtake its renew.
//!
//! Because the intended times of acquires, of each renew round and of releases all grow with
//! `n`, each schedule is a cursor over lock numbers instead of a timer per lock:
//!
//! ```text
//!   lock n:   0   1   2   3   4   5   6   7   8  ...
//!   slots:            [ release_next ... renew_next[j] ... issued )
//!                      held or pending locks, oldest first
//! ```
//!
//! A cursor stops at a lock whose acquire has not been answered yet; the ops behind it keep
//! their intended times, so the stall is measured.
//!
//! With sessions (`--sessions N`, PROTOCOL.md 3.11), N sessions of `ttl_ms` are opened first
//! (untimed setup; the schedule starts once all are open); lock `n` is acquired in session
//! `n % N` and never renewed (a session lease has no TTL of its own), and each session is
//! kept alive every `ttl_ms / 3` instead: keep-alive `m` goes to session `m % N` at
//! `t0 + m * (ttl_ms / 3) / N`, one more cursor.

use std::collections::VecDeque;

use crate::op::{Op, OpKind, Outcome};
use crate::report::Value;
use crate::scenario::{key_base, op, Ctx, Rng, Scenario};

/// Settings of the estimate workload.
pub struct Settings {
    /// Acquires per second.
    pub rate: f64,
    /// Time from acquire to release, nanoseconds.
    pub hold_ns: u64,
    /// Renew period, nanoseconds.
    pub renew_every_ns: u64,
    /// Lease length asked for, milliseconds.
    pub ttl_ms: u32,
    /// Size of the key space.
    pub keys: u64,
    /// Connections to spread locks over.
    pub connections: usize,
    /// Sessions the locks are acquired in (0: none, each lock renewed on its own).
    pub sessions: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// Acquire sent, no reply yet.
    Pending,
    /// Granted; renews and the release go out on schedule.
    Held,
    /// Release sent.
    Releasing,
    /// Refused, lost or failed: nothing more to send.
    Gone,
}

#[derive(Clone, Copy)]
struct Slot {
    lease: u128,
    state: State,
}

/// The estimate workload.
pub struct Estimate {
    s: Settings,
    period_ns: f64,
    renews_per_lock: u64,
    key_base: u64,
    rng: Rng,
    t0_ns: u64,
    end_ns: u64,
    issued: u64,
    first: u64,
    slots: VecDeque<Slot>,
    renew_next: Vec<u64>,
    release_next: u64,
    held: u64,
    held_max: u64,
    lost: u64,
    /// Session ids by session number (0 until its SESSION_OPEN is answered).
    session_ids: Vec<u128>,
    sessions_open: usize,
    /// Whether the schedule runs (set once every session is open).
    started: bool,
    keepalive_next: u64,
    sessions_lost: u64,
}

impl Estimate {
    /// A workload with settings `s`, keys and lease values drawn from `rng`.
    pub fn new(s: Settings, mut rng: Rng) -> Estimate {
        assert!(s.rate > 0.0 && s.renew_every_ns > 0 && s.connections > 0);
        let renews_per_lock = if s.sessions > 0 {
            0
        } else {
            s.hold_ns / s.renew_every_ns
        };
        Estimate {
            period_ns: 1e9 / s.rate,
            renews_per_lock,
            key_base: key_base(&mut rng, s.keys),
            rng,
            t0_ns: 0,
            end_ns: u64::MAX,
            issued: 0,
            first: 0,
            slots: VecDeque::new(),
            renew_next: vec![0; renews_per_lock as usize],
            release_next: 0,
            held: 0,
            held_max: 0,
            lost: 0,
            session_ids: vec![0; s.sessions],
            sessions_open: 0,
            started: false,
            keepalive_next: 0,
            sessions_lost: 0,
            s,
        }
    }

    fn intended_ns(&self, n: u64) -> u64 {
        self.t0_ns + (n as f64 * self.period_ns) as u64
    }

    /// Keep-alive period of a session, nanoseconds: a third of its TTL.
    fn keepalive_every_ns(&self) -> f64 {
        f64::from(self.s.ttl_ms) * 1e6 / 3.0
    }

    /// The session id lock `n` is acquired in (0 without sessions).
    fn session_of(&self, n: u64) -> u128 {
        match self.s.sessions {
            0 => 0,
            count => self.session_ids[(n % count as u64) as usize],
        }
    }

    /// Opens every session, each on connection `number % connections`.
    fn open_sessions(&mut self, ctx: &mut Ctx<'_>) {
        for number in 0..self.s.sessions {
            let conn = number % self.s.connections;
            let open = op(
                OpKind::KeepAlive,
                0,
                0,
                self.s.ttl_ms,
                number as u64,
                ctx.now_ns,
            );
            ctx.submit(conn, open);
        }
    }

    fn send_keepalives(&mut self, ctx: &mut Ctx<'_>, cutoff_ns: u64) {
        let count = self.s.sessions as u64;
        if count == 0 {
            return;
        }
        let spacing_ns = self.keepalive_every_ns() / count as f64;
        loop {
            let m = self.keepalive_next;
            let at_ns = self.t0_ns + (m as f64 * spacing_ns) as u64;
            if at_ns > cutoff_ns {
                break;
            }
            let number = m % count;
            let id = self.session_ids[number as usize];
            let conn = (number % self.s.connections as u64) as usize;
            ctx.submit(
                conn,
                op(OpKind::KeepAlive, 0, id, self.s.ttl_ms, number, at_ns),
            );
            self.keepalive_next += 1;
        }
    }

    fn slot(&mut self, n: u64) -> Option<&mut Slot> {
        let index = usize::try_from(n.checked_sub(self.first)?).ok()?;
        self.slots.get_mut(index)
    }

    fn lock_op(&self, kind: OpKind, n: u64, lease: u128, intended_ns: u64) -> (usize, Op) {
        let key = self.key_base + n % self.s.keys;
        let conn = (n % self.s.connections as u64) as usize;
        (conn, op(kind, key, lease, self.s.ttl_ms, n, intended_ns))
    }

    fn send_acquires(&mut self, ctx: &mut Ctx<'_>, cutoff_ns: u64) {
        if cutoff_ns < self.t0_ns {
            return;
        }
        let due = ((cutoff_ns - self.t0_ns) as f64 / self.period_ns) as u64 + 1;
        while self.issued < due {
            let n = self.issued;
            let lease = match self.s.sessions {
                0 => self.rng.lease(),
                _ => self.session_of(n),
            };
            let (conn, op) = self.lock_op(OpKind::Acquire, n, lease, self.intended_ns(n));
            ctx.submit(conn, op);
            self.slots.push_back(Slot {
                lease,
                state: State::Pending,
            });
            self.issued += 1;
        }
    }

    fn send_renews(&mut self, ctx: &mut Ctx<'_>, cutoff_ns: u64) {
        for round in 0..self.renew_next.len() {
            let offset_ns = (round as u64 + 1) * self.s.renew_every_ns;
            loop {
                let n = self.renew_next[round];
                let at_ns = self.intended_ns(n) + offset_ns;
                if n >= self.issued || at_ns > cutoff_ns {
                    break;
                }
                let slot = *self.slot(n).expect("renew cursor is behind the slots");
                match slot.state {
                    State::Pending => break,
                    State::Held => {
                        let (conn, op) = self.lock_op(OpKind::Renew, n, slot.lease, at_ns);
                        ctx.submit(conn, op);
                    }
                    State::Releasing | State::Gone => {}
                }
                self.renew_next[round] += 1;
            }
        }
    }

    fn send_releases(&mut self, ctx: &mut Ctx<'_>, cutoff_ns: u64) {
        loop {
            let n = self.release_next;
            let at_ns = self.intended_ns(n) + self.s.hold_ns;
            // Every renew of lock n goes out before its release.
            if n >= self.issued || at_ns > cutoff_ns || self.renew_next.iter().any(|&c| c <= n) {
                break;
            }
            let slot = self.slot(n).expect("release cursor is behind the slots");
            match slot.state {
                State::Pending => break,
                State::Held => {
                    slot.state = State::Releasing;
                    let lease = slot.lease;
                    let (conn, op) = self.lock_op(OpKind::Release, n, lease, at_ns);
                    ctx.submit(conn, op);
                }
                State::Releasing | State::Gone => {}
            }
            self.release_next += 1;
        }
        while self.first < self.release_next {
            self.slots.pop_front();
            self.first += 1;
        }
    }
}

impl Estimate {
    /// SESSION_KEEPALIVEs per second: every session's, every third of its TTL.
    fn keepalives_per_s(&self) -> f64 {
        self.s.sessions as f64 * 1e9 / self.keepalive_every_ns()
    }
}

impl Scenario for Estimate {
    fn start(&mut self, ctx: &mut Ctx<'_>) {
        if self.s.sessions > 0 {
            self.open_sessions(ctx);
            return;
        }
        self.started = true;
        self.t0_ns = ctx.now_ns;
        self.tick(ctx);
    }

    fn tick(&mut self, ctx: &mut Ctx<'_>) {
        if !self.started {
            return;
        }
        // Nothing intended at or after the window's end is sent; earlier ops still go out.
        let cutoff_ns = ctx.now_ns.min(self.end_ns.saturating_sub(1));
        self.send_acquires(ctx, cutoff_ns);
        self.send_renews(ctx, cutoff_ns);
        self.send_keepalives(ctx, cutoff_ns);
        self.send_releases(ctx, cutoff_ns);
    }

    fn on_reply(&mut self, ctx: &mut Ctx<'_>, op: &Op, outcome: &Outcome) {
        match (op.kind, outcome) {
            (OpKind::KeepAlive, Outcome::Session { id }) if op.lease == 0 => {
                self.session_ids[op.tag as usize] = *id;
                self.sessions_open += 1;
                if self.sessions_open == self.s.sessions {
                    self.started = true;
                    self.t0_ns = ctx.now_ns;
                }
            }
            (OpKind::KeepAlive, Outcome::Session { .. }) => {}
            // A session that could not be opened or kept alive: counted, and (opened or not)
            // its locks' acquires are refused from then on.
            (OpKind::KeepAlive, _) => self.sessions_lost += 1,
            (OpKind::Acquire, Outcome::Granted { lease, .. }) => {
                let lease = *lease;
                let slot = self.slot(op.tag).expect("pending slots are kept");
                slot.lease = lease;
                slot.state = State::Held;
                self.held += 1;
                self.held_max = self.held_max.max(self.held);
            }
            (OpKind::Acquire, _) => {
                self.slot(op.tag).expect("pending slots are kept").state = State::Gone;
            }
            (OpKind::Renew, Outcome::Lost) => {
                // A release already sent accounts for the lock itself.
                if let Some(slot) = self.slot(op.tag).filter(|s| s.state == State::Held) {
                    slot.state = State::Gone;
                    self.held -= 1;
                    self.lost += 1;
                }
            }
            (OpKind::Release, _) => self.held -= 1,
            _ => {}
        }
    }

    fn set_window(&mut self, _start_ns: u64, end_ns: u64) {
        self.end_ns = end_ns;
    }

    fn ready(&self) -> bool {
        self.started
    }

    fn ramp_ns(&self) -> u64 {
        self.s.hold_ns
    }

    fn held(&self) -> u64 {
        self.held
    }

    fn target_rates(&self) -> [Option<f64>; OpKind::COUNT] {
        let rate = self.s.rate;
        [
            Some(rate),
            Some(rate * self.renews_per_lock as f64),
            Some(rate),
            None,
            Some(self.keepalives_per_s()),
        ]
    }

    fn summary(&self, _window_s: f64) -> Vec<(&'static str, Value)> {
        let hold_s = self.s.hold_ns as f64 / 1e9;
        vec![
            (
                "locks_held_expected",
                Value::U64((self.s.rate * hold_s) as u64),
            ),
            ("locks_held_max", Value::U64(self.held_max)),
            ("renews_per_lock", Value::U64(self.renews_per_lock)),
            ("leases_lost", Value::U64(self.lost)),
            ("sessions", Value::U64(self.s.sessions as u64)),
            ("sessions_lost", Value::U64(self.sessions_lost)),
            (
                "ops_per_s_target",
                Value::F64(
                    self.s.rate * (2 + self.renews_per_lock) as f64 + self.keepalives_per_s(),
                ),
            ),
        ]
    }
}
