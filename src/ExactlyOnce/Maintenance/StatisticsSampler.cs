using ExactlyOnce.Telemetry;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Options;

namespace ExactlyOnce.Maintenance;

/// <summary>The latest statistics, read by the observable gauges (a scrape never queries the database).</summary>
public sealed class StatisticsState
{
    private volatile ExactlyOnceStatistics? _latest;

    /// <summary>The latest snapshot, or null before the first one.</summary>
    public ExactlyOnceStatistics? Latest => _latest;

    internal void Update(ExactlyOnceStatistics statistics) => _latest = statistics;
}

/// <summary>Refreshes <see cref="StatisticsState"/> every <see cref="MaintenanceOptions.StatisticsInterval"/>.</summary>
internal sealed class StatisticsSampler(IMaintenanceStore store, StatisticsState state, IOptions<ExactlyOnceOptions> options,
    TimeProvider timeProvider, ILogger<StatisticsSampler> logger) : BackgroundService
{
    protected override async Task ExecuteAsync(CancellationToken stoppingToken)
    {
        while (!stoppingToken.IsCancellationRequested)
        {
            try
            {
                state.Update(await store.ReadStatisticsAsync(stoppingToken).ConfigureAwait(false));
            }
            catch (OperationCanceledException) when (stoppingToken.IsCancellationRequested)
            {
                return;
            }
            catch (Exception exception)
            {
                Log.StatisticsFailed(logger, exception);
            }

            try
            {
                await Task.Delay(options.Value.Maintenance.StatisticsInterval, timeProvider, stoppingToken).ConfigureAwait(false);
            }
            catch (OperationCanceledException)
            {
                return;
            }
        }
    }
}
