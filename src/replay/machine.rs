//! Replay's decision for each message it takes, with no I/O: the loop in `replay` tells it what it read and what the
//! broker answered, and does what it says. Kept apart so that every order of deliveries, redeliveries, confirms and
//! connection losses can be tried against it (the property test below).
//!
//! The rules it keeps:
//! - A dead-letter copy is acknowledged only when a copy with the same content (body, properties, headers, origin)
//!   was confirmed on its origin: right after that confirm, or — once — in a later pass, when the acknowledgement
//!   sent after that confirm may have been lost with the connection and an identical copy comes back redelivered.
//!   The same message id is not enough: two messages can share one and differ.
//! - Each message of the snapshot is reported once, with what became of it. A copy looked at and left in an earlier
//!   pass comes back redelivered when the connection is lost: it is stepped over (its report stands), before any
//!   acknowledgement owed is considered, so a left message is never taken for a replayed one.
//! - A copy this run republished that failed again (it carries the run's tag) is never taken again.
//! - Acknowledgements are not answered in AMQP: one is known to have arrived only when a later request on the same
//!   channel was answered ([`Machine::settled`]). Those not known so at a connection loss are the ones that may have
//!   been lost.

use std::collections::{HashMap, HashSet};

use super::Action;

/// The fingerprint of everything a copy carries, and where it goes: two copies with the same content are
/// interchangeable.
pub type Content = u128;

/// How one message is recognised among copies that differ (a failure's headers, a replay count): its id and where
/// it goes, or, without an id, its body and where it goes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Key {
    Id { id: String, origin: Option<String> },
    Body { body: u128, origin: Option<String> },
}

/// What the loop read from one delivery.
#[derive(Debug, Clone)]
pub struct Seen {
    pub content: Content,
    pub key: Key,
    /// The broker's redelivered flag: set on every copy that was delivered before, to this run or another.
    pub redelivered: bool,
    /// Carries this run's tag: a copy this run republished, failed again and dead-lettered anew.
    pub from_this_run: bool,
    /// Chosen by `--message-id` and `--reason` (`--limit` is counted here).
    pub chosen: bool,
    /// Why it must stay where it is if chosen (replayed too often, failed too long ago, no origin to be read).
    pub obstacle: Option<Action>,
}

/// What the loop must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Hold it, saying nothing: it is accounted for already, or not part of the snapshot.
    Hold,
    /// Acknowledge it without sending it: an identical copy was confirmed on its origin and the acknowledgement that
    /// followed may have been lost with the connection.
    AckAgain,
    /// Hold it and report it with this action.
    Leave(Action),
    /// Republish it (in a dry run, only check its origin) and say how it went with [`Machine::outcome`].
    Publish,
    /// Its copy is confirmed on its origin: report it replayed and acknowledge it.
    Ack,
}

/// How a republish went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The broker confirmed the copy on the origin queue.
    Confirmed,
    /// The origin queue does not exist (checked first, or the copy came back unroutable).
    Missing,
    /// The broker refused the copy (a nack, a closed channel, an error before sending).
    Failed,
    /// A dry run: the origin exists; nothing was sent.
    WouldReplay,
}

