using System.Text.Json;
using ExactlyOnce.Outbox;
using ExactlyOnce.Steps;

namespace ExactlyOnce.Actions;

/// <summary>
/// Schedules external actions that run only after the current unit of work commits (scoped). Each scheduled action
/// is stored in the outbox, in the same transaction as the business data (and the inbox claim); the outbox
/// dispatcher executes it afterwards with its registered <see cref="IAfterCommitAction{TPayload}"/> — at least once,
/// always with the same idempotency key, with attempts, backoff and the last error recorded on its row.
/// </summary>
public interface IAfterCommitActions
{
    /// <summary>
    /// Schedules action <paramref name="name"/> with <paramref name="payload"/>. Inside a consumer under the inbox the
    /// idempotency key is derived from the message id, the consumer and the name (the n-th schedule of one name gets
    /// its own key), so a retried attempt schedules the same key again; elsewhere it is a new key.
    /// </summary>
    /// <returns>The action's idempotency key.</returns>
    Guid Schedule<TPayload>(string name, TPayload payload);

    /// <summary>Schedules action <paramref name="name"/> with an idempotency key of the caller's choosing (for example one the API client sent).</summary>
    Guid Schedule<TPayload>(string name, TPayload payload, Guid idempotencyKey);
}

/// <summary>Executes one kind of after-commit action. Resolved from a fresh DI scope per execution.</summary>
/// <typeparam name="TPayload">What was scheduled; stored as JSON.</typeparam>
public interface IAfterCommitAction<in TPayload>
{
    /// <summary>
    /// Performs the action. It may run more than once for one schedule (a dispatcher that dies after the call and
    /// before recording it) — pass <see cref="AfterCommitActionContext.IdempotencyKey"/> to the remote service. Throwing
    /// records the error and retries after a backoff.
    /// </summary>
    Task ExecuteAsync(TPayload payload, AfterCommitActionContext context, CancellationToken cancellationToken);
}

/// <summary>What an action execution knows about itself.</summary>
/// <param name="Name">The action's name.</param>
/// <param name="IdempotencyKey">The same for every execution of this scheduled action.</param>
/// <param name="Attempt">1 for the first execution, then 2, 3, … after failures (and after a dispatcher crash).</param>
public sealed record AfterCommitActionContext(string Name, Guid IdempotencyKey, int Attempt);

internal sealed class AfterCommitActions(IOutboxWriter outbox, InboxContext inbox) : IAfterCommitActions
{
    public Guid Schedule<TPayload>(string name, TPayload payload)
    {
        AfterCommitActionRoute.ValidateName(name);
        Guid key = inbox.Current is { } message
            ? IdempotencyKeys.ForAction(message, name, inbox.NextActionOccurrence(name))
            : Guid.CreateVersion7();
        return Schedule(name, payload, key);
    }

    public Guid Schedule<TPayload>(string name, TPayload payload, Guid idempotencyKey)
    {
        AfterCommitActionRoute.ValidateName(name);
        if (idempotencyKey == Guid.Empty)
        {
            throw new ArgumentException("ExactlyOnce: an after-commit action needs a non-empty idempotency key.", nameof(idempotencyKey));
        }

        outbox.Add(new OutboxEntry(
            idempotencyKey,
            typeof(TPayload).FullName + ", " + typeof(TPayload).Assembly.GetName().Name,
            JsonSerializer.Serialize(payload, JsonSerializerOptions.Web),
            Headers: null,
            Destination: AfterCommitActionRoute.Prefix + name));
        return idempotencyKey;
    }
}
