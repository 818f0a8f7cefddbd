using ExactlyOnce.MassTransit;
using ExactlyOnce.Outbox;
using Microsoft.Extensions.DependencyInjection.Extensions;

namespace Microsoft.Extensions.DependencyInjection;

/// <summary>Registers the MassTransit side of the ExactlyOnce outbox.</summary>
public static class ExactlyOnceMassTransitServiceCollectionExtensions
{
    /// <summary>
    /// Adds the hosted outbox dispatcher, publishing through MassTransit's <c>IBus</c> with broker confirmation.
    /// Add it to the processes that should dispatch (several may run side by side).
    /// </summary>
    public static IServiceCollection AddExactlyOnceMassTransitOutboxDispatcher(this IServiceCollection services)
    {
        ArgumentNullException.ThrowIfNull(services);
        services.TryAddSingleton<IOutboxTransport, MassTransitOutboxTransport>();
        services.AddExactlyOnceOutboxDispatcher();
        return services;
    }
}
