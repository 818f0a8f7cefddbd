using ExactlyOnce;
using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Outbox;
using ExactlyOnce.Steps;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection.Extensions;

namespace Microsoft.Extensions.DependencyInjection;

/// <summary>Registers ExactlyOnce on your own EF Core <see cref="DbContext"/>.</summary>
public static class ExactlyOnceEntityFrameworkServiceCollectionExtensions
{
    /// <summary>
    /// Adds ExactlyOnce with its inbox and outbox in <typeparamref name="TDbContext"/> (which must be registered as
    /// scoped, the default of <c>AddDbContext</c>, and whose model calls <c>AddExactlyOnceInbox()</c> and, to use the
    /// outbox, <c>AddExactlyOnceOutbox()</c>). Adds interceptors to the DbContext that wake the outbox dispatchers
    /// after a commit. Safe to call twice.
    /// </summary>
    public static IServiceCollection AddExactlyOnce<TDbContext>(this IServiceCollection services, Action<ExactlyOnceOptions>? configure = null)
        where TDbContext : DbContext
    {
        ArgumentNullException.ThrowIfNull(services);
        services.AddExactlyOnceCore(configure);
        services.TryAddScoped<IInboxStore, EntityFrameworkInboxStore<TDbContext>>();
        services.TryAddScoped<IOutboxWriter, EntityFrameworkOutboxWriter<TDbContext>>();
        services.TryAddSingleton<IOutboxStore, EntityFrameworkOutboxStore<TDbContext>>();
        services.TryAddSingleton<ExactlyOnce.Maintenance.IMaintenanceStore, EntityFrameworkMaintenanceStore<TDbContext>>();
        if (!services.Any(d => d.ServiceType == typeof(IStepStore)))
        {
            services.AddSingleton<IStepStore>(sp => new EntityFrameworkStepStore<TDbContext>(
                sp.GetRequiredService<IServiceScopeFactory>(), new StepStoreOptions(SharesInboxDatabase: true)));
        }

        if (!services.Any(d => d.ServiceType == typeof(OutboxCommitNotifier)))
        {
            services.AddSingleton<OutboxCommitNotifier>();
            services.AddSingleton<OutboxSaveChangesInterceptor>();
            services.AddSingleton<OutboxTransactionInterceptor>();
            services.ConfigureDbContext<TDbContext>((sp, options) => options.AddInterceptors(
                sp.GetRequiredService<OutboxSaveChangesInterceptor>(),
                sp.GetRequiredService<OutboxTransactionInterceptor>()));
        }

        return services;
    }

    /// <summary>
    /// Keeps the recorded steps' journal in <typeparamref name="TStepsDbContext"/> (whose model calls
    /// <c>AddExactlyOnceRecordedSteps()</c>) instead of the inbox's own DbContext. Needed on SQLite, where the journal's
    /// writes on their own connection cannot share a database file with the consumer's open transaction; optional elsewhere.
    /// </summary>
    public static IServiceCollection AddExactlyOnceRecordedSteps<TStepsDbContext>(this IServiceCollection services)
        where TStepsDbContext : DbContext
    {
        ArgumentNullException.ThrowIfNull(services);
        services.AddExactlyOnceCore();
        services.RemoveAll<IStepStore>();
        bool shares = services.Any(d => d.ServiceType == typeof(IInboxStore) && d.ImplementationType == typeof(EntityFrameworkInboxStore<TStepsDbContext>));
        services.AddSingleton<IStepStore>(sp => new EntityFrameworkStepStore<TStepsDbContext>(
            sp.GetRequiredService<IServiceScopeFactory>(), new StepStoreOptions(shares)));
        return services;
    }
}
