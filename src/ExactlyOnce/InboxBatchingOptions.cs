namespace ExactlyOnce;

/// <summary>
/// Options of the batched inbox mode: deliveries of one consumer that arrive together are processed in one
/// transaction (one claim statement, one savepoint per message, one commit). Off by default.
/// </summary>
public sealed class InboxBatchingOptions
{
    /// <summary>
    /// Whether every endpoint with the inbox uses batched mode. Default: <see langword="false"/> (one transaction per
    /// message). An endpoint can choose for itself with <c>UseExactlyOnceInbox(context, batched: true)</c>.
    /// </summary>
    public bool Enabled { get; set; }

    /// <summary>
    /// The most deliveries one batch holds. Keep it below the endpoint's <c>ConcurrentMessageLimit</c> so the next batch
    /// can fill while one commits, and well below 64: each message takes a PostgreSQL subtransaction (the batch's savepoint
    /// for it; one more per <c>SaveChanges</c> with <see cref="ExactlyOnceOptions.KeepSaveChangesSavepoints"/>), and more
    /// than 64 in one transaction slow down every snapshot on the server. Default: 10.
    /// </summary>
    public int MaxBatchSize { get; set; } = 10;

    /// <summary>
    /// The longest a batch waits for more deliveries after its first one arrived. A batch only waits while another batch
    /// of the same consumer is running (and starts as soon as that one ends); with none running a delivery does not wait
    /// at all. Default: 5 milliseconds.
    /// </summary>
    public TimeSpan MaxWait { get; set; } = TimeSpan.FromMilliseconds(5);
}
