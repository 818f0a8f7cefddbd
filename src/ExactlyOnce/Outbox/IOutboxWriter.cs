namespace ExactlyOnce.Outbox;

/// <summary>Writes outgoing messages into the current unit of work (scoped): they commit with it or not at all.</summary>
public interface IOutboxWriter
{
    /// <summary>Adds <paramref name="entry"/> to the unit of work; it is stored when the unit of work saves.</summary>
    void Add(OutboxEntry entry);
}

/// <summary>The dispatcher's view of the stored outbox.</summary>
public interface IOutboxStore
{
    /// <summary>
    /// Opens a transaction and claims up to <paramref name="batchSize"/> pending rows that are due, in sequence order,
    /// locking them so that other dispatchers skip them. Dispose the batch to release them.
    /// </summary>
    Task<IOutboxBatch> ClaimAsync(int batchSize, DateTime nowUtc, CancellationToken cancellationToken = default);

    /// <summary>Waits for a cross-process commit notification (PostgreSQL NOTIFY), or returns when not supported.</summary>
    Task ListenAsync(Action onNotification, CancellationToken cancellationToken = default);
}

/// <summary>A claimed batch of pending rows, held under lock by one dispatcher transaction.</summary>
public interface IOutboxBatch : IAsyncDisposable
{
    /// <summary>The claimed rows, in sequence order.</summary>
    IReadOnlyList<OutboxEntry> Entries { get; }

    /// <summary>Marks the published rows dispatched, records the failures with their next attempt, and commits.</summary>
    Task CompleteAsync(IReadOnlyCollection<long> dispatched, IReadOnlyCollection<OutboxFailure> failed, DateTime nowUtc, CancellationToken cancellationToken = default);
}

/// <summary>A row whose publish failed.</summary>
/// <param name="Sequence">The row.</param>
/// <param name="Error">The error, kept as the row's last error.</param>
/// <param name="NextAttemptAtUtc">When the row is due again.</param>
public sealed record OutboxFailure(long Sequence, string Error, DateTime NextAttemptAtUtc);

/// <summary>Publishes one stored outbox entry to the broker, with the entry's message id, and returns once the broker confirmed it.</summary>
public interface IOutboxTransport
{
    /// <summary>Publishes (or sends, when it has a destination) <paramref name="entry"/>.</summary>
    Task SendAsync(OutboxEntry entry, CancellationToken cancellationToken = default);
}