/// The replay's decisions and counts, across passes (one pass per connection).
#[derive(Debug)]
pub struct Machine {
    snapshot: u64,
    limit: Option<u64>,
    /// Messages of the snapshot reported so far.
    decided: u64,
    /// Messages chosen so far (for `--limit`).
    selected: u64,
    replayed: u64,
    left: u64,
    already_replayed: u64,
    /// Messages republished with the broker's confirm (or, in a dry run, that would be).
    republished: HashSet<Key>,
    /// Copies reported and left in earlier passes, by content: still in the dead-letter queue.
    left_before: HashMap<Content, u32>,
    /// Copies reported and left in this pass.
    left_now: HashMap<Content, u32>,
    /// Copies of `left_before` stepped over in this pass.
    stepped_over: HashMap<Content, u32>,
    /// Acknowledgements owed: for each content, confirmed republishes whose acknowledgement may have been lost.
    owed: HashMap<Content, u32>,
    /// Acknowledgements sent on this connection and not known to have arrived: the content, and whether it was a
    /// second one ([`Step::AckAgain`]).
    unsettled: Vec<(Content, bool)>,
    /// The copy being republished.
    pending: Option<(Content, Key)>,
    /// Acknowledgements not known to have arrived when the last connection was lost, until the next connection goes
    /// on past what that loss gave back (or finds the queue empty): then each was made again or had arrived.
    unsettled_at_loss: u64,
    /// How many messages the queue held when this pass began (unknown: `None`).
    pass_depth: Option<u64>,
    /// Messages taken in this pass.
    taken_in_pass: u64,
    /// Acknowledgements of this pass known to have arrived: those messages are gone for good.
    settled_in_pass: u64,
    /// Messages the lost connections held (taken, and not known acknowledged): what they gave back, or may give back
    /// late.
    given_back: u64,
}

impl Machine {
    pub fn new(snapshot: u64, limit: Option<u64>) -> Self {
        Self {
            snapshot,
            limit,
            decided: 0,
            selected: 0,
            replayed: 0,
            left: 0,
            already_replayed: 0,
            republished: HashSet::new(),
            left_before: HashMap::new(),
            left_now: HashMap::new(),
            stepped_over: HashMap::new(),
            owed: HashMap::new(),
            unsettled: Vec::new(),
            pending: None,
            unsettled_at_loss: 0,
            pass_depth: None,
            taken_in_pass: 0,
            settled_in_pass: 0,
            given_back: 0,
        }
    }

    /// A new connection: what the last one held is back in the dead-letter queue.
    pub fn pass_started(&mut self) {
        for (content, n) in self.left_now.drain() {
            *self.left_before.entry(content).or_default() += n;
        }
        self.stepped_over.clear();
        self.pass_depth = None;
        self.taken_in_pass = 0;
        self.settled_in_pass = 0;
    }

    /// The dead-letter queue holds `depth` messages before this pass takes any, the lost connection's given back.
    pub fn queue_holds(&mut self, depth: u64) {
        self.pass_depth = Some(depth);
    }

    /// Whether an acknowledgement may have been lost with a connection and its copy not met again yet: then the pass
    /// wants to know how many messages the queue holds as it begins ([`Machine::queue_holds`]).
    pub fn owes(&self) -> bool {
        self.owed.values().any(|&n| n > 0)
    }

    /// Whether the loop should take another message: the snapshot is not done, or an acknowledgement is owed and its
    /// copy may still be ahead. That copy was given back by a lost connection: it is among the messages the queue
    /// held as this pass counted it, or — given back after the count, the broker's closing of that connection running
    /// behind — it lands at the head of the queue, one of the messages those connections held. So the pass looks at
    /// as many messages as it counted and the lost connections held, and no further: the acknowledgement arrived
    /// after all. Without that bound, messages failing meanwhile (or looked at by another client, which marks them
    /// redelivered) would keep the replay taking — and holding out of sight — for as long as they came faster than
    /// it takes them. (The snapshot is counted by number, not by message: a copy given back only after the pass's first
    /// gets, behind a message that failed since, lets that one be taken for it — reported, and the copy left unreported
    /// in the queue. A wider window than this bound's; not closed.)
    pub fn wants_more(&self) -> bool {
        let looked_far_enough = self
            .pass_depth
            .is_some_and(|depth| self.taken_in_pass >= depth.saturating_add(self.given_back));
        self.decided < self.snapshot || (self.owes() && !looked_far_enough)
    }

