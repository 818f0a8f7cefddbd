namespace ExactlyOnce;

/// <summary>
/// The message the current DI scope is processing under the inbox (scoped). Set by the transport integration before
/// the consumer runs; recorded steps and after-commit actions derive their idempotency keys from it.
/// </summary>
public sealed class InboxContext
{
    /// <summary>The (message id, consumer) being processed in this scope, or <see langword="null"/> outside a consumer under the inbox.</summary>
    public InboxKey? Current { get; private set; }

    internal int NextActionOccurrence(string name)
    {
        _occurrences ??= new Dictionary<string, int>(StringComparer.Ordinal);
        _occurrences.TryGetValue(name, out int count);
        _occurrences[name] = count + 1;
        return count + 1;
    }

    private Dictionary<string, int>? _occurrences;

    /// <summary>Enters <paramref name="key"/> for this scope; called once per delivery, before the consumer runs.</summary>
    internal void Enter(InboxKey key)
    {
        Current = key;
        _occurrences = null;
    }

    /// <summary>
    /// Called by the store when an attempt's transaction begins (an execution strategy may run several attempts in one
    /// scope): a retried attempt derives the same action keys again, in the same order.
    /// </summary>
    internal void BeginAttempt() => _occurrences = null;
}
