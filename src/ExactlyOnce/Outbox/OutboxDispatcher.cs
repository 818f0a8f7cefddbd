using ExactlyOnce.Telemetry;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Options;

namespace ExactlyOnce.Outbox;

/// <summary>
/// The dispatcher loop. Claim a batch of due rows under lock (other dispatchers skip them), publish them
/// concurrently with broker confirmation, mark the published ones dispatched and the failed ones with attempts,
/// last error and next attempt time, commit; repeat while batches come back full, then sleep until a commit signal
/// (in-process, or NOTIFY from another process) or the polling interval.
/// </summary>
/// <remarks>
/// Invariants. A row is marked dispatched only after the broker confirmed it, in the same transaction that held its
/// lock; a dispatcher that dies mid-batch releases its locks with its connection and another dispatcher publishes
/// the rows again with the same message ids — at least once, never lost, and the receivers' inboxes discard the
/// copies. A failing row is deferred by backoff and never blocks the rows behind it. Ordering: rows are claimed in
/// sequence order, but a batch is published concurrently, dispatchers run side by side and failed rows are retried
/// later, so no order between messages is guaranteed.
/// </remarks>
public sealed class OutboxDispatcher : BackgroundService
{
    private readonly IOutboxStore _store;
    private readonly IOutboxTransport _transport;
    private readonly OutboxSignal _signal;
    private readonly OutboxOptions _options;
    private readonly TimeProvider _timeProvider;
    private readonly ExactlyOnceTelemetry _telemetry;
    private readonly ILogger<OutboxDispatcher> _logger;

    internal OutboxDispatcher(IOutboxStore store, IOutboxTransport transport, OutboxSignal signal, IOptions<ExactlyOnceOptions> options,
        TimeProvider timeProvider, ExactlyOnceTelemetry telemetry, ILogger<OutboxDispatcher> logger)
    {
        _store = store;
        _transport = transport;
        _signal = signal;
        _options = options.Value.Outbox;
        _timeProvider = timeProvider;
        _telemetry = telemetry;
        _logger = logger;
    }

    /// <inheritdoc />
    protected override async Task ExecuteAsync(CancellationToken stoppingToken)
    {
        Task listener = ListenAsync(stoppingToken);
        TimeSpan errorDelay = TimeSpan.FromMilliseconds(500);
        while (!stoppingToken.IsCancellationRequested)
        {
            try
            {
                int claimed = await DispatchBatchAsync(stoppingToken).ConfigureAwait(false);
                errorDelay = TimeSpan.FromMilliseconds(500);
                if (claimed >= _options.BatchSize)
                {
                    continue; // more may be due
                }

                await _signal.WaitAsync(_options.PollingInterval, stoppingToken).ConfigureAwait(false);
            }
            catch (OperationCanceledException) when (stoppingToken.IsCancellationRequested)
            {
                break;
            }
            catch (Exception exception)
            {
                // The database or the broker is down: nothing was marked, nothing is lost. Back off and try again.
                Log.DispatcherFailed(_logger, exception, errorDelay);
                try
                {
                    await Task.Delay(errorDelay, _timeProvider, stoppingToken).ConfigureAwait(false);
                }
                catch (OperationCanceledException)
                {
                    break;
                }

                errorDelay = TimeSpan.FromTicks(Math.Min(errorDelay.Ticks * 2, TimeSpan.FromSeconds(30).Ticks));
            }
        }

        try
        {
            await listener.ConfigureAwait(false);
        }
        catch (OperationCanceledException)
        {
        }
    }

    /// <summary>Claims, publishes and completes one batch; returns how many rows it claimed.</summary>
    public async Task<int> DispatchBatchAsync(CancellationToken cancellationToken = default)
    {
        IOutboxBatch batch = await _store.ClaimAsync(_options.BatchSize, _timeProvider.GetUtcNow().UtcDateTime, cancellationToken).ConfigureAwait(false);
        await using var batchScope = batch.ConfigureAwait(false);
        if (batch.Entries.Count == 0)
        {
            return 0;
        }

        var results = await Task.WhenAll(batch.Entries.Select(e => PublishAsync(e, cancellationToken))).ConfigureAwait(false);
        var dispatched = new List<long>(results.Length);
        var failed = new List<OutboxFailure>();
        DateTime now = _timeProvider.GetUtcNow().UtcDateTime;
        for (int i = 0; i < results.Length; i++)
        {
            OutboxEntry entry = batch.Entries[i];
            if (results[i] is null)
            {
                dispatched.Add(entry.Sequence);
                _telemetry.RecordDispatched(now - entry.CreatedAt);
            }
            else
            {
                int attempts = entry.Attempts + 1;
                DateTime next = now + _options.BackoffFor(attempts);
                Log.PublishFailed(_logger, results[i], entry.MessageId, entry.Sequence, attempts, next);
                failed.Add(new OutboxFailure(entry.Sequence, Describe(results[i]!), next));
                _telemetry.RecordDispatchFailed();
            }
        }

        await batch.CompleteAsync(dispatched, failed, now, cancellationToken).ConfigureAwait(false);
        return batch.Entries.Count;
    }

    private async Task<Exception?> PublishAsync(OutboxEntry entry, CancellationToken cancellationToken)
    {
        using var timeout = CancellationTokenSource.CreateLinkedTokenSource(cancellationToken);
        timeout.CancelAfter(_options.PublishTimeout);
        try
        {
            await _transport.SendAsync(entry, timeout.Token).ConfigureAwait(false);
            return null;
        }
        catch (Exception exception) when (!cancellationToken.IsCancellationRequested)
        {
            return exception;
        }
    }

    private async Task ListenAsync(CancellationToken stoppingToken)
    {
        while (!stoppingToken.IsCancellationRequested)
        {
            try
            {
                await _store.ListenAsync(_signal.Notify, stoppingToken).ConfigureAwait(false);
                return; // the store has no cross-process notifications
            }
            catch (OperationCanceledException) when (stoppingToken.IsCancellationRequested)
            {
                return;
            }
            catch (Exception exception)
            {
                Log.ListenerFailed(_logger, exception);
                await Task.Delay(TimeSpan.FromSeconds(1), _timeProvider, stoppingToken).ConfigureAwait(false);
            }
        }
    }

    private static string Describe(Exception exception)
    {
        string text = exception.GetType().FullName + ": " + exception.Message;
        return text.Length <= 2000 ? text : text[..2000];
    }
}
