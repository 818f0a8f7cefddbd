using System.Text.Json;
using ExactlyOnce.Telemetry;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce.Steps;

/// <summary>
/// The step protocol. Record "started" (own transaction) → call → record "completed" with the result (own
/// transaction) → return. A later attempt of the same message reads the record first: completed → the recorded result,
/// no call; not done → call; started → the outcome is unknown (the process died or the call failed between the two
/// records) → the policy decides: call again with the same key, reconcile, or park.
/// </summary>
/// <remarks>
/// Invariants. (1) A call is made only after "started" is durable, so no call can happen without a trace. (2) A step
/// recorded completed is never called again for that (message, consumer). (3) Attempts of one message never run
/// concurrently: each runs under the inbox claim, which a second delivery waits on. (4) The records live outside the
/// consumer's transaction, so they survive its rollback — that is what makes the unknown outcome visible at all.
/// </remarks>
internal sealed class RecordedSteps(IStepStore store, InboxContext inbox, TimeProvider timeProvider, ExactlyOnceTelemetry telemetry, ILogger<RecordedSteps> logger) : IRecordedSteps
{
    public const int MaxNameLength = 200;

    public Guid KeyFor(string name) => IdempotencyKeys.ForStep(CurrentMessage(name), name);

    public async Task<TResult> RunAsync<TResult>(string name, Func<Guid, CancellationToken, Task<TResult>> call, StepPolicy whenOutcomeUnknown, CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(call);
        ArgumentNullException.ThrowIfNull(whenOutcomeUnknown);
        if (whenOutcomeUnknown is IReconcilePolicy && whenOutcomeUnknown is not ReconcilePolicy<TResult>)
        {
            throw new ArgumentException($"ExactlyOnce: step '{name}' returns {typeof(TResult).Name}, but its Reconcile policy was built for another result type.", nameof(whenOutcomeUnknown));
        }

        var key = new StepKey(CurrentMessage(name), name);
        Guid idempotencyKey = IdempotencyKeys.ForStep(key.Message, name);

        // The common case first: a step never seen. Recording "started" is then the only statement before the call.
        if (await store.StartAsync(key, idempotencyKey, expected: null, Now, cancellationToken).ConfigureAwait(false))
        {
            return await CallAsync(key, idempotencyKey, call, cancellationToken).ConfigureAwait(false);
        }

        StepRecord record = await store.FindAsync(key, cancellationToken).ConfigureAwait(false)
            ?? throw new InvalidOperationException(
                $"ExactlyOnce: step '{name}' of message {key.Message.MessageId} was recorded and then removed while this attempt ran.");
        switch (record.Status)
        {
            case StepStatus.Completed:
                telemetry.RecordStep(key, "replayed");
                Log.StepReplayed(logger, name, key.Message.MessageId, key.Message.ConsumerName);
                return Deserialize<TResult>(record.Result);

            case StepStatus.NotDone:
                await store.StartAsync(key, idempotencyKey, StepStatus.NotDone, Now, cancellationToken).ConfigureAwait(false);
                return await CallAsync(key, idempotencyKey, call, cancellationToken).ConfigureAwait(false);

            case StepStatus.Parked:
                telemetry.RecordStep(key, "parked");
                throw new StepOutcomeUnknownException(key, idempotencyKey, record.Reason ?? ParkReason(record));

            default: // Started: an earlier attempt began and never finished; nothing else runs it now (the inbox claim).
                return await ResolveUnknownAsync(key, idempotencyKey, record, call, whenOutcomeUnknown, cancellationToken).ConfigureAwait(false);
        }
    }

    private async Task<TResult> ResolveUnknownAsync<TResult>(StepKey key, Guid idempotencyKey, StepRecord record, Func<Guid, CancellationToken, Task<TResult>> call,
        StepPolicy policy, CancellationToken cancellationToken)
    {
        Log.StepOutcomeUnknown(logger, key.Name, key.Message.MessageId, key.Message.ConsumerName, record.Attempts, record.StartedAt, policy.Name);
        switch (policy)
        {
            case ReconcilePolicy<TResult> reconcile:
                Reconciliation<TResult> found = await reconcile.Callback(idempotencyKey, cancellationToken).ConfigureAwait(false);
                if (found.IsDone)
                {
                    await store.CompleteAsync(key, Serialize(found.Result), Now, cancellationToken).ConfigureAwait(false);
                    telemetry.RecordStep(key, "reconciled-done");
                    return found.Result!;
                }

                telemetry.RecordStep(key, "reconciled-not-done");
                await store.StartAsync(key, idempotencyKey, StepStatus.Started, Now, cancellationToken).ConfigureAwait(false);
                return await CallAsync(key, idempotencyKey, call, cancellationToken).ConfigureAwait(false);

            case var _ when ReferenceEquals(policy, StepPolicy.RetryWithSameKey):
                telemetry.RecordStep(key, "retried-with-same-key");
                await store.StartAsync(key, idempotencyKey, StepStatus.Started, Now, cancellationToken).ConfigureAwait(false);
                return await CallAsync(key, idempotencyKey, call, cancellationToken).ConfigureAwait(false);

            default:
                string reason = ParkReason(record);
                await store.SetStatusAsync(key, StepStatus.Parked, reason, Now, cancellationToken).ConfigureAwait(false);
                telemetry.RecordStep(key, "parked");
                Log.StepParked(logger, key.Name, key.Message.MessageId, key.Message.ConsumerName, reason);
                throw new StepOutcomeUnknownException(key, idempotencyKey, reason);
        }
    }

