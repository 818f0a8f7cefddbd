//! The replay loop: one pass over the snapshot per connection, connecting again after a lost one.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use tokio_util::sync::CancellationToken;

use super::decide::Read;
use super::machine::{Machine, Step};
use super::{Action, Item, Plan, Report};
use crate::amqp::fingerprint::Fingerprints;
use crate::amqp::limits;
use crate::amqp::pass::Channels;
use crate::amqp::{BLOCKED_HINT, Broker, Connection, GaveUp, Link, answered, is_blocked, topology};
use crate::error::{Error, Result};
use crate::failpoint;

/// Replays `plan.from`. `progress` is called after each message with (done, snapshot).
///
/// When the connection is lost on the way (the broker restarted, the network broke), the messages it held go back to
/// the dead-letter queue by themselves; it connects again for up to `reconnect_for` and goes on with the snapshot,
/// stepping over the messages it had already looked at and left, and acknowledging (without sending again) a
/// dead-letter copy whose replay the broker had confirmed but whose acknowledgement may have been lost. Out of time,
/// it returns what it did so far with `stopped` and `connection_lost` set. Another error after the first message also
/// returns what was done, with `stopped` set.
pub async fn run(
    connection: &Connection,
    broker: &Broker,
    plan: &Plan,
    reconnect_for: Duration,
    shutdown: &CancellationToken,
    mut progress: impl FnMut(u64, u64),
) -> Result<Report> {
    if let Some((to, why)) = plan
        .to
        .as_deref()
        .and_then(|to| Some((to, topology::not_a_replay_destination(to)?)))
    {
        return Err(Error::Usage(format!("--to {to}: {why}")));
    }
    let depth = topology::queue_depth(connection, &plan.from);
    let mut snapshot = match answered("a look at the queue", plan.broker_timeout, depth).await?? {
        Some((ready, _)) => u64::from(ready),
        None => return Err(Error::QueueNotFound(plan.from.clone())),
    };
    if snapshot == 0 {
        // A quorum queue without a leader counts 0 whatever it holds: a count of 0 is checked by taking one (given
        // back), which such a queue cannot answer (the replay fails, said), rather than reported as an empty queue.
        // The one exception to "the replay marks its queue before it takes anything": a message the count did not
        // see arrived after it (failed just now: no cleanup guard would keep a row for it) and is held a moment.
        let look = crate::amqp::peek::each(connection, &plan.from, 1, plan.broker_timeout, |_| {});
        snapshot = answered("a look at the queue", plan.broker_timeout, look)
            .await??
            .ok_or_else(|| Error::QueueNotFound(plan.from.clone()))?
            .depth;
    }
    let mut state = State {
        plan,
        vhost: broker.vhost().to_owned(),
        user: broker.username().to_owned(),
        frame_max: match usize::try_from(connection.configuration().frame_max()) {
            Ok(0) | Err(_) => usize::MAX,
            Ok(n) => n,
        },
        now: Utc::now(),
        window: TimeDelta::from_std(plan.retention).unwrap_or(TimeDelta::MAX),
        run: uuid::Uuid::new_v4().to_string(),
        fingerprints: Fingerprints::new(),
        machine: Machine::new(snapshot, plan.limit.into_iter().chain(plan.confirmed).min()),
        listed: plan.group.as_ref().map(super::GroupPlan::listed_set),
        pace: plan.rate.map(super::republish::Pace::new),
        channel_closed: false,
        report: Report::begun(plan.from.clone(), plan.dry_run, snapshot),
    };
    let mut link = Link::new(broker, "inboxctl replay", connection, reconnect_for);
    let passes = state.run_passes(&mut link, shutdown, &mut progress).await;
    // Only a replay of everything can tell: a chosen few (ids, a reason, a group, a limit) may all have been met
    // whatever else was held elsewhere, and leave the rest in the queue. A count confirmed at the question is not a
    // choice of the operator's: what the dry run showed them is everything, and what was held meanwhile is unreached.
    let everything = plan.limit.is_none()
        && plan.message_ids.is_empty()
        && plan.reason.is_none()
        && plan.group.is_none();
    if everything && passes.is_ok() && !plan.dry_run {
        let depth = topology::queue_depth(link.current(), &plan.from);
        if let Ok(Ok(Some((ready, _)))) =
            answered("a look at the queue", plan.broker_timeout, depth).await
        {
            state.report.in_queue_after = Some(u64::from(ready));
        }
    }
    topology::unmark_replay(link.current(), &plan.from).await;
    link.close().await;
    passes?;
    let mut report = state.report;
    report.replayed = state.machine.replayed();
    report.left = state.machine.left();
    report.already_replayed = state.machine.already_replayed();
    // Any stop: one that came after a loss, before the next connection got past what the loss gave back (a stop
    // asked for, the lost connection's marker still standing), leaves those acknowledgements in doubt as well.
    if report.interrupted || state.channel_closed {
        report.acks_in_doubt = state.machine.acks_in_doubt();
    }
    let whole = !report.interrupted && report.stopped.is_none();
    report.group = plan.group.as_ref().map(|g| report.check_group(g, whole));
    if whole {
        report.unmatched = report.ids_unmatched(&plan.message_ids);
    }
    if everything && !report.interrupted && report.stopped.is_none() {
        report.unreached = snapshot.saturating_sub(state.machine.decided());
    }
    Ok(report)
}

