using ExactlyOnce.MassTransit;
using ExactlyOnce.Outbox;
using MassTransit;
using MassTransit.Transports;
using Microsoft.Extensions.DependencyInjection.Extensions;

namespace Microsoft.Extensions.DependencyInjection;

/// <summary>Registers the MassTransit side of the ExactlyOnce outbox.</summary>
public static class ExactlyOnceMassTransitServiceCollectionExtensions
{
    /// <summary>
    /// Makes publishing part of the unit of work. The scoped <see cref="IPublishEndpoint"/> (what an API request gets
    /// from DI) and the <c>ConsumeContext</c> of a consumer running under the inbox write published messages into the
    /// outbox of the scope's DbContext instead of sending them; they commit with the business data (and the inbox
    /// claim) and the dispatcher publishes them afterwards, keeping their message ids. The root <see cref="IBus"/> is
    /// not affected. Call it after <c>AddMassTransit</c>, and after <c>AddExactlyOnce&lt;TDbContext&gt;()</c>.
    /// </summary>
    public static IServiceCollection AddExactlyOnceMassTransitOutbox(this IServiceCollection services)
    {
        ArgumentNullException.ThrowIfNull(services);
        if (!services.Any(d => d.ServiceType == typeof(IOutboxWriter)))
        {
            throw new InvalidOperationException(
                "ExactlyOnce: AddExactlyOnceMassTransitOutbox needs services.AddExactlyOnce<TDbContext>() first (it registers the outbox store).");
        }

        services.TryAddSingleton<OutboxCapture>();
        services.RemoveAll<IPublishEndpoint>();
        services.AddScoped<IPublishEndpoint>(sp => new PublishEndpoint(
            new OutboxPublishEndpointProvider(sp.GetRequiredService<IBus>(), sp.GetRequiredService<IOutboxWriter>())));
        return services;
    }

    /// <summary>
    /// Adds the hosted outbox dispatcher, publishing through MassTransit's <see cref="IBus"/> with broker confirmation.
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