    private async Task<TResult> CallAsync<TResult>(StepKey key, Guid idempotencyKey, Func<Guid, CancellationToken, Task<TResult>> call, CancellationToken cancellationToken)
    {
        TResult result;
        try
        {
            result = await call(idempotencyKey, cancellationToken).ConfigureAwait(false);
        }
        catch (StepNotPerformedException exception)
        {
            await store.SetStatusAsync(key, StepStatus.NotDone, Describe(exception), Now, CancellationToken.None).ConfigureAwait(false);
            telemetry.RecordStep(key, "not-performed");
            throw;
        }
        catch (Exception exception)
        {
            // The record stays "started": whether the remote service acted is unknown, and the next attempt's policy decides.
            Log.StepCallFailed(logger, exception, key.Name, key.Message.MessageId, key.Message.ConsumerName);
            telemetry.RecordStep(key, "failed");
            try
            {
                await store.SetStatusAsync(key, StepStatus.Started, Describe(exception), Now, CancellationToken.None).ConfigureAwait(false);
            }
            catch (Exception)
            {
                // Only the reason is lost (the store is likely down too); the record still says "started".
            }

            throw;
        }

        await store.CompleteAsync(key, Serialize(result), Now, cancellationToken).ConfigureAwait(false);
        telemetry.RecordStep(key, "executed");
        return result;
    }

    private InboxKey CurrentMessage(string name)
    {
        ArgumentException.ThrowIfNullOrWhiteSpace(name);
        if (name.Length > MaxNameLength)
        {
            throw new ArgumentException($"ExactlyOnce: a step name is at most {MaxNameLength} characters.", nameof(name));
        }

        return inbox.Current ?? throw new InvalidOperationException(
            $"ExactlyOnce: step '{name}' runs outside a consumer under the inbox. Recorded steps need the message id and consumer " +
            "identity of the delivery being processed: inject IRecordedSteps into a consumer configured with UseExactlyOnceInbox.");
    }

    private DateTime Now => timeProvider.GetUtcNow().UtcDateTime;

    private static string ParkReason(StepRecord record) =>
        $"Step '{record.Key.Name}' of message {record.Key.Message.MessageId} for consumer '{record.Key.Message.ConsumerName}' started at " +
        $"{record.StartedAt:o} (attempt {record.Attempts}) and was never recorded as completed: whether the remote service acted is unknown. " +
        $"Check with the remote service (idempotency key {record.IdempotencyKey}), resolve the step, then re-drive the message." +
        (record.Reason is { } last ? $" Last error: {last}" : "");

    private static string Serialize<TResult>(TResult? result) => JsonSerializer.Serialize(result, JsonSerializerOptions.Web);

    private static TResult Deserialize<TResult>(string? json) => json is null ? default! : JsonSerializer.Deserialize<TResult>(json, JsonSerializerOptions.Web)!;

    private static string Describe(Exception exception)
    {
        string text = exception.GetType().FullName + ": " + exception.Message;
        return text.Length <= 2000 ? text : text[..2000];
    }
}

internal sealed class RecordedStepAdministration(IStepStore store, TimeProvider timeProvider) : IRecordedStepAdministration
{
    public Task<IReadOnlyList<StepRecord>> ListParkedAsync(int limit = 100, CancellationToken cancellationToken = default) =>
        store.ListAsync(StepStatus.Parked, limit, cancellationToken);

    public Task ResolveAsync(StepKey step, string? resultJson, CancellationToken cancellationToken = default)
    {
        DateTime now = timeProvider.GetUtcNow().UtcDateTime;
        return resultJson is null
            ? store.SetStatusAsync(step, StepStatus.NotDone, "resolved by an operator: not done", now, cancellationToken)
            : store.CompleteAsync(step, resultJson, now, cancellationToken);
    }
}