/// How long a replay that connected again waits for the broker to close its lost connection, whose marker stands
/// until then: RabbitMQ closes a connection whose client went silent after two missed heartbeats (60 s each, by
/// default).
const STALE_MARKER_WAIT: Duration = Duration::from_secs(150);

/// How long a replay that finds its queue empty while another look holds it marked waits for that look to end before
/// it takes the queue for empty; as long as the cleanup's guard waits for another's mark.
const LOOK_WAIT: Duration = Duration::from_secs(10);

/// A replay's progress, kept across reconnects.
pub(super) struct State<'a> {
    pub(super) plan: &'a Plan,
    /// The vhost the replay is connected to.
    pub(super) vhost: String,
    /// The user it publishes as.
    pub(super) user: String,
    /// The connection's frame size: a copy whose properties do not fit one frame would make the broker close it.
    pub(super) frame_max: usize,
    pub(super) now: DateTime<Utc>,
    pub(super) window: TimeDelta,
    /// This run's tag, in [`super::REPLAY_RUN_HEADER`] of every copy it sends.
    pub(super) run: String,
    pub(super) fingerprints: Fingerprints,
    pub(super) machine: Machine,
    /// With `--group`: the listed members' ids, canonical.
    pub(super) listed: Option<std::collections::HashSet<String>>,
    /// With `--rate`: when the next copy may go.
    pub(super) pace: Option<super::republish::Pace>,
    /// A channel closed under the replay, its acknowledgements left in doubt ([`Machine::acks_in_doubt`]): said even
    /// when the replay went on to its end.
    pub(super) channel_closed: bool,
    pub(super) report: Report,
}