    pub fn delivered(&mut self, seen: &Seen) -> Step {
        self.taken_in_pass += 1;
        if seen.from_this_run {
            return Step::Hold;
        }
        if seen.redelivered {
            let before = self.left_before.get(&seen.content).copied().unwrap_or(0);
            let stepped = self.stepped_over.entry(seen.content).or_default();
            if *stepped < before {
                *stepped += 1;
                return Step::Hold;
            }
            if let Some(owed) = self.owed.get_mut(&seen.content).filter(|n| **n > 0) {
                *owed -= 1;
                self.unsettled.push((seen.content, true));
                // Its doubt moves to the acknowledgement made again, which a next loss counts anew.
                self.unsettled_at_loss = self.unsettled_at_loss.saturating_sub(1);
                return Step::AckAgain;
            }
        }
        // Past what the last loss gave back (it comes back first, where it was).
        self.unsettled_at_loss = 0;
        if self.decided >= self.snapshot {
            return Step::Hold;
        }
        if self.republished.contains(&seen.key) {
            return self.leave(seen.content, Action::CopyOfReplayed);
        }
        let chosen = seen.chosen && self.limit.is_none_or(|limit| self.selected < limit);
        if !chosen {
            return self.leave(seen.content, Action::NotSelected);
        }
        self.selected += 1;
        if let Some(obstacle) = seen.obstacle {
            return self.leave(seen.content, obstacle);
        }
        self.pending = Some((seen.content, seen.key.clone()));
        Step::Publish
    }

    /// How the republish [`Step::Publish`] asked for went.
    pub fn outcome(&mut self, outcome: Outcome) -> Step {
        let Some((content, key)) = self.pending.take() else {
            return Step::Hold;
        };
        match outcome {
            Outcome::Confirmed => {
                self.republished.insert(key);
                self.replayed += 1;
                self.decided += 1;
                self.unsettled.push((content, false));
                Step::Ack
            }
            Outcome::WouldReplay => {
                self.republished.insert(key);
                self.leave(content, Action::WouldReplay)
            }
            Outcome::Missing => self.leave(content, Action::OriginMissing),
            Outcome::Failed => self.leave(content, Action::PublishFailed),
        }
    }

    fn leave(&mut self, content: Content, action: Action) -> Step {
        self.decided += 1;
        if action.is_problem() {
            self.left += 1;
        }
        *self.left_now.entry(content).or_default() += 1;
        Step::Leave(action)
    }

    /// A request on the channel the acknowledgements went on was answered after them: they arrived.
    pub fn settled(&mut self) {
        self.settled_in_pass += self.unsettled.len() as u64;
        for (_, again) in self.unsettled.drain(..) {
            if again {
                self.already_replayed += 1;
            }
        }
    }

    /// The connection is gone: what it held goes back to the dead-letter queue, a republish not yet confirmed may or
    /// may not have reached its origin, and the acknowledgements not known to have arrived may have been lost.
    pub fn connection_lost(&mut self) {
        if self.pending.take().is_some() {
            self.selected -= 1;
        }
        // Added to what an earlier loss left in doubt, if no connection has got past it since.
        self.unsettled_at_loss += self.unsettled.len() as u64;
        self.given_back += self.taken_in_pass.saturating_sub(self.settled_in_pass);
        for (content, _) in self.unsettled.drain(..) {
            *self.owed.entry(content).or_default() += 1;
        }
    }

    /// Messages of the snapshot reported, and acknowledgements made again: how far the replay got.
    pub fn progress(&self) -> u64 {
        self.decided + self.already_replayed
    }

    pub fn decided(&self) -> u64 {
        self.decided
    }

    pub fn replayed(&self) -> u64 {
        self.replayed
    }

    pub fn left(&self) -> u64 {
        self.left
    }

    pub fn already_replayed(&self) -> u64 {
        self.already_replayed
    }

    /// The queue was found empty: whatever the last loss gave back was taken again already.
    pub fn queue_empty(&mut self) {
        self.unsettled_at_loss = 0;
    }

    /// Acknowledgements not known to have arrived when the last connection was lost, as long as no connection since
    /// has gone on past what that loss gave back (those of earlier losses were made again, or the next connection
    /// showed them arrived): for a replay that stops there — the loss itself, or anything before the next
    /// connection has got that far — each may or may not have arrived.
    pub fn acks_in_doubt(&self) -> u64 {
        self.unsettled_at_loss
    }
}

#[cfg(test)]
mod cases;
#[cfg(test)]
mod tests;
