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
        services.TryAddSingleton<ExactlyOnce.Maintenance.StatisticsState>();
        services.TryAddSingleton<ExactlyOnce.Maintenance.CleanupState>();
        services.TryAddSingleton<ExactlyOnce.Maintenance.ProcessStart>();
        services.TryAddScoped<InboxContext>();
        services.TryAddScoped<ExactlyOnce.Steps.IRecordedSteps, ExactlyOnce.Steps.RecordedSteps>();
        services.TryAddSingleton<ExactlyOnce.Steps.IRecordedStepAdministration, ExactlyOnce.Steps.RecordedStepAdministration>();
        services.TryAddScoped<ExactlyOnce.Actions.IAfterCommitActions, ExactlyOnce.Actions.AfterCommitActions>();
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
            new ExactlyOnce.Actions.AfterCommitActionRoute(
                sp.GetService<ExactlyOnce.Outbox.IOutboxTransport>(),
                sp.GetServices<ExactlyOnce.Actions.AfterCommitActionRegistration>(),
                sp.GetRequiredService<IServiceScopeFactory>(),
                sp.GetRequiredService<ExactlyOnceTelemetry>()),
            sp.GetRequiredService<ExactlyOnce.Outbox.OutboxSignal>(),
            sp.GetRequiredService<IOptions<ExactlyOnceOptions>>(),
            sp.GetRequiredService<TimeProvider>(),
            sp.GetRequiredService<ExactlyOnceTelemetry>(),
            sp.GetRequiredService<ILogger<ExactlyOnce.Outbox.OutboxDispatcher>>()));
        services.AddHostedService(sp => sp.GetRequiredService<ExactlyOnce.Outbox.OutboxDispatcher>());
        return services;
    }

    /// <summary>
    /// Registers the handler of after-commit action <paramref name="name"/> (scheduled with
    /// <see cref="ExactlyOnce.Actions.IAfterCommitActions"/>). Register it in every process that runs the outbox
    /// dispatcher: the dispatcher executes the action after the scheduling transaction committed.
    /// </summary>
    public static IServiceCollection AddExactlyOnceAfterCommitAction<TPayload, THandler>(this IServiceCollection services, string name)
        where THandler : class, ExactlyOnce.Actions.IAfterCommitAction<TPayload>
    {
        ArgumentNullException.ThrowIfNull(services);
        ExactlyOnce.Actions.AfterCommitActionRoute.ValidateName(name);
        services.AddExactlyOnceCore();
        services.TryAddScoped<THandler>();
        services.AddSingleton(ExactlyOnce.Actions.AfterCommitActionRegistration.For<TPayload, THandler>(name));
        return services;
    }

    /// <summary>
    /// Adds the retention cleanup (processed inbox rows after <c>InboxRetention</c>, dispatched outbox rows after
    /// <c>Outbox.DispatchedRetention</c>) and the statistics sampler behind the gauges. Several processes may run it.
    /// </summary>
    public static IServiceCollection AddExactlyOnceMaintenance(this IServiceCollection services)
    {
        ArgumentNullException.ThrowIfNull(services);
        services.AddExactlyOnceCore();
        services.TryAddSingleton(sp => new ExactlyOnce.Maintenance.RetentionCleanupService(
            sp.GetRequiredService<ExactlyOnce.Maintenance.IMaintenanceStore>(),
            sp.GetRequiredService<IOptions<ExactlyOnceOptions>>(),
            sp.GetRequiredService<TimeProvider>(),
            sp.GetRequiredService<ExactlyOnceTelemetry>(),
            sp.GetRequiredService<ExactlyOnce.Maintenance.CleanupState>(),
            sp.GetRequiredService<ILogger<ExactlyOnce.Maintenance.RetentionCleanupService>>(),
            sp.GetService<ExactlyOnce.Steps.IStepStore>()));
        services.AddHostedService(sp => sp.GetRequiredService<ExactlyOnce.Maintenance.RetentionCleanupService>());
        services.AddHostedService<ExactlyOnce.Maintenance.StatisticsSampler>();
        return services;
    }

    /// <summary>
    /// Adds the ExactlyOnce health checks: <c>exactlyonce-database</c> (the database answers),
    /// <c>exactlyonce-outbox-backlog</c> (the oldest pending outbox message is younger than
    /// <c>Maintenance.OutboxBacklogThreshold</c>) and <c>exactlyonce-cleanup</c> (the retention cleanup succeeded within
    /// <c>Maintenance.CleanupStaleThreshold</c>; add it where <see cref="AddExactlyOnceMaintenance"/> runs).
    /// </summary>
    public static IHealthChecksBuilder AddExactlyOnceHealthChecks(this IHealthChecksBuilder builder, bool includeCleanup = true, params string[] tags)
    {
        ArgumentNullException.ThrowIfNull(builder);
        builder.Services.AddExactlyOnceCore();
        builder.AddCheck<ExactlyOnce.Maintenance.DatabaseHealthCheck>("exactlyonce-database", tags: tags);
        builder.AddCheck<ExactlyOnce.Maintenance.OutboxBacklogHealthCheck>("exactlyonce-outbox-backlog", tags: tags);
        if (includeCleanup)
        {
            builder.AddCheck<ExactlyOnce.Maintenance.CleanupHealthCheck>("exactlyonce-cleanup", tags: tags);
        }

        return builder;
    }
}
