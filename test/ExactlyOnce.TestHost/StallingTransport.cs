using ExactlyOnce.Outbox;
using Microsoft.Extensions.DependencyInjection;

namespace ExactlyOnce.TestHost;

/// <summary>
/// Wraps the real outbox transport: after <c>publishesBeforeStall</c> confirmed publishes it prints STALLED and never
/// returns, so the dispatcher is stuck in the middle of a batch — some of its rows published, none marked — until the
/// test kills the process.
/// </summary>
public sealed class StallingTransport(IOutboxTransport inner, int publishesBeforeStall) : IOutboxTransport
{
    private readonly TaskCompletionSource _firstPublished = new(TaskCreationOptions.RunContinuationsAsynchronously);
    private int _started;
    private int _confirmed;

    public static void Decorate(IServiceCollection services, int publishesBeforeStall)
    {
        var original = services.Last(d => d.ServiceType == typeof(IOutboxTransport));
        services.Remove(original);
        services.AddSingleton<IOutboxTransport>(sp => new StallingTransport(
            (IOutboxTransport)ActivatorUtilities.CreateInstance(sp, original.ImplementationType!), publishesBeforeStall));
    }

    public async Task SendAsync(OutboxEntry entry, CancellationToken cancellationToken = default)
    {
        int started = Interlocked.Increment(ref _started);
        if (started > publishesBeforeStall)
        {
            // Stall only once the first ones were confirmed by the broker, so exactly that many are out there.
            await _firstPublished.Task;
            if (started == publishesBeforeStall + 1)
            {
                Console.WriteLine("STALLED");
                await Console.Out.FlushAsync(cancellationToken);
            }

            await Task.Delay(Timeout.Infinite, CancellationToken.None);
        }

        await inner.SendAsync(entry, cancellationToken);
        if (Interlocked.Increment(ref _confirmed) == publishesBeforeStall)
        {
            _firstPublished.SetResult();
        }
    }
}
