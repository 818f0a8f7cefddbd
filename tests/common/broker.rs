//! RabbitMQ as the tests see it: the Parcel Tracker's topology, publishing with confirms, taking messages off a
//! queue, and the broker's own books through `rabbitmqctl`.

use std::process::Command;

use lapin::options::{
    BasicGetOptions, BasicNackOptions, ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Connection};

use super::{TestEnv, amqp_base};

pub const CARRIER_QUEUE: &str = "parcel-created-carrier";
pub const NOTIFICATION_QUEUE: &str = "parcel-created-notification";
pub const EVENT_EXCHANGE: &str = "ParcelTracker.Domain.Events:ParcelCreatedEvent";

/// Closes the connection in `vhost` whose client properties name `client` (inboxctl names each, e.g. "inboxctl
/// replay", "inboxctl consume carrier"), from the broker's side, as `rabbitmqctl close_connection` does for an
/// operator.
///
/// Found and closed in one expression through the test process's own Erlang node (milliseconds, where the two
/// `rabbitmqctl` calls it took before cost seconds on a loaded box, inside a failpoint's hold). A consumer's
/// dead-letter connection ("… (dead letters)") is not taken for its consuming one.
pub fn close_connection(vhost: &str, client: &str) {
    let not_the_dead_letters = if client.contains("(dead letters)") {
        String::new()
    } else {
        format!(
            ", binary:match(N, {}) =:= nomatch",
            super::erl::binary("(dead letters)")
        )
    };
    // A connection of another test that closes between `connections()` and `connection_info` exits that call:
    // `catch` passes over it.
    let expression = format!(
        "case [P || P <- rabbit_networking:connections(), \
               [{{vhost, V}}, {{client_properties, CP}}] <- \
                 [(catch rabbit_networking:connection_info(P, [vhost, client_properties]))], \
               V =:= {}, {{_, _, N}} <- [lists:keyfind(<<\"connection_name\">>, 1, CP)], is_binary(N), \
               binary:match(N, {}) =/= nomatch{not_the_dead_letters}] of \
           [P | _] -> rabbit_networking:close_connection(P, \"cut by the test\"), closed; \
           [] -> none end.",
        super::erl::binary(vhost),
        super::erl::binary(client)
    );
    match super::erl::eval(&expression) {
        Some(out) => assert_eq!(out.trim(), "closed", "no {client:?} connection in {vhost}"),
        None => close_connection_by_pid(&connection_pid(vhost, client)),
    }
}

/// The broker's name for the connection `client` holds in `vhost`: found ahead, it lets a test close that connection
/// with one `rabbitmqctl` call when the moment comes (each call takes from half a second to seconds on a loaded box).
pub fn connection_pid(vhost: &str, client: &str) -> String {
    let listing = rabbitmqctl(&[
        "-q",
        "list_connections",
        "pid",
        "vhost",
        "client_properties",
    ]);
    listing
        .lines()
        .find(|l| {
            l.split('\t').nth(1) == Some(vhost)
                && l.contains(client)
                && (client.contains("(dead letters)") || !l.contains("(dead letters)"))
        })
        .and_then(|l| l.split('\t').next())
        .unwrap_or_else(|| panic!("no {client:?} connection in {vhost}:\n{listing}"))
        .to_owned()
}

pub fn close_connection_by_pid(pid: &str) {
    rabbitmqctl(&["close_connection", pid, "cut by the test"]);
}

pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An Erlang expression for `(ready, unacknowledged)` of a queue (`none` when it does not exist), from the broker's
/// own books. A quorum queue's are read from its leader: `list_queues` shows a quorum queue's counts as of the last
/// statistics tick, up to seconds old.
pub fn queue_counts_expression(vhost: &str, queue: &str) -> String {
    format!(
        "case rabbit_amqqueue:lookup(rabbit_misc:r({}, queue, {})) of \
           {{ok, Q}} -> case amqqueue:get_type(Q) of \
             rabbit_quorum_queue -> \
               {{ok, {{_, O}}, _}} = ra:leader_query(amqqueue:get_pid(Q), fun rabbit_fifo:overview/1), \
               {{maps:get(num_ready_messages, O), maps:get(num_checked_out, O)}}; \
             _ -> \
               [{{_, R}}, {{_, U}}] = rabbit_amqqueue:info(Q, [messages_ready, messages_unacknowledged]), \
               {{R, U}} end; \
           _ -> none end.",
        super::erl::binary(vhost),
        super::erl::binary(queue)
    )
}

