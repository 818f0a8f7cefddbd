using ExactlyOnce;
using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Outbox;
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
}
