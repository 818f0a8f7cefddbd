namespace ExactlyOnce;

/// <summary>
/// The batched side of a consume scope's unit of work (see <see cref="InboxBatcher"/>). The same per-scope store acts
/// as a member (its consumer's context joins a batch's connection and transaction) and, for the first member of a
/// batch, opens the batch itself on a unit of work of its own.
/// </summary>
internal interface IInboxBatchStore : IInboxStore
{
    /// <summary>Creates the batch's own unit of work (its own scope and connection), not yet begun.</summary>
    Task<IInboxBatch> CreateBatchAsync(CancellationToken cancellationToken = default);

    /// <summary>Makes this scope's context use the batch's connection and current transaction, with a clean change tracker.</summary>
    Task JoinBatchAsync(IInboxBatch batch, CancellationToken cancellationToken = default);

    /// <summary>Saves what the consumer left pending, inside the batch's transaction (and the member's savepoint).</summary>
    Task SaveBatchMemberAsync(CancellationToken cancellationToken = default);

    /// <summary>Detaches this scope's context from the batch, so it can be used (or returned to a pool) on its own again.</summary>
    Task LeaveBatchAsync();
}

/// <summary>The one transaction a batch of deliveries shares. Used by one task at a time.</summary>
internal interface IInboxBatch : IAsyncDisposable
{
    /// <summary>Runs one attempt of the whole batch under the store's resilience policy (for EF Core: the execution strategy).</summary>
    Task<TResult> ExecuteAsync<TResult>(Func<CancellationToken, Task<TResult>> attempt, CancellationToken cancellationToken = default);

    /// <summary>Begins the batch's transaction.</summary>
    Task BeginAsync(CancellationToken cancellationToken = default);

    /// <summary>
    /// Claims every key in one statement (PostgreSQL) or one transaction (SQLite), in a fixed key order so overlapping
    /// batches cannot deadlock on each other's claims. Blocks on uncommitted claims of other transactions, at most
    /// <paramref name="timeout"/>. The keys must be distinct.
    /// </summary>
    /// <remarks>Each row is inserted already marked processed (see <see cref="IInboxStore.TryClaimAsync"/>); a member that fails has its row deleted.</remarks>
    /// <returns>The keys this transaction now owns; the others have committed claims (duplicates).</returns>
    /// <exception cref="InboxClaimTimeoutException">A wait outlasted <paramref name="timeout"/>, or the claim deadlocked.</exception>
    Task<IReadOnlySet<InboxKey>> ClaimAsync(IReadOnlyList<InboxKey> keys, IReadOnlyList<DateTime> receivedAtUtc, DateTime processedAtUtc, TimeSpan timeout, CancellationToken cancellationToken = default);

    /// <summary>Sets the savepoint that separates member <paramref name="member"/>'s effects from the others'.</summary>
    Task SavepointAsync(int member, CancellationToken cancellationToken = default);

    /// <summary>Rolls member <paramref name="member"/>'s effects back to its savepoint and drops its claim, so a retry can claim again.</summary>
    Task RollbackMemberAsync(int member, InboxKey key, CancellationToken cancellationToken = default);

    /// <summary>Commits the surviving members' claims and effects; then wakes the outbox dispatchers if a member wrote outbox rows.</summary>
    Task CompleteAsync(CancellationToken cancellationToken = default);

    /// <summary>Rolls the whole transaction back, if one is open. Never throws for a connection that is already gone.</summary>
    Task RollbackAsync();
}