/// The counts [`queue_counts_expression`] printed; `None` for `none`.
pub fn parse_queue_counts(out: &str) -> Option<(u64, u64)> {
    let (ready, unacked) = out
        .trim()
        .strip_prefix('{')
        .and_then(|o| o.strip_suffix('}'))
        .and_then(|o| o.split_once(','))?;
    Some((
        ready.trim().parse().unwrap(),
        unacked.trim().parse().unwrap(),
    ))
}

impl TestEnv {
    /// `(ready, unacknowledged)` of a queue, from the broker's own books. A quorum queue's are read from its
    /// leader: `list_queues` shows a quorum queue's counts as of the last statistics tick, up to seconds old.
    pub fn queue_counts(&self, queue: &str) -> (u64, u64) {
        let expression = queue_counts_expression(&self.vhost, queue);
        let out = super::erl::eval(&expression)
            .unwrap_or_else(|| rabbitmqctl(&["-q", "eval", &expression]));
        match parse_queue_counts(&out) {
            Some(counts) => counts,
            None => panic!("queue {queue} not found in vhost {}: {out}", self.vhost),
        }
    }

    /// `host:port` of the broker, for [`super::raw_amqp`].
    pub fn amqp_addr(&self) -> String {
        let url = url::Url::parse(&amqp_base()).unwrap();
        format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5672))
    }

    /// Whether a queue exists in the vhost.
    pub fn queue_exists(&self, queue: &str) -> bool {
        let expression = format!(
            "case rabbit_amqqueue:lookup(rabbit_misc:r({}, queue, {})) of {{ok, _}} -> yes; _ -> no end.",
            super::erl::binary(&self.vhost),
            super::erl::binary(queue)
        );
        let out = super::erl::eval(&expression)
            .unwrap_or_else(|| rabbitmqctl(&["-q", "eval", &expression]));
        match out.trim() {
            "yes" => true,
            "no" => false,
            other => panic!("is {queue} in {}? {other}", self.vhost),
        }
    }
}

/// Declares the MassTransit topology of both Parcel Tracker endpoints in the test's vhost.
pub async fn ensure_endpoints(env: &TestEnv) {
    let conn = env.amqp().await;
    for queue in [CARRIER_QUEUE, NOTIFICATION_QUEUE] {
        inboxctl::amqp::topology::ensure_endpoint(
            &conn,
            EVENT_EXCHANGE,
            queue,
            super::queue_type(),
        )
        .await
        .unwrap();
    }
    let _ = conn.close(200, "OK".into()).await;
}

/// Publishes with publisher confirms to an exchange (`""` for the default exchange, routing by queue name).
pub async fn publish(
    conn: &Connection,
    exchange: &str,
    routing_key: &str,
    props: BasicProperties,
    body: &[u8],
) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let routed =
        inboxctl::amqp::publish::publish_confirmed(&channel, exchange, routing_key, body, props)
            .await
            .unwrap();
    assert_eq!(
        routed,
        inboxctl::amqp::publish::Routed::Queued,
        "the broker must route and confirm it"
    );
    let _ = channel.close(200, "OK".into()).await;
}

/// Publishes `copies` copies of one body at once (confirms awaited together).
pub async fn publish_copies(
    conn: &Connection,
    exchange: &str,
    props: BasicProperties,
    body: &[u8],
    copies: usize,
) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // Not awaited one by one: the copies go out back to back and are confirmed together below.
    let mut pending = Vec::with_capacity(copies);
    for _ in 0..copies {
        pending.push(
            inboxctl::amqp::publish::publish(&channel, exchange, "", body, props.clone())
                .await
                .unwrap(),
        );
    }
    for confirm in pending {
        assert_eq!(
            inboxctl::amqp::publish::confirmed(confirm).await.unwrap(),
            inboxctl::amqp::publish::Routed::Queued,
            "the broker must route and confirm every copy"
        );
    }
    let _ = channel.close(200, "OK".into()).await;
}

