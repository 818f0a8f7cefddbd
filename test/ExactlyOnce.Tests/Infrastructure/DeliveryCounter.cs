using MassTransit;

namespace ExactlyOnce.Tests.Infrastructure;

/// <summary>Counts deliveries that finished the receive pipe (successfully or faulted), so tests wait on facts, not time.</summary>
public sealed class DeliveryCounter : IReceiveObserver
{
    private int _completed;
    private int _faulted;
    private int _consumerFaults;

    /// <summary>Deliveries whose receive pipe completed (including those moved to the error queue).</summary>
    public int Completed => Volatile.Read(ref _completed);

    /// <summary>Deliveries that faulted: a consumer threw, or the receive pipe itself failed.</summary>
    public int Faulted => Volatile.Read(ref _faulted) + Volatile.Read(ref _consumerFaults);

    /// <summary>Deliveries that left the receive pipe, one way or another.</summary>
    public int Handled => Completed + Volatile.Read(ref _faulted);

    public Task PreReceive(ReceiveContext context) => Task.CompletedTask;

    public Task PostReceive(ReceiveContext context)
    {
        Interlocked.Increment(ref _completed);
        return Task.CompletedTask;
    }

    public Task PostConsume<T>(ConsumeContext<T> context, TimeSpan duration, string consumerType) where T : class => Task.CompletedTask;

    public Task ConsumeFault<T>(ConsumeContext<T> context, TimeSpan duration, string consumerType, Exception exception) where T : class
    {
        Interlocked.Increment(ref _consumerFaults);
        return Task.CompletedTask;
    }

    public Task ReceiveFault(ReceiveContext context, Exception exception)
    {
        Interlocked.Increment(ref _faulted);
        return Task.CompletedTask;
    }
}
