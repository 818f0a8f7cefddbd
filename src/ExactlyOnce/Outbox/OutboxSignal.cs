namespace ExactlyOnce.Outbox;

/// <summary>
/// Wakes the dispatcher as soon as a unit of work with outbox rows has committed. Signals coalesce: any number of
/// commits while the dispatcher is busy leave one pending wake-up, and the dispatcher then drains everything due.
/// </summary>
public sealed class OutboxSignal
{
    private readonly SemaphoreSlim _pending = new(0, 1);

    /// <summary>Signals that rows were committed.</summary>
    public void Notify()
    {
        try
        {
            _pending.Release();
        }
        catch (SemaphoreFullException)
        {
            // A wake-up is already pending.
        }
    }

    /// <summary>Waits for a signal or until <paramref name="timeout"/> passes.</summary>
    public Task<bool> WaitAsync(TimeSpan timeout, CancellationToken cancellationToken) => _pending.WaitAsync(timeout, cancellationToken);
}
