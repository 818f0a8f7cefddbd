using Microsoft.Extensions.Diagnostics.HealthChecks;
using Microsoft.Extensions.Options;

namespace ExactlyOnce.Maintenance;

/// <summary>Unhealthy when the database cannot be reached (the inbox and the outbox then stop).</summary>
internal sealed class DatabaseHealthCheck(IMaintenanceStore store) : IHealthCheck
{
    public async Task<HealthCheckResult> CheckHealthAsync(HealthCheckContext context, CancellationToken cancellationToken = default)
    {
        try
        {
            await store.ReadStatisticsAsync(cancellationToken).ConfigureAwait(false);
            return HealthCheckResult.Healthy("The database answers.");
        }
        catch (Exception exception) when (exception is not OperationCanceledException)
        {
            return HealthCheckResult.Unhealthy("The database cannot be reached: messages are neither consumed nor dispatched.", exception);
        }
    }
}

/// <summary>Unhealthy when the oldest pending outbox row is older than the threshold: the dispatcher is not keeping up, or not running.</summary>
internal sealed class OutboxBacklogHealthCheck(IMaintenanceStore store, IOptions<ExactlyOnceOptions> options, TimeProvider timeProvider) : IHealthCheck
{
    public async Task<HealthCheckResult> CheckHealthAsync(HealthCheckContext context, CancellationToken cancellationToken = default)
    {
        ExactlyOnceStatistics statistics;
        try
        {
            statistics = await store.ReadStatisticsAsync(cancellationToken).ConfigureAwait(false);
        }
        catch (Exception exception) when (exception is not OperationCanceledException)
        {
            return HealthCheckResult.Unhealthy("The outbox backlog cannot be read.", exception);
        }

        TimeSpan age = statistics.OldestPendingCreatedAtUtc is { } oldest ? timeProvider.GetUtcNow().UtcDateTime - oldest : TimeSpan.Zero;
        var data = new Dictionary<string, object> { ["pending"] = statistics.OutboxPending, ["oldest_pending_age_seconds"] = Math.Max(0, age.TotalSeconds) };
        TimeSpan threshold = options.Value.Maintenance.OutboxBacklogThreshold;
        return age > threshold
            ? HealthCheckResult.Unhealthy($"The oldest of {statistics.OutboxPending} pending outbox messages waits for {age:g} (threshold {threshold:g}): is a dispatcher running, and can it reach the broker?", data: data)
            : HealthCheckResult.Healthy($"{statistics.OutboxPending} outbox messages pending.", data);
    }
}

/// <summary>Unhealthy when the retention cleanup has not succeeded for too long: the tables then grow without bound.</summary>
internal sealed class CleanupHealthCheck(CleanupState state, IOptions<ExactlyOnceOptions> options, TimeProvider timeProvider, ProcessStart started) : IHealthCheck
{
    public Task<HealthCheckResult> CheckHealthAsync(HealthCheckContext context, CancellationToken cancellationToken = default)
    {
        TimeSpan threshold = options.Value.Maintenance.EffectiveCleanupStaleThreshold;
        DateTimeOffset now = timeProvider.GetUtcNow();
        DateTimeOffset since = state.LastSuccess ?? started.At;
        TimeSpan age = now - since;
        if (age <= threshold)
        {
            return Task.FromResult(HealthCheckResult.Healthy(state.LastSuccess is null ? "The cleanup has not completed yet." : $"The cleanup last succeeded {age:g} ago."));
        }

        return Task.FromResult(HealthCheckResult.Unhealthy(state.LastSuccess is null
            ? $"The cleanup has not succeeded since the process started {age:g} ago (threshold {threshold:g})."
            : $"The cleanup last succeeded {age:g} ago (threshold {threshold:g}): processed rows accumulate."));
    }
}

/// <summary>When this process registered its services: the reference point before the first cleanup.</summary>
internal sealed class ProcessStart(TimeProvider timeProvider)
{
    public DateTimeOffset At { get; } = timeProvider.GetUtcNow();
}
