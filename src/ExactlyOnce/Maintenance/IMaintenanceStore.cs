namespace ExactlyOnce.Maintenance;

/// <summary>What the retention cleanup, the gauges and the health checks need from the store.</summary>
public interface IMaintenanceStore
{
    /// <summary>Deletes at most <paramref name="batchSize"/> processed inbox rows processed before <paramref name="cutoffUtc"/>; rows another instance is deleting are skipped.</summary>
    Task<int> DeleteProcessedInboxAsync(DateTime cutoffUtc, int batchSize, CancellationToken cancellationToken = default);

    /// <summary>Deletes at most <paramref name="batchSize"/> outbox rows dispatched before <paramref name="cutoffUtc"/>.</summary>
    Task<int> DeleteDispatchedOutboxAsync(DateTime cutoffUtc, int batchSize, CancellationToken cancellationToken = default);

    /// <summary>Reads the statistics: an estimate of the inbox rows, the pending outbox rows and the oldest one's creation time.</summary>
    Task<ExactlyOnceStatistics> ReadStatisticsAsync(CancellationToken cancellationToken = default);
}

/// <summary>A snapshot of the tables' state.</summary>
/// <param name="InboxRows">Inbox rows (an estimate on PostgreSQL: the planner's statistics, so reading it costs nothing).</param>
/// <param name="OutboxPending">Outbox rows not yet dispatched.</param>
/// <param name="OldestPendingCreatedAtUtc">When the oldest pending outbox row was written; null when none is pending.</param>
public sealed record ExactlyOnceStatistics(long InboxRows, long OutboxPending, DateTime? OldestPendingCreatedAtUtc);
