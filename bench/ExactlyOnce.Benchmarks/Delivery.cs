using System.Diagnostics;
using MassTransit;
using Microsoft.Extensions.Hosting;

namespace ExactlyOnce.Benchmarks;

/// <summary>Sends through a MassTransit bus, setting the message id.</summary>
internal sealed class MassTransitSender(IHost host, ISendEndpoint endpoint) : IBenchSender
{
    public Task SendAsync(Guid messageId, BenchMessage message) => endpoint.Send(message, c => c.MessageId = messageId);

    public ValueTask DisposeAsync()
    {
        host.Dispose();
        return ValueTask.CompletedTask;
    }
}

/// <summary>How the harness publishes for a mode: with the message (envelope) id it chooses.</summary>
internal interface IBenchSender : IAsyncDisposable
{
    Task SendAsync(Guid messageId, BenchMessage message);
}

/// <summary>
/// Finished deliveries of one consumer (processed, or discarded as duplicates), with the times of the first and of the
/// <c>drainCount</c>-th, from which the drain rate is taken.
/// </summary>
internal sealed class DeliveryCounter(int drainCount)
{
    private readonly Stopwatch _clock = Stopwatch.StartNew();
    private int _completed;
    private int _discarded;

    public int Completed => Volatile.Read(ref _completed);

    /// <summary>Of <see cref="Completed"/>, the deliveries known to have been discarded as duplicates (where the mode reports them).</summary>
    public int Discarded => Volatile.Read(ref _discarded);

    public void RecordDiscarded()
    {
        Interlocked.Increment(ref _discarded);
        Record();
    }

    public TimeSpan FirstAt { get; private set; }

    public TimeSpan DrainedAt { get; private set; }

    public void Record()
    {
        // Read the clock before counting: a thread that counts the first delivery and is then descheduled must not
        // stamp "first" after later deliveries (a warm-up at concurrency 64 once measured a negative drain that way).
        TimeSpan now = _clock.Elapsed;
        int completed = Interlocked.Increment(ref _completed);
        if (completed == 1)
        {
            FirstAt = now;
        }
        else if (completed == drainCount)
        {
            DrainedAt = now;
        }
    }
}
