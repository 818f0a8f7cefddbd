using System.Diagnostics;
using ExactlyOnce.Telemetry;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Options;

namespace ExactlyOnce;

/// <summary>
/// The claim protocol: one transaction per delivery. Begin; claim (message id, consumer) with an insert that
/// does nothing on conflict and writes the row already marked processed; if nothing was inserted, a committed claim
/// exists and the delivery is a duplicate: roll back and report it. Otherwise run the consumer in the same transaction,
/// save and commit — and only after that may the caller acknowledge.
/// </summary>
/// <remarks>
/// Invariants. (1) The consumer runs only while its transaction owns an uncommitted claim; a concurrent delivery of
/// the same key blocks on that claim inside the database, so it cannot enter the consumer until the first commits
/// (it then sees a duplicate) or rolls back (it then owns the claim). (2) A claim becomes visible to others only
/// together with the consumer's effects: the inbox row and the business rows commit or vanish as one. That is why the
/// claim can carry <c>processed_at</c> from the start: no one sees the row before the consumer's effects commit with it,
/// so the row is never written twice. (3) Nothing
/// here depends on a retry policy: a failure leaves nothing behind, and a wait that outlasts the claim timeout
/// surfaces as <see cref="InboxClaimTimeoutException"/> for the transport to retry later. In batched mode
/// (<see cref="InboxBatchingOptions"/>) the same invariants hold per message, several messages to a transaction: see
/// <see cref="InboxBatcher"/>.
/// </remarks>
public sealed class InboxProtocol
{
    private readonly ExactlyOnceOptions _options;
    private readonly TimeProvider _timeProvider;
    private readonly ExactlyOnceTelemetry _telemetry;
    private readonly ILogger<InboxProtocol> _logger;
    private readonly InboxBatcher _batcher;

    internal InboxProtocol(IOptions<ExactlyOnceOptions> options, TimeProvider timeProvider, ExactlyOnceTelemetry telemetry, ILogger<InboxProtocol> logger)
    {
        _options = options.Value;
        _timeProvider = timeProvider;
        _telemetry = telemetry;
        _logger = logger;
        _batcher = new InboxBatcher(_options, timeProvider, telemetry, logger);
    }

    /// <summary>
    /// Processes one delivery of <paramref name="key"/> through <paramref name="store"/>, running <paramref name="consume"/> at
    /// most once per committed claim; batched when <see cref="InboxBatchingOptions.Enabled"/> is set.
    /// </summary>
    /// <returns><see cref="InboxOutcome.Processed"/> or <see cref="InboxOutcome.Duplicate"/>; failures are thrown.</returns>
    public Task<InboxOutcome> ProcessAsync(IInboxStore store, InboxKey key, Func<CancellationToken, Task> consume, CancellationToken cancellationToken = default) =>
        ProcessAsync(store, key, consume, _options.Batching.Enabled, cancellationToken);

    /// <summary>As <see cref="ProcessAsync(IInboxStore, InboxKey, Func{CancellationToken, Task}, CancellationToken)"/>, choosing the mode explicitly.</summary>
    internal async Task<InboxOutcome> ProcessAsync(IInboxStore store, InboxKey key, Func<CancellationToken, Task> consume, bool batched, CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(store);
        ArgumentNullException.ThrowIfNull(consume);

        DateTime receivedAt = _timeProvider.GetUtcNow().UtcDateTime;
        Activity? consumeActivity = Activity.Current; // the transport's consume span, if any: it gets the outcome too
        using var activity = _telemetry.StartProcessActivity(key);
        long started = _timeProvider.GetTimestamp();
        InboxOutcome outcome = InboxOutcome.Failed;
        try
        {
            // A store without batch support (not ours) keeps the one-transaction path.
            outcome = batched && store is IInboxBatchStore batchStore
                ? await _batcher.ProcessAsync(batchStore, key, receivedAt, consume, () => ProcessAloneAsync(store, key, receivedAt, consume, cancellationToken), cancellationToken).ConfigureAwait(false)
                : await ProcessAloneAsync(store, key, receivedAt, consume, cancellationToken).ConfigureAwait(false);
            return outcome;
        }
        catch (InboxClaimTimeoutException)
        {
            outcome = InboxOutcome.Deferred;
            Log.ClaimTimedOut(_logger, key.MessageId, key.ConsumerName, _options.ClaimTimeout);
            throw;
        }
        catch (Steps.StepOutcomeUnknownException exception)
        {
            outcome = InboxOutcome.Parked;
            activity?.SetStatus(ActivityStatusCode.Error, exception.GetType().FullName);
            throw;
        }
        catch (Exception exception) when (exception is not OperationCanceledException || !cancellationToken.IsCancellationRequested)
        {
            Log.ProcessingFailed(_logger, exception, key.MessageId, key.ConsumerName);
            activity?.SetStatus(ActivityStatusCode.Error, exception.GetType().FullName);
            throw;
        }
        finally
        {
            _telemetry.RecordOutcome(key.ConsumerName, outcome, _timeProvider.GetElapsedTime(started), activity, consumeActivity);
        }
    }

    private Task<InboxOutcome> ProcessAloneAsync(IInboxStore store, InboxKey key, DateTime receivedAt, Func<CancellationToken, Task> consume, CancellationToken cancellationToken) =>
        store.ExecuteAsync(ct => AttemptAsync(store, key, receivedAt, consume, ct), cancellationToken);

    private async Task<InboxOutcome> AttemptAsync(IInboxStore store, InboxKey key, DateTime receivedAt, Func<CancellationToken, Task> consume, CancellationToken cancellationToken)
    {
        await store.BeginAsync(cancellationToken).ConfigureAwait(false);
        bool committed = false;
        try
        {
            long claimStarted = _timeProvider.GetTimestamp();
            bool claimed = await store.TryClaimAsync(key, receivedAt, _timeProvider.GetUtcNow().UtcDateTime, _options.ClaimTimeout, cancellationToken).ConfigureAwait(false);
            _telemetry.RecordClaimWait(key.ConsumerName, _timeProvider.GetElapsedTime(claimStarted));
            if (!claimed)
            {
                Log.DuplicateDiscarded(_logger, key.MessageId, key.ConsumerName);
                return InboxOutcome.Duplicate;
            }

            await consume(cancellationToken).ConfigureAwait(false);
            await store.CompleteAsync(cancellationToken).ConfigureAwait(false);
            committed = true;
            Log.Processed(_logger, key.MessageId, key.ConsumerName);
            return InboxOutcome.Processed;
        }
        finally
        {
            if (!committed)
            {
                // Not a cancellable operation: a rollback must happen even when the delivery was cancelled.
                await store.RollbackAsync(CancellationToken.None).ConfigureAwait(false);
            }
        }
    }
}
