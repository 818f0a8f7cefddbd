using ExactlyOnce;
using ExactlyOnce.Telemetry;
using Microsoft.Extensions.DependencyInjection.Extensions;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Options;

namespace Microsoft.Extensions.DependencyInjection;

/// <summary>Registration of the store-agnostic ExactlyOnce services. Store packages call this for you.</summary>
public static class ExactlyOnceServiceCollectionExtensions
{
    /// <summary>
    /// Adds the inbox protocol, options (validated at startup), consumer identities and telemetry. Safe to call more
    /// than once: later calls only add further option configuration.
    /// </summary>
    public static IServiceCollection AddExactlyOnceCore(this IServiceCollection services, Action<ExactlyOnceOptions>? configure = null)
    {
        ArgumentNullException.ThrowIfNull(services);

        var options = services.AddOptions<ExactlyOnceOptions>();
        if (configure is not null)
        {
            options.Configure(configure);
        }

        options.ValidateOnStart();
        services.TryAddEnumerable(ServiceDescriptor.Singleton<IValidateOptions<ExactlyOnceOptions>, ExactlyOnceOptionsValidator>());
        services.AddMetrics();
        services.TryAddSingleton(TimeProvider.System);
        services.TryAddSingleton<ExactlyOnceTelemetry>();
        services.TryAddSingleton<ConsumerIdentities>();
        services.TryAddSingleton<ExactlyOnce.Outbox.OutboxSignal>();
        services.TryAddSingleton(sp => new InboxProtocol(
            sp.GetRequiredService<IOptions<ExactlyOnceOptions>>(),
            sp.GetRequiredService<TimeProvider>(),
            sp.GetRequiredService<ExactlyOnceTelemetry>(),
            sp.GetRequiredService<ILogger<InboxProtocol>>()));
        return services;
    }

    /// <summary>
    /// Adds the hosted outbox dispatcher. Needs a store (<c>AddExactlyOnce&lt;TDbContext&gt;()</c>) and a transport
    /// (<c>AddExactlyOnceMassTransitOutbox()</c>). Run it in the processes that should publish; several may run.
    /// </summary>
    public static IServiceCollection AddExactlyOnceOutboxDispatcher(this IServiceCollection services)
    {
        ArgumentNullException.ThrowIfNull(services);
        services.AddExactlyOnceCore();
        services.TryAddSingleton(sp => new ExactlyOnce.Outbox.OutboxDispatcher(
            sp.GetRequiredService<ExactlyOnce.Outbox.IOutboxStore>(),
            sp.GetRequiredService<ExactlyOnce.Outbox.IOutboxTransport>(),
            sp.GetRequiredService<ExactlyOnce.Outbox.OutboxSignal>(),
            sp.GetRequiredService<IOptions<ExactlyOnceOptions>>(),
            sp.GetRequiredService<TimeProvider>(),
            sp.GetRequiredService<ExactlyOnceTelemetry>(),
            sp.GetRequiredService<ILogger<ExactlyOnce.Outbox.OutboxDispatcher>>()));
        services.AddHostedService(sp => sp.GetRequiredService<ExactlyOnce.Outbox.OutboxDispatcher>());
        return services;
    }
}
