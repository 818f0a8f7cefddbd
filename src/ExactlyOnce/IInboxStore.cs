namespace ExactlyOnce;

/// <summary>
/// The consumer's own unit of work, seen by the inbox protocol: one instance per consume scope, sharing the
/// connection and transaction that the consumer's code uses. Implemented by <c>ExactlyOnce.EntityFrameworkCore</c>.
/// </summary>
public interface IInboxStore
{
    /// <summary>
    /// Runs <paramref name="attempt"/> under the store's resilience policy (for EF Core: the execution strategy).
    /// Each invocation of <paramref name="attempt"/> must be able to start a fresh transaction.
    /// </summary>
    Task<TResult> ExecuteAsync<TResult>(Func<CancellationToken, Task<TResult>> attempt, CancellationToken cancellationToken = default);

    /// <summary>Begins the unit of work's transaction, discarding anything a previous attempt left tracked.</summary>
    Task BeginAsync(CancellationToken cancellationToken = default);

    /// <summary>
    /// Claims <paramref name="key"/> inside the transaction with an insert that does nothing on conflict.
    /// Blocks while another transaction holds an uncommitted claim of the same key, at most <paramref name="timeout"/>.
    /// </summary>
    /// <remarks>
    /// The row is inserted already marked processed at <paramref name="processedAtUtc"/>: no other transaction can see it
    /// before this one commits, and this one commits only together with the consumer's effects, so a visible row is a
    /// processed message and no second write of the row is needed.
    /// </remarks>
    /// <returns><see langword="true"/> if this transaction now owns the claim; <see langword="false"/> if a committed claim exists (a duplicate).</returns>
    /// <exception cref="InboxClaimTimeoutException">The other transaction held the claim longer than <paramref name="timeout"/>.</exception>
    /// <exception cref="InboxSchemaMissingException">The inbox table does not exist.</exception>
    Task<bool> TryClaimAsync(InboxKey key, DateTime receivedAtUtc, DateTime processedAtUtc, TimeSpan timeout, CancellationToken cancellationToken = default);

    /// <summary>Saves the consumer's pending changes and commits them with the claim, in the one transaction.</summary>
    Task CompleteAsync(CancellationToken cancellationToken = default);

    /// <summary>Rolls the transaction back (nothing of this attempt remains) and releases it.</summary>
    Task RollbackAsync(CancellationToken cancellationToken = default);
}