impl State<'_> {
    /// One pass per connection until the snapshot is done, connecting again after a lost connection.
    async fn run_passes(
        &mut self,
        link: &mut Link<'_>,
        shutdown: &CancellationToken,
        progress: &mut impl FnMut(u64, u64),
    ) -> Result<()> {
        loop {
            let done_before = self.machine.progress();
            let e = match self.pass(link.current(), shutdown, progress).await {
                Ok(()) => return Ok(()),
                Err(e) if !link.is_lost(&e) => {
                    if self.report.items.is_empty() {
                        return Err(e);
                    }
                    self.report.interrupted = true;
                    self.report.refused = e.exit_code() == crate::error::exit::NO_PERMISSION;
                    self.report.stopped = Some(crate::redact::text(&e.to_string()));
                    return Ok(());
                }
                Err(e) => e,
            };
            self.machine.connection_lost();
            if is_blocked(link.current(), &e) {
                self.stop_lost(format!(
                    "{}: {}; run replay again after",
                    crate::redact::text(&e.to_string()),
                    BLOCKED_HINT
                ));
                return Ok(());
            }
            tracing::warn!(
                error = %e,
                done = self.report.items.len(),
                of = self.report.snapshot,
                "lost the connection to RabbitMQ; connecting again to go on (the messages held go back to {} by themselves)",
                crate::sanitize::text(&self.plan.from)
            );
            let progressed = self.machine.progress() > done_before;
            match link.again(progressed, shutdown).await {
                Ok(()) => self.report.reconnects = link.reconnects(),
                Err(GaveUp::Fruitless(times)) => {
                    self.stop_lost(format!(
                        "the connection was lost {times} times in a row without any progress: {}",
                        crate::redact::text(&e.to_string())
                    ));
                    return Ok(());
                }
                // Why the connection was lost comes first: with `--reconnect-timeout 0`, `last` says only that.
                Err(GaveUp::NotBack(last)) => {
                    self.stop_lost(format!(
                        "{}; not back within {}: {}",
                        crate::redact::text(&e.to_string()),
                        humantime::format_duration(link.within()),
                        crate::redact::text(&last.to_string())
                    ));
                    return Ok(());
                }
            }
        }
    }

    /// Stops the replay on a connection lost for good, saying why.
    fn stop_lost(&mut self, why: String) {
        self.report.interrupted = true;
        self.report.connection_lost = true;
        self.report.stopped = Some(why);
    }

    /// Takes the rest of the snapshot over one connection; gives back what it held and did not replay.
    async fn pass(
        &mut self,
        connection: &Connection,
        shutdown: &CancellationToken,
        progress: &mut impl FnMut(u64, u64),
    ) -> Result<()> {
        self.machine.pass_started();
        // Marked or not (a user who may not configure the marker goes on unmarked): unmarked, the lost connection may
        // not be closed yet, and what it held lands at the head later — which the machine allows for.
        self.mark(connection, shutdown).await?;
        if self.machine.owes() {
            // Marked, the lost connection is closed (its marker gone with it): what it held is back and counted here,
            // or lands at the head soon after (the machine allows for that).
            let depth = topology::queue_depth(connection, &self.plan.from);
            if let Ok(Ok(Some((ready, _)))) =
                answered("a look at the queue", self.plan.broker_timeout, depth).await
            {
                self.machine.queue_holds(u64::from(ready));
            }
        }
        let mut channels = Channels::open(connection, self.plan.broker_timeout).await?;
        let taken = self.take(&mut channels, shutdown, progress).await;
        // A lost connection gives back what it held by itself, and the caller counts what it leaves in doubt.
        if taken
            .as_ref()
            .is_err_and(|e| crate::amqp::is_connection_lost(connection, e))
        {
            return taken;
        }
        // What was held goes back now — on a stop (a refusal), before the caller takes the marker down, so that no
        // moment has those messages out of the cleanup guard's sight with no marker to say why.
        let finished = channels.finish().await;
        match &finished {
            // Answered after every acknowledgement sent on the channel: they all arrived.
            Ok(true) => self.machine.settled(),
            // The connection went meanwhile: the caller takes it for lost and counts what it leaves in doubt (once).
            Err(e) if crate::amqp::is_connection_lost(connection, e) => {}
            Ok(false) if !connection.status().connected() => {}
            // The channel closed under the replay, the connection sound (the broker closes it when messages are
            // held past its `consumer_timeout`): an acknowledgement sent on it, or refused by it, may not have
            // arrived — in doubt, as after a lost connection, its message given back as the channel closed. It
            // used to stay counted as settled: the report said replayed and nothing in doubt, the message in both
            // queues.
            _ => {
                self.machine.connection_lost();
                self.channel_closed = true;
            }
        }
        taken?;
        finished.map(drop)
    }

    /// Says on the broker, for as long as this pass's connection is open, that a replay of the queue is running: the
    /// messages it holds unacknowledged cannot be seen by the cleanup's guard, which keeps the inbox rows their replay
    /// needs, and which refuses to clean while the marker stands. A second replay of the same queue is refused at its
    /// start. After a lost connection, the broker may not yet have closed the old one, whose marker then still
    /// stands, and which still holds what the replay had taken: the replay takes nothing until the broker has closed
    /// it (the marker and those messages go together) and it has marked the queue again.
    ///
    /// Returns whether this connection's marker stands.
    async fn mark(&self, connection: &Connection, shutdown: &CancellationToken) -> Result<bool> {
        let first_pass = self.report.reconnects == 0 && self.report.items.is_empty();
        match self.marked(connection).await? {
            topology::Marker::Set => return Ok(true),
            topology::Marker::Refused => {
                // Refusing to replay would break every role granted before the marker existed: said, and gone on.
                if first_pass {
                    tracing::warn!(
                        marker = %crate::sanitize::text(&topology::replay_marker(&self.plan.from)),
                        "this replay is not marked on the broker (the user may not configure the marker queue; \
                         docs/security.md): a cleanup meanwhile cannot see the messages it holds, and may delete the \
                         inbox rows their replay needs"
                    );
                }
                return Ok(false);
            }
            topology::Marker::Held => {}
        }
        if !first_pass {
            tracing::warn!(
                queue = %crate::sanitize::text(&self.plan.from),
                "the marker of this replay's lost connection still stands: waiting for the broker to close that \
                 connection (it gives back what it held) before taking anything"
            );
            let deadline = tokio::time::Instant::now() + STALE_MARKER_WAIT;
            while tokio::time::Instant::now() < deadline {
                if shutdown.is_cancelled() {
                    // A stop asked for: nothing is taken ([`State::take`] looks first), and the report says so.
                    return Ok(false);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
                match self.marked(connection).await? {
                    topology::Marker::Held => {}
                    marker => return Ok(marker == topology::Marker::Set),
                }
            }
            return Err(Error::Topology(format!(
                "the marker of this replay's lost connection to {} still stood after {}: is another replay of the \
                 queue running?",
                crate::sanitize::text(&self.plan.from),
                humantime::format_duration(STALE_MARKER_WAIT)
            )));
        }
        Err(Error::Topology(format!(
            "another replay of {} is running: wait for it to end (two at once would hold each other's messages \
             out of sight)",
            crate::sanitize::text(&self.plan.from)
        )))
    }

    /// Marks the queue ([`topology::mark_replay`]), waiting for the broker's answer at most `--broker-timeout`.
    async fn marked(&self, connection: &Connection) -> Result<topology::Marker> {
        let mark = topology::mark_replay(connection, &self.plan.from);
        answered("the replay's marker", self.plan.broker_timeout, mark).await?
    }

    async fn take(
        &mut self,
        channels: &mut Channels<'_>,
        shutdown: &CancellationToken,
        progress: &mut impl FnMut(u64, u64),
    ) -> Result<()> {
        let mut looks_until = None;
        while self.machine.wants_more() {
            if shutdown.is_cancelled() {
                self.report.interrupted = true;
                break;
            }
            if let Some(pace) = &self.pace {
                tokio::select! {
                    () = pace.ready() => {}
                    () = shutdown.cancelled() => {
                        self.report.interrupted = true;
                        break;
                    }
                }
            }
            failpoint::hit_with("replay-before-get", &self.machine.decided().to_string()).await;
            let got = channels.get(&self.plan.from).await?;
            // Answered after every acknowledgement sent before it on this channel: those arrived.
            self.machine.settled();
            let Some(delivery) = got else {
                // Another look may hold the rest, to give it back as it ends: a cleanup's guard, whose look took every
                // message while this replay held one out of its sight. Ended now, the replay would give that one back
                // behind the look and take its marker down before the guard reads it again — and the guard would
                // delete the rows the message's replay needs. So the look is waited for, a while.
                let until =
                    *looks_until.get_or_insert_with(|| tokio::time::Instant::now() + LOOK_WAIT);
                if tokio::time::Instant::now() < until
                    && channels.looked_at_elsewhere(&self.plan.from).await
                {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(250)) => continue,
                        () = shutdown.cancelled() => {
                            self.report.interrupted = true;
                            break;
                        }
                    }
                }
                self.machine.queue_empty();
                break;
            };
            let read = self.read(&delivery);
            // Each message it gives back is a return, which quorum queues count before RabbitMQ 4.3: say so of one
            // near a delivery limit.
            if let Some(n) =
                crate::amqp::failure::delivery_count(delivery.properties.headers().as_ref())
                && n >= crate::amqp::peek::WORN
            {
                self.report.most_deliveries = self.report.most_deliveries.max(Some(n));
            }
            match self.machine.delivered(&read.seen) {
                Step::Hold => channels.hold(delivery.delivery_tag),
                Step::AckAgain => channels.ack(delivery.delivery_tag).await?,
                Step::Leave(action) => {
                    channels.hold(delivery.delivery_tag);
                    let error = read.obstacle_error.clone();
                    self.record(read, action, error);
                }
                Step::Publish => self.replay_one(channels, &delivery, read).await?,
                // Only ever the answer to a republish.
                Step::Ack => {}
            }
            progress(self.machine.decided(), self.report.snapshot);
        }
        Ok(())
    }

    /// Keeps what became of one message for the report. Its reason is cut as `failures` and `find` cut it: a queue of
    /// messages whose fault headers run to the frame's size would otherwise be held whole, every one of them, until
    /// the report is printed (the `--reason` filter has matched the whole text already). And masked: another
    /// service's fault may quote a URL with its password.
    pub(super) fn record(&mut self, read: Read, action: Action, error: Option<String>) {
        self.report.items.push(Item {
            message_id: read.message_id,
            reason: read
                .failure
                .reason
                .map(|r| crate::redact::text_cut(&r, limits::MAX_LOGGED_TEXT)),
            failed_at: read.failure.failed_at,
            origin: read.origin,
            replays: read.failure.replays,
            fingerprint: read.fingerprint,
            action,
            error,
        });
    }
}
