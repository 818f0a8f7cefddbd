//! Message ids as producers make them: MassTransit's NewId (what a .NET publisher sends), UUIDv7, or random v4. How
//! they lie in PostgreSQL's `uuid` order decides where the inbox's primary key takes its inserts: at one right-hand
//! edge (time first: v7), at one edge per slot (NewId, below), or anywhere (v4).
//!
//! A NewId as a `Guid` string (MassTransit's `NewId.NextGuid()`, captured in `tests/fixtures/interop/`:
//! `1a280000-161d-4c08-9e18-08df4f1e91b6`) holds, byte by byte: 0–7 the generating process (constant for a process),
//! 8–9 the low 16 bits of the time, 10–15 its high 48 bits, the time being .NET ticks (100 ns since 0001-01-01 UTC)
//! plus a sequence within a tick. In `uuid` order the process comes first, then the low bits, which wrap every 6.5
//! ms: one process's ids enter 65,536 places of the key at once.

use std::sync::Mutex;
use std::sync::OnceLock;

use uuid::Uuid;

/// Which ids a producer makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdKind {
    /// MassTransit's NewId, as `NewId.NextGuid()` writes it (what a MassTransit publisher sends).
    #[default]
    NewId,
    /// UUIDv7: the time first, in milliseconds.
    V7,
    /// Random (v4).
    V4,
}

impl IdKind {
    pub fn next(self) -> Uuid {
        match self {
            IdKind::NewId => new_id(),
            IdKind::V7 => Uuid::now_v7(),
            IdKind::V4 => Uuid::new_v4(),
        }
    }
}

/// .NET ticks between 0001-01-01 and the Unix epoch.
const UNIX_EPOCH_TICKS: u64 = 621_355_968_000_000_000;

/// This process's NewId part (bytes 0–7), chosen at random at its first NewId unless pinned.
static PROCESS: OnceLock<[u8; 8]> = OnceLock::new();

/// Makes this process's NewIds carry `process` as their first 8 bytes, as another process's would: for a benchmark
/// that continues the ids an earlier process wrote into an inbox, so that its new ids land among them. Returns
/// false, changing nothing, if a NewId was made or the part pinned before.
pub fn pin_new_id_process(process: [u8; 8]) -> bool {
    PROCESS.set(process).is_ok()
}

/// The next NewId of this process: its time in ticks, one past the last if the clock has not moved on.
pub fn new_id() -> Uuid {
    static LAST: Mutex<u64> = Mutex::new(0);
    let process = PROCESS.get_or_init(|| {
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&Uuid::new_v4().as_bytes()[..8]);
        bytes
    });
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos() / 100).unwrap_or(u64::MAX));
    let ticks = {
        let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
        *last = (UNIX_EPOCH_TICKS + now).max(*last + 1);
        *last
    };
    from_parts(*process, ticks)
}

fn from_parts(process: [u8; 8], ticks: u64) -> Uuid {
    let t = ticks.to_be_bytes();
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&process);
    bytes[8..10].copy_from_slice(&t[6..8]);
    bytes[10..16].copy_from_slice(&t[..6]);
    Uuid::from_bytes(bytes)
}

/// The ticks a NewId carries (see the module documentation); meaningful only for an id that is one.
pub fn new_id_ticks(id: Uuid) -> u64 {
    let b = id.as_bytes();
    let mut t = [0u8; 8];
    t[..6].copy_from_slice(&b[10..16]);
    t[6..8].copy_from_slice(&b[8..10]);
    u64::from_be_bytes(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ticks of MassTransit's own ids, from the captured messages, against the `sentTime` MassTransit wrote
    /// beside each: the same moment to within a few milliseconds.
    #[test]
    fn the_layout_is_masstransits() {
        for (id, sent_ticks) in [
            // 2026-11-30T20:14:42.2177304Z and 2026-11-30T20:14:42.3788142Z, in ticks.
            (
                "1a280000-161d-4c08-9e18-08df4f1e91b6",
                639_316_664_822_177_304_u64,
            ),
            (
                "1a280000-161d-4c08-326e-08df4f1e91cf",
                639_316_664_823_788_142,
            ),
        ] {
            let ticks = new_id_ticks(Uuid::parse_str(id).expect("uuid"));
            let apart = ticks.abs_diff(sent_ticks);
            assert!(
                apart < 50_000,
                "{id}: {ticks} vs {sent_ticks}: {apart} ticks apart"
            );
        }
    }

    #[test]
    fn a_processs_new_ids_share_its_prefix_grow_in_time_and_never_repeat() {
        let ids: Vec<Uuid> = (0..1000).map(|_| new_id()).collect();
        assert!(
            ids.iter()
                .all(|id| id.as_bytes()[..8] == ids[0].as_bytes()[..8])
        );
        let ticks: Vec<u64> = ids.iter().map(|id| new_id_ticks(*id)).collect();
        assert!(ticks.windows(2).all(|w| w[0] < w[1]));
        let now = UNIX_EPOCH_TICKS
            + u64::try_from(chrono::Utc::now().timestamp_micros()).expect("after 1970") * 10;
        assert!(
            now.abs_diff(ticks[999]) < 10_000_000,
            "within a second of now"
        );
        assert_eq!(
            from_parts([1; 8], ticks[0]),
            Uuid::from_bytes({
                let mut b = *ids[0].as_bytes();
                b[..8].copy_from_slice(&[1; 8]);
                b
            })
        );
    }

    /// Each test runs in a process of its own (the suite runs under nextest), so nothing made a NewId before.
    #[test]
    fn a_pinned_process_part_is_every_new_ids_and_cannot_be_changed_after() {
        let part = [0x1a, 0x28, 0, 0, 0x16, 0x1d, 0x4c, 0x08];
        assert!(pin_new_id_process(part));
        let id = new_id();
        assert_eq!(id.as_bytes()[..8], part);
        assert!(id.to_string().starts_with("1a280000-161d-4c08-"));
        assert!(!pin_new_id_process([2; 8]), "pinned once");
        assert_eq!(new_id().as_bytes()[..8], part);
    }
}
