namespace ExactlyOnce.Outbox;

/// <summary>Options of the transactional outbox and its dispatcher.</summary>
public sealed class OutboxOptions
{
    /// <summary>Rows claimed and published per dispatcher transaction. Default: 100.</summary>
    public int BatchSize { get; set; } = 100;

    /// <summary>
    /// The fallback poll: how long the dispatcher sleeps when no commit signal arrives. Commits wake it at once
    /// (in-process signal, and PostgreSQL LISTEN/NOTIFY across processes). Default: 5 seconds.
    /// </summary>
    public TimeSpan PollingInterval { get; set; } = TimeSpan.FromSeconds(5);

    /// <summary>How long one publish may take before it counts as a failed attempt. Default: 30 seconds.</summary>
    public TimeSpan PublishTimeout { get; set; } = TimeSpan.FromSeconds(30);

    /// <summary>The first retry delay of a failing row; it doubles per attempt up to <see cref="MaxBackoff"/>. Default: 1 second.</summary>
    public TimeSpan InitialBackoff { get; set; } = TimeSpan.FromSeconds(1);

    /// <summary>The longest delay between two attempts of a failing row. Default: 5 minutes.</summary>
    public TimeSpan MaxBackoff { get; set; } = TimeSpan.FromMinutes(5);

    /// <summary>How long dispatched rows are kept before the retention cleanup removes them. Default: 7 days.</summary>
    public TimeSpan DispatchedRetention { get; set; } = TimeSpan.FromDays(7);

    /// <summary>The delay before attempt <paramref name="attempts"/> + 1 of a failing row.</summary>
    public TimeSpan BackoffFor(int attempts)
    {
        double seconds = InitialBackoff.TotalSeconds * Math.Pow(2, Math.Clamp(attempts - 1, 0, 30));
        return TimeSpan.FromSeconds(Math.Min(seconds, MaxBackoff.TotalSeconds));
    }
}
