using ExactlyOnce;
using ExactlyOnce.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection.Extensions;

namespace Microsoft.Extensions.DependencyInjection;

/// <summary>Registers ExactlyOnce on your own EF Core <see cref="DbContext"/>.</summary>
public static class ExactlyOnceEntityFrameworkServiceCollectionExtensions
{
    /// <summary>
    /// Adds ExactlyOnce with its inbox in <typeparamref name="TDbContext"/> (which must be registered as scoped, the
    /// default of <c>AddDbContext</c>, and whose model calls <c>AddExactlyOnceInbox()</c>). Safe to call twice.
    /// </summary>
    public static IServiceCollection AddExactlyOnce<TDbContext>(this IServiceCollection services, Action<ExactlyOnceOptions>? configure = null)
        where TDbContext : DbContext
    {
        ArgumentNullException.ThrowIfNull(services);
        services.AddExactlyOnceCore(configure);
        services.TryAddScoped<IInboxStore, EntityFrameworkInboxStore<TDbContext>>();
        return services;
    }
}
