namespace ExactlyOnce.Maintenance;

/// <summary>Options of the retention cleanup and of the statistics behind the gauges and health checks.</summary>
public sealed class MaintenanceOptions
{
    /// <summary>How often the cleanup runs (it repeats at once while batches come back full). Default: 5 minutes.</summary>
    public TimeSpan CleanupInterval { get; set; } = TimeSpan.FromMinutes(5);

    /// <summary>Rows deleted per statement; bounds every delete's locks and duration. Default: 1000.</summary>
    public int CleanupBatchSize { get; set; } = 1000;

    /// <summary>How often the gauges' statistics (inbox rows, outbox backlog) are refreshed. Default: 15 seconds.</summary>
    public TimeSpan StatisticsInterval { get; set; } = TimeSpan.FromSeconds(15);

    /// <summary>Health: the oldest pending outbox row may be at most this old. Default: 5 minutes.</summary>
    public TimeSpan OutboxBacklogThreshold { get; set; } = TimeSpan.FromMinutes(5);

    /// <summary>Health: the cleanup must have succeeded within this time. Default: 3 × the cleanup interval, at least 15 minutes.</summary>
    public TimeSpan? CleanupStaleThreshold { get; set; }

    internal TimeSpan EffectiveCleanupStaleThreshold =>
        CleanupStaleThreshold ?? TimeSpan.FromTicks(Math.Max(CleanupInterval.Ticks * 3, TimeSpan.FromMinutes(15).Ticks));
}
