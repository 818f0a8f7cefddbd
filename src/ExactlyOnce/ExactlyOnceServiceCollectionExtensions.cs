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
        services.TryAddSingleton(sp => new InboxProtocol(
            sp.GetRequiredService<IOptions<ExactlyOnceOptions>>(),
            sp.GetRequiredService<TimeProvider>(),
            sp.GetRequiredService<ExactlyOnceTelemetry>(),
            sp.GetRequiredService<ILogger<InboxProtocol>>()));
        return services;
    }
}
