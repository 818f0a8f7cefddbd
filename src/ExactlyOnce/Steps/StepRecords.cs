namespace ExactlyOnce.Steps;

/// <summary>A recorded step: one named external call made while processing one message for one consumer.</summary>
/// <param name="Message">The message and consumer.</param>
/// <param name="Name">The step's name, unique within the consumer's handling of one message.</param>
public readonly record struct StepKey(InboxKey Message, string Name);

/// <summary>The recorded state of a step.</summary>
public enum StepStatus
{
    /// <summary>Started and never recorded as completed: if no attempt is running, the outcome is unknown.</summary>
    Started,

    /// <summary>Completed; the result is recorded and returned to every later attempt without calling again.</summary>
    Completed,

    /// <summary>Known not to have acted (the call said so, or an operator or reconciliation established it): the next attempt calls.</summary>
    NotDone,

    /// <summary>The outcome was unknown and the policy parked the message; waits for an operator.</summary>
    Parked,
}

/// <summary>One row of the step journal.</summary>
public sealed record StepRecord(StepKey Key, Guid IdempotencyKey, StepStatus Status, string? Result, int Attempts, DateTime StartedAt, DateTime? CompletedAt, string? Reason);

/// <summary>
/// The step journal. Every method is its own short transaction on its own connection — never the consumer's — so
/// what it records survives the consumer's rollback.
/// </summary>
public interface IStepStore
{
    /// <summary>Reads the step's record, or <see langword="null"/> if it never started.</summary>
    Task<StepRecord?> FindAsync(StepKey key, CancellationToken cancellationToken = default);

    /// <summary>
    /// Records that an attempt is about to call: inserts a started row, or moves a row in <paramref name="expected"/>
    /// state back to started and counts the attempt. Returns <see langword="false"/> when the row was not in the expected state.
    /// </summary>
    Task<bool> StartAsync(StepKey key, Guid idempotencyKey, StepStatus? expected, DateTime nowUtc, CancellationToken cancellationToken = default);

    /// <summary>Records the step completed with <paramref name="result"/> (JSON).</summary>
    Task CompleteAsync(StepKey key, string result, DateTime nowUtc, CancellationToken cancellationToken = default);

    /// <summary>Sets the step's status and reason (parked, not done, or started again by an operator).</summary>
    Task SetStatusAsync(StepKey key, StepStatus status, string? reason, DateTime nowUtc, CancellationToken cancellationToken = default);

    /// <summary>Lists steps in <paramref name="status"/>, oldest first.</summary>
    Task<IReadOnlyList<StepRecord>> ListAsync(StepStatus status, int limit, CancellationToken cancellationToken = default);

    /// <summary>Deletes at most <paramref name="batchSize"/> completed or not-done steps started before <paramref name="cutoffUtc"/>.</summary>
    Task<int> DeleteSettledAsync(DateTime cutoffUtc, int batchSize, CancellationToken cancellationToken = default);
}
