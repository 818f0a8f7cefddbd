namespace ExactlyOnce.Steps;

/// <summary>
/// What a recorded step does when an earlier attempt started it and never recorded its completion — the process died
/// or the call failed in between, so whether the remote service acted is unknown. Never a silent repeat.
/// </summary>
public abstract class StepPolicy
{
    private protected StepPolicy(string name) => Name = name;

    /// <summary>The policy's name, as logged and tagged.</summary>
    public string Name { get; }

    /// <summary>
    /// Call again with the same idempotency key. Choose it only for services that honour idempotency keys: they
    /// return the first call's result instead of acting twice.
    /// </summary>
    public static StepPolicy RetryWithSameKey { get; } = new Simple("retry-with-same-key");

    /// <summary>
    /// Set the message aside: the step is recorded as parked with the reason, the message goes to the endpoint's
    /// parked queue, and nothing more is called until an operator resolves the step and re-drives the message.
    /// </summary>
    public static StepPolicy Park { get; } = new Simple("park");

    /// <summary>
    /// Ask the remote service what happened: <paramref name="reconcile"/> receives the idempotency key and returns
    /// <see cref="Reconciliation.Done{TResult}(TResult)"/> with the result it found (recorded, not called again) or
    /// <see cref="Reconciliation.NotDone{TResult}"/> (then the call is made, with the same key).
    /// </summary>
    public static StepPolicy Reconcile<TResult>(Func<Guid, CancellationToken, Task<Reconciliation<TResult>>> reconcile)
    {
        ArgumentNullException.ThrowIfNull(reconcile);
        return new ReconcilePolicy<TResult>(reconcile);
    }

    /// <inheritdoc />
    public override string ToString() => Name;

    private sealed class Simple(string name) : StepPolicy(name);
}

/// <summary>Any reconcile policy, whatever its result type.</summary>
internal interface IReconcilePolicy;

internal sealed class ReconcilePolicy<TResult>(Func<Guid, CancellationToken, Task<Reconciliation<TResult>>> reconcile) : StepPolicy("reconcile"), IReconcilePolicy
{
    public Func<Guid, CancellationToken, Task<Reconciliation<TResult>>> Callback { get; } = reconcile;
}

/// <summary>What a reconciliation found out at the remote service.</summary>
/// <typeparam name="TResult">The step's result type.</typeparam>
public readonly record struct Reconciliation<TResult>
{
    internal Reconciliation(bool done, TResult? result)
    {
        IsDone = done;
        Result = result;
    }

    /// <summary>Whether the remote service had acted.</summary>
    public bool IsDone { get; }

    /// <summary>The result the remote service reported, when <see cref="IsDone"/>.</summary>
    public TResult? Result { get; }
}

/// <summary>Creates <see cref="Reconciliation{TResult}"/> values.</summary>
public static class Reconciliation
{
    /// <summary>The remote service had acted; <paramref name="result"/> is what the call would have returned.</summary>
    public static Reconciliation<TResult> Done<TResult>(TResult result) => new(true, result);

    /// <summary>The remote service had not acted: the call is made (with the same idempotency key).</summary>
    public static Reconciliation<TResult> NotDone<TResult>() => new(false, default);
}
