//! The consumer's own rules, apart from any server: batch workers, how an error is told, retry delays, type names.

use super::*;

/// Two batches at once at least, so that one's round trips overlap the other's gathering and acknowledgement;
/// more for a concurrency that asks for more; one only where one message at a time was asked for.
#[test]
fn batch_workers_overlap_two_batches_unless_one_at_a_time_was_asked_for() {
    assert_eq!(batch_workers(16, 32), 2);
    assert_eq!(batch_workers(8, 8), 2);
    assert_eq!(batch_workers(64, 32), 2);
    assert_eq!(batch_workers(128, 32), 4);
    assert_eq!(batch_workers(100, 32), 4);
    assert_eq!(batch_workers(1, 8), 1);
}

/// A work's own error with a cause under it, as a client library's is.
#[derive(Debug)]
struct Outer(std::io::Error);

impl std::fmt::Display for Outer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("booking the pickup failed")
    }
}

impl std::error::Error for Outer {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// A work's own error (`WorkError::Failed`) is told with its causes: they used to stop at the work's error, so a
/// carrier client's "request failed" came without the "connection refused" under it.
#[test]
fn a_works_error_is_told_with_its_causes() {
    let inner = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
    let failed =
        crate::inbox::ProcessError::Failed(crate::inbox::WorkError::Failed(Box::new(Outer(inner))));
    assert_eq!(
        error_chain(&failed),
        "booking the pickup failed\ncaused by: connection refused"
    );
}

/// A work's cause that shows a URL with its password (a client library's error): the reason kept in the
/// dead-letter copy and the events shows it masked.
#[test]
fn a_works_causes_are_told_without_a_password() {
    let inner = std::io::Error::other(
        "POST https://ops:hunter2-carrier@carrier.test/pickups: connection refused",
    );
    let failed = crate::inbox::WorkError::Failed(Box::new(Outer(inner)));
    let told = error_chain(&failed);
    assert!(!told.contains("hunter2-carrier"), "{told}");
    assert!(
        told.contains("https://ops:***@carrier.test/pickups: connection refused"),
        "{told}"
    );
}

/// A work's error whose `source()` is itself: its chain is told up to a bound, not followed for ever.
#[test]
fn an_error_whose_causes_loop_is_told_to_a_bound() {
    let told = error_chain(&crate::LoopingError);
    assert_eq!(told, "a loop\ncaused by: … (more causes not shown)");
}

#[test]
fn an_id_property_with_blanks_around_it_is_the_id_the_envelope_reader_reads() {
    let id = Uuid::new_v4();
    let properties = lapin::BasicProperties::default().with_message_id(format!(" {id}\n").into());
    assert_eq!(property_id(&properties), Some(id));
    assert_eq!(
        crate::amqp::envelope::parse(&properties, b"{}")
            .ok()
            .map(|m| m.message_id),
        Some(id)
    );
}

#[test]
fn retry_delays_double_up_to_the_cap() {
    let first = Duration::from_millis(200);
    assert_eq!(retry_delay(first, 1), Duration::from_millis(200));
    assert_eq!(retry_delay(first, 2), Duration::from_millis(400));
    assert_eq!(retry_delay(first, 3), Duration::from_millis(800));
    assert_eq!(retry_delay(first, 40), MAX_RETRY_DELAY);
}

struct Parcel;
impl Consumer for Parcel {
    type Message = serde_json::Value;
    const MESSAGE_TYPE: &'static str = "urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent";
    async fn consume<'c>(
        &'c self,
        _tx: &'c mut PgConnection,
        _context: &'c MessageContext,
        _message: &'c Self::Message,
    ) -> Result<(), WorkError> {
        Ok(())
    }
}

#[test]
fn a_consumer_handles_its_type_in_any_spelling_and_untyped_json() {
    let t = |s: &str| vec![s.to_owned()];
    assert!(Parcel::handles(&[]));
    assert!(Parcel::handles(&t(
        "urn:message:ParcelTracker.Domain.Events:ParcelCreatedEvent"
    )));
    assert!(Parcel::handles(&t(
        "ParcelTracker.Domain.Events.ParcelCreatedEvent"
    )));
    assert!(Parcel::handles(&t("ParcelCreatedEvent")));
    assert!(!Parcel::handles(&t(
        "urn:message:ParcelTracker.Domain.Events:ParcelLabelPrinted"
    )));
}
