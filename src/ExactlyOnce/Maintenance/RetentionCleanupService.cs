using ExactlyOnce.Telemetry;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Options;

namespace ExactlyOnce.Maintenance;

/// <summary>
/// Removes processed inbox rows older than <see cref="ExactlyOnceOptions.InboxRetention"/> and dispatched outbox rows
/// older than <see cref="Outbox.OutboxOptions.DispatchedRetention"/> (after-commit actions included), and completed
/// recorded steps older than the inbox retention, in bounded batches, repeating while batches come
/// back full, then waiting its interval.
/// </summary>
/// <remarks>
/// Invariants: it never deletes an unprocessed inbox row, an undispatched outbox row, or a row inside its retention;
/// each delete is one short statement over at most <see cref="MaintenanceOptions.CleanupBatchSize"/> rows found through
/// an index, so it never stalls the inbox; several instances skip each other's locked rows instead of waiting or
/// deadlocking. All time comes from the injected <see cref="TimeProvider"/>.
/// </remarks>
public sealed class RetentionCleanupService : BackgroundService
{
    private readonly IMaintenanceStore _store;
    private readonly ExactlyOnceOptions _options;
    private readonly TimeProvider _timeProvider;
    private readonly ExactlyOnceTelemetry _telemetry;
    private readonly CleanupState _state;
    private readonly ILogger<RetentionCleanupService> _logger;
    private readonly Steps.IStepStore? _steps;

    internal RetentionCleanupService(IMaintenanceStore store, IOptions<ExactlyOnceOptions> options, TimeProvider timeProvider,
        ExactlyOnceTelemetry telemetry, CleanupState state, ILogger<RetentionCleanupService> logger, Steps.IStepStore? steps = null)
    {
        _steps = steps;
        _store = store;
        _options = options.Value;
        _timeProvider = timeProvider;
        _telemetry = telemetry;
        _state = state;
        _logger = logger;
    }

    /// <inheritdoc />
    protected override async Task ExecuteAsync(CancellationToken stoppingToken)
    {
        while (!stoppingToken.IsCancellationRequested)
        {
            try
            {
                await RunOnceAsync(stoppingToken).ConfigureAwait(false);
            }
            catch (OperationCanceledException) when (stoppingToken.IsCancellationRequested)
            {
                return;
            }
            catch (Exception exception)
            {
                Log.CleanupFailed(_logger, exception, _options.Maintenance.CleanupInterval);
            }

            try
            {
                await Task.Delay(_options.Maintenance.CleanupInterval, _timeProvider, stoppingToken).ConfigureAwait(false);
            }
            catch (OperationCanceledException)
            {
                return;
            }
        }
    }

    /// <summary>One cleanup pass over both tables; returns the rows deleted from each.</summary>
    public async Task<(long Inbox, long Outbox)> RunOnceAsync(CancellationToken cancellationToken = default)
    {
        DateTime now = _timeProvider.GetUtcNow().UtcDateTime;
        int batch = _options.Maintenance.CleanupBatchSize;
        long inbox = await DrainAsync((c, ct) => _store.DeleteProcessedInboxAsync(c, batch, ct), now - _options.InboxRetention, "inbox_messages", cancellationToken).ConfigureAwait(false);
        long outbox = await DrainAsync((c, ct) => _store.DeleteDispatchedOutboxAsync(c, batch, ct), now - _options.Outbox.DispatchedRetention, "outbox_messages", cancellationToken).ConfigureAwait(false);
        if (_steps is not null)
        {
            // Step records follow the inbox's retention: once a message's inbox row may be gone, its steps may go too.
            // Started and parked steps stay until resolved: they are the only trace of an unknown outcome.
            await DrainAsync((c, ct) => _steps.DeleteSettledAsync(c, batch, ct), now - _options.InboxRetention, "recorded_steps", cancellationToken).ConfigureAwait(false);
        }

        _state.Succeeded(_timeProvider.GetUtcNow());
        Log.CleanupCompleted(_logger, inbox, outbox);
        return (inbox, outbox);
    }

    private async Task<long> DrainAsync(Func<DateTime, CancellationToken, Task<int>> delete, DateTime cutoff, string table, CancellationToken cancellationToken)
    {
        long total = 0;
        int deleted;
        do
        {
            deleted = await delete(cutoff, cancellationToken).ConfigureAwait(false);
            total += deleted;
            _telemetry.RecordCleanupDeleted(table, deleted);
        }
        while (deleted >= _options.Maintenance.CleanupBatchSize);

        return total;
    }
}

/// <summary>When the cleanup last succeeded (process-wide), for the gauge and the health check.</summary>
public sealed class CleanupState
{
    private long _lastSuccessTicks;

    /// <summary>The last successful cleanup pass, or null if none has completed in this process.</summary>
    public DateTimeOffset? LastSuccess
    {
        get
        {
            long ticks = Interlocked.Read(ref _lastSuccessTicks);
            return ticks == 0 ? null : new DateTimeOffset(ticks, TimeSpan.Zero);
        }
    }

    internal void Succeeded(DateTimeOffset at) => Interlocked.Exchange(ref _lastSuccessTicks, at.UtcTicks);
}
