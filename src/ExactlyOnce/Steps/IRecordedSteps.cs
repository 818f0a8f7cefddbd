namespace ExactlyOnce.Steps;

/// <summary>
/// Recorded steps for external calls made by a consumer running under the inbox (scoped: inject it into the consumer).
/// A completed step is never called again for the same message — its recorded result is returned; a step whose
/// outcome is unknown goes to its <see cref="StepPolicy"/>.
/// </summary>
public interface IRecordedSteps
{
    /// <summary>
    /// Runs <paramref name="call"/> as step <paramref name="name"/> of the message being processed, at most once to
    /// completion. The call receives the step's stable idempotency key (pass it to the remote service).
    /// </summary>
    /// <typeparam name="TResult">The call's result; it is recorded as JSON and must round-trip through System.Text.Json.</typeparam>
    /// <param name="name">The step's name: stable across deployments and unique within the consumer's handling of one message.</param>
    /// <param name="call">The external call.</param>
    /// <param name="whenOutcomeUnknown">What to do when an earlier attempt started this step and never recorded its completion.</param>
    /// <param name="cancellationToken">Cancels the call.</param>
    /// <exception cref="StepOutcomeUnknownException">The outcome is unknown and the policy is <see cref="StepPolicy.Park"/>.</exception>
    Task<TResult> RunAsync<TResult>(string name, Func<Guid, CancellationToken, Task<TResult>> call, StepPolicy whenOutcomeUnknown, CancellationToken cancellationToken = default);

    /// <summary>The idempotency key step <paramref name="name"/> of the current message has (the same in every attempt and process).</summary>
    Guid KeyFor(string name);
}

/// <summary>Operator access to the step journal: list parked steps and resolve them (singleton).</summary>
public interface IRecordedStepAdministration
{
    /// <summary>Parked steps, oldest first, with their reasons.</summary>
    Task<IReadOnlyList<StepRecord>> ListParkedAsync(int limit = 100, CancellationToken cancellationToken = default);

    /// <summary>
    /// Resolves a parked (or unknown) step after checking with the remote service: <paramref name="resultJson"/> not
    /// null records it completed with that result (JSON, as the step's call would have returned); null records it not
    /// done, so the next attempt calls again. Then re-drive the message from the parked queue.
    /// </summary>
    Task ResolveAsync(StepKey step, string? resultJson, CancellationToken cancellationToken = default);
}