/// Declares a durable queue bound to a fanout exchange (both declared if absent) and returns its name.
pub async fn capture_queue(conn: &Connection, exchange: &str, queue: &str) {
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let _ = channel.close(200, "OK".into()).await;
}

/// Declares a durable queue that the broker refuses every message for (`x-max-length=0`,
/// `x-overflow=reject-publish`): a publish routed to it is nacked.
pub async fn declare_queue_that_refuses_everything(conn: &Connection, queue: &str) {
    let channel = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish")),
    );
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();
    let _ = channel.close(200, "OK".into()).await;
}

/// Takes every message from a queue (acknowledging each).
pub async fn drain(conn: &Connection, queue: &str) -> Vec<lapin::message::Delivery> {
    let channel = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(msg) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        out.push(msg.delivery);
    }
    let _ = channel.close(200, "OK".into()).await;
    out
}

pub fn header_text(props: &BasicProperties, key: &str) -> Option<String> {
    match props.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        other => Some(format!("{other:?}")),
    }
}

/// Reads every message of a queue without taking it: fetched unacknowledged, then all given back.
pub async fn peek(conn: &Connection, queue: &str) -> Vec<lapin::message::Delivery> {
    let channel = conn.create_channel().await.unwrap();
    let mut out = Vec::new();
    while let Some(m) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
    {
        out.push(m.delivery);
    }
    if let Some(last) = out.last() {
        channel
            .basic_nack(
                last.delivery_tag,
                BasicNackOptions {
                    multiple: true,
                    requeue: true,
                },
            )
            .await
            .unwrap();
    }
    let _ = channel.close(200, "OK".into()).await;
    out
}

/// A user management call on the shared broker: through the test process's own Erlang node ([`super::erl::eval`]),
/// the same function `rabbitmqctl` calls, without booting a VM for it; through `rabbitmqctl` when that node cannot
/// reach the broker.
fn manage(expression: String, cli: &[&str]) {
    if super::erl::eval(&expression).is_none() {
        rabbitmqctl(cli);
    }
}

const ACTING_USER: &str = "<<\"inboxctl-tests\">>";

/// `rabbitmqctl add_user`.
pub fn add_user(name: &str, password: &str) {
    use super::erl::binary;
    manage(
        format!(
            "ok = rabbit_auth_backend_internal:add_user({}, {}, {ACTING_USER}).",
            binary(name),
            binary(password)
        ),
        &["-q", "add_user", name, password],
    );
}

/// `rabbitmqctl set_permissions -p vhost user configure write read` (replacing what the user had there).
pub fn set_permissions(vhost: &str, user: &str, configure: &str, write: &str, read: &str) {
    use super::erl::binary;
    manage(
        format!(
            "ok = rabbit_auth_backend_internal:set_permissions({}, {}, {}, {}, {}, {ACTING_USER}).",
            binary(user),
            binary(vhost),
            binary(configure),
            binary(write),
            binary(read)
        ),
        &[
            "-q",
            "set_permissions",
            "-p",
            vhost,
            user,
            configure,
            write,
            read,
        ],
    );
}

/// `rabbitmqctl clear_permissions -p vhost user`.
pub fn clear_permissions(vhost: &str, user: &str) {
    use super::erl::binary;
    manage(
        format!(
            "ok = rabbit_auth_backend_internal:clear_permissions({}, {}, {ACTING_USER}).",
            binary(user),
            binary(vhost)
        ),
        &["-q", "clear_permissions", "-p", vhost, user],
    );
}

/// `rabbitmqctl delete_user`; a user already gone is no failure (a clean-up).
pub fn delete_user(name: &str) {
    let expression = format!(
        "catch rabbit_auth_backend_internal:delete_user({}, {ACTING_USER}), ok.",
        super::erl::binary(name)
    );
    if super::erl::eval(&expression).is_none() {
        let _ = Command::new("rabbitmqctl")
            .args(["-q", "delete_user", name])
            .output();
    }
}
