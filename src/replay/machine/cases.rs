//! Cases found by hand, each a sequence of the broker's answers driven through the machine step by step (the model
//! in `tests.rs` tries every order of them).

use super::*;

/// The case that was found by hand: A and B share a message id and differ; A is replayed and B left, the
/// connection is lost, B comes back redelivered. B is stepped over, not acknowledged as A's lost ack.
#[test]
fn a_left_message_with_the_id_of_a_replayed_one_is_not_acknowledged_after_a_reconnect() {
    let key = Key::Id {
        id: "same".to_owned(),
        origin: Some("q".to_owned()),
    };
    let seen = |content, redelivered| Seen {
        content,
        key: key.clone(),
        redelivered,
        from_this_run: false,
        chosen: true,
        obstacle: None,
    };
    let mut m = Machine::new(2, None);
    m.pass_started();
    assert_eq!(m.delivered(&seen(1, false)), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    assert_eq!(
        m.delivered(&seen(2, false)),
        Step::Leave(Action::CopyOfReplayed)
    );
    m.settled();
    m.connection_lost();
    m.pass_started();
    assert_eq!(m.delivered(&seen(2, true)), Step::Hold);
    assert!(!m.wants_more());
    assert_eq!((m.replayed(), m.left(), m.already_replayed()), (1, 1, 0));
}

/// The acknowledgement after a confirm lost with the connection: the identical copy back is acknowledged once,
/// and a second identical copy is reported, not acknowledged.
#[test]
fn a_lost_acknowledgement_is_made_again_once() {
    let seen = |redelivered| Seen {
        content: 7,
        key: Key::Body {
            body: 7,
            origin: Some("q".to_owned()),
        },
        redelivered,
        from_this_run: false,
        chosen: true,
        obstacle: None,
    };
    let mut m = Machine::new(2, None);
    m.pass_started();
    assert_eq!(m.delivered(&seen(false)), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    m.connection_lost();
    m.pass_started();
    assert!(m.wants_more());
    assert_eq!(m.delivered(&seen(true)), Step::AckAgain);
    assert_eq!(
        m.delivered(&seen(true)),
        Step::Leave(Action::CopyOfReplayed)
    );
    m.settled();
    assert!(!m.wants_more());
    assert_eq!((m.replayed(), m.left(), m.already_replayed()), (1, 1, 1));
}

/// A republish whose confirm was lost with the connection did not use up `--limit`: the message is sent again.
#[test]
fn a_republish_lost_with_the_connection_does_not_count_against_the_limit() {
    let seen = Seen {
        content: 1,
        key: Key::Body {
            body: 1,
            origin: Some("q".to_owned()),
        },
        redelivered: false,
        from_this_run: false,
        chosen: true,
        obstacle: None,
    };
    let mut m = Machine::new(1, Some(1));
    m.pass_started();
    assert_eq!(m.delivered(&seen), Step::Publish);
    m.connection_lost();
    m.pass_started();
    let again = Seen {
        redelivered: true,
        ..seen
    };
    assert_eq!(m.delivered(&again), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    assert_eq!((m.replayed(), m.decided()), (1, 1));
}

/// Only the acknowledgements in flight at the last loss are in doubt: one lost at an earlier loss was either made
/// again or, the next connection going on past it, arrived.
#[test]
fn only_the_acknowledgements_in_flight_at_the_last_loss_are_in_doubt() {
    let seen = |content| Seen {
        content,
        key: Key::Body {
            body: content,
            origin: Some("q".to_owned()),
        },
        redelivered: false,
        from_this_run: false,
        chosen: true,
        obstacle: None,
    };
    let mut m = Machine::new(3, None);
    m.pass_started();
    assert_eq!(m.delivered(&seen(1)), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    m.connection_lost();
    assert_eq!(m.acks_in_doubt(), 1);
    m.pass_started();
    assert_eq!(
        m.acks_in_doubt(),
        1,
        "still in doubt before the next connection has taken anything"
    );
    assert_eq!(m.delivered(&seen(2)), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    m.settled();
    m.connection_lost();
    assert_eq!(m.acks_in_doubt(), 0, "the first one's is not counted again");
    m.pass_started();
    assert_eq!(m.delivered(&seen(3)), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    m.connection_lost();
    assert_eq!(m.acks_in_doubt(), 1);
    // Lost again before the next connection took anything: the one in doubt stays so.
    m.pass_started();
    m.connection_lost();
    assert_eq!(
        m.acks_in_doubt(),
        1,
        "a second loss in a row keeps the first's"
    );
    // Its copy comes back and is acknowledged again, and that acknowledgement is lost too: still one in doubt.
    m.pass_started();
    let mut again = seen(3);
    again.redelivered = true;
    assert_eq!(m.delivered(&again), Step::AckAgain);
    m.connection_lost();
    assert_eq!(m.acks_in_doubt(), 1, "one acknowledgement, not one a loss");
}

/// An acknowledgement that in fact arrived before the loss is owed all the same, and its copy never comes back: the
/// next pass looks no further than the messages the queue held as it began, however many fail meanwhile (a
/// `--rate` slower than the failures would otherwise never end, holding every new failure out of sight).
#[test]
fn an_owed_acknowledgement_is_looked_for_only_among_the_messages_there_when_the_pass_began() {
    let seen = |content, redelivered| Seen {
        content,
        key: Key::Body {
            body: content,
            origin: Some("q".to_owned()),
        },
        redelivered,
        from_this_run: false,
        chosen: true,
        obstacle: None,
    };
    let mut m = Machine::new(2, None);
    m.pass_started();
    assert_eq!(m.delivered(&seen(1, false)), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    m.connection_lost();
    assert!(m.owes());
    m.pass_started();
    // The second message of the snapshot and three that failed since the replay began.
    m.queue_holds(4);
    assert_eq!(m.delivered(&seen(2, false)), Step::Publish);
    assert_eq!(m.outcome(Outcome::Confirmed), Step::Ack);
    for fresh in 3..6 {
        assert!(
            m.wants_more(),
            "message {fresh} was there when the pass began"
        );
        assert_eq!(m.delivered(&seen(fresh, false)), Step::Hold);
    }
    // The lost connection held one message (the first, its acknowledgement in doubt): given back after the count,
    // it would land next, so one more is looked at.
    assert!(m.wants_more());
    assert_eq!(m.delivered(&seen(6, false)), Step::Hold);
    assert!(
        !m.wants_more(),
        "past the messages there when the pass began and those the lost connection held, the owed copy cannot come"
    );
    assert_eq!((m.replayed(), m.decided()), (2, 2));
}
