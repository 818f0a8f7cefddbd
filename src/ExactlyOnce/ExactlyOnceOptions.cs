namespace ExactlyOnce;

/// <summary>Options of the ExactlyOnce inbox. Validated at startup.</summary>
public sealed class ExactlyOnceOptions
{
    /// <summary>The longest a consumer identity may be; the <c>consumer_type</c> column is <c>varchar(500)</c>.</summary>
    public const int MaxConsumerNameLength = 500;

    private readonly Dictionary<Type, string> _consumerNames = [];

    /// <summary>
    /// How long a delivery waits for another, still uncommitted delivery of the same (message id, consumer)
    /// before it gives up for now and is retried later (never discarded). Default: 30 seconds.
    /// </summary>
    public TimeSpan ClaimTimeout { get; set; } = TimeSpan.FromSeconds(30);

    /// <summary>
    /// How long processed inbox rows are kept before the retention cleanup removes them. A redelivery older
    /// than this is no longer recognised as a duplicate. Default: 7 days.
    /// </summary>
    public TimeSpan InboxRetention { get; set; } = TimeSpan.FromDays(7);

    /// <summary>
    /// Whether EF Core keeps wrapping each <c>SaveChanges</c> inside the inbox's transaction in a savepoint
    /// (<c>Database.AutoSavepointsEnabled</c>). Default: <see langword="false"/>: the inbox turns them off for the duration of
    /// its transaction (and restores the context's own setting afterwards), which saves a <c>SAVEPOINT</c> and a
    /// <c>RELEASE SAVEPOINT</c> (one network round trip) per <c>SaveChanges</c>.
    /// </summary>
    /// <remarks>
    /// The savepoint only matters to a consumer that catches a failed <c>SaveChanges</c> (a <c>DbUpdateException</c>) and
    /// carries on in the same transaction. Without it the failed save's statements are not undone — on PostgreSQL the whole
    /// transaction is aborted — so the inbox treats any failed <c>SaveChanges</c> during the attempt as a failure of the
    /// attempt: it rolls everything back and the delivery is retried in a fresh transaction, exactly as if the consumer had
    /// rethrown. Nothing half-saved is ever committed. Set this to <see langword="true"/> if a consumer must recover from a
    /// failed save and go on (e.g. treat a unique-key violation as "already there"): EF Core then rolls the failed save back
    /// to its savepoint, and the attempt may still commit. Batched mode isolates its members with savepoints of its own
    /// either way.
    /// </remarks>
    public bool KeepSaveChangesSavepoints { get; set; }

    /// <summary>
    /// Whether the inbox prepares its claim statement on PostgreSQL (a server-side prepared statement per physical
    /// connection, kept by Npgsql across pooled uses). Default: <see langword="true"/>: after the first use on a connection
    /// the server skips parsing and planning the claim, which is most of its cost.
    /// </summary>
    /// <remarks>
    /// Set to <see langword="false"/> behind a pooler that does not support prepared statements in transaction mode
    /// (PgBouncer before 1.21, or without <c>max_prepared_statements</c>). Your own statements are prepared only if the
    /// connection string asks for it (Npgsql's <c>Max Auto Prepare</c>); this option does not change them.
    /// </remarks>
    public bool PrepareStatements { get; set; } = true;

    /// <summary>Options of the batched inbox mode (off by default: one transaction per message).</summary>
    public InboxBatchingOptions Batching { get; } = new();

    /// <summary>Options of the transactional outbox and its dispatcher.</summary>
    public Outbox.OutboxOptions Outbox { get; } = new();

    /// <summary>Options of the retention cleanup, the statistics and the health checks.</summary>
    public Maintenance.MaintenanceOptions Maintenance { get; } = new();

    /// <summary>Explicit consumer identities, keyed by consumer type; they override <see cref="ConsumerIdentityAttribute"/>.</summary>
    public IReadOnlyDictionary<Type, string> ConsumerNames => _consumerNames;

    /// <summary>
    /// Gives <typeparamref name="TConsumer"/> an explicit, stable identity (the deduplication scope), so that
    /// renaming the class or its queue does not reset deduplication.
    /// </summary>
    public ExactlyOnceOptions MapConsumer<TConsumer>(string name) => MapConsumer(typeof(TConsumer), name);

    /// <summary>Gives <paramref name="consumerType"/> an explicit, stable identity.</summary>
    public ExactlyOnceOptions MapConsumer(Type consumerType, string name)
    {
        ArgumentNullException.ThrowIfNull(consumerType);
        ArgumentNullException.ThrowIfNull(name);
        _consumerNames[consumerType] = name;
        return this;
    }
}
