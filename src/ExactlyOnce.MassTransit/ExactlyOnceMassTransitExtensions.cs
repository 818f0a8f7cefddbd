using ExactlyOnce;
using ExactlyOnce.MassTransit;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Logging.Abstractions;

namespace MassTransit;

/// <summary>Adds the ExactlyOnce inbox to MassTransit consumers.</summary>
public static class ExactlyOnceMassTransitExtensions
{
    /// <summary>
    /// Runs every consumer configured after this call under the inbox: on the bus configurator, all endpoints;
    /// on one receive endpoint, that endpoint. Call it before <c>ConfigureEndpoints</c> / <c>ConfigureConsumer</c>.
    /// Requires <c>services.AddExactlyOnce&lt;TDbContext&gt;()</c>. A retry policy configured on the endpoint
    /// (<c>UseMessageRetry</c>) wraps the inbox: each attempt is a fresh scope, transaction and change tracker.
    /// </summary>
    /// <param name="configurator">The bus factory configurator (all endpoints) or a receive endpoint configurator.</param>
    /// <param name="context">The registration context (the <c>context</c> of <c>UsingRabbitMq((context, cfg) =&gt; …)</c>).</param>
    public static void UseExactlyOnceInbox(this IConsumerConfigurationObserverConnector configurator, IServiceProvider context) =>
        Connect(configurator, context, batched: null);

    /// <summary>
    /// As <see cref="UseExactlyOnceInbox(IConsumerConfigurationObserverConnector, IServiceProvider)"/>, choosing the mode here
    /// instead of from <c>ExactlyOnceOptions.Batching.Enabled</c>: with <paramref name="batched"/> set, deliveries of one
    /// consumer that arrive together share one transaction (one claim statement, a savepoint per message, one commit),
    /// sized and timed by <c>ExactlyOnceOptions.Batching</c>. Give the endpoint a <c>ConcurrentMessageLimit</c> above
    /// <c>Batching.MaxBatchSize</c>: a batch only fills with deliveries that run concurrently. See docs/inbox.md.
    /// </summary>
    /// <param name="configurator">The bus factory configurator (all endpoints) or a receive endpoint configurator.</param>
    /// <param name="context">The registration context (the <c>context</c> of <c>UsingRabbitMq((context, cfg) =&gt; …)</c>).</param>
    /// <param name="batched">Batched mode for the consumers configured after this call; <see langword="false"/> forces one transaction per message.</param>
    public static void UseExactlyOnceInbox(this IConsumerConfigurationObserverConnector configurator, IServiceProvider context, bool batched) =>
        Connect(configurator, context, batched);

    private static void Connect(IConsumerConfigurationObserverConnector configurator, IServiceProvider context, bool? batched)
    {
        ArgumentNullException.ThrowIfNull(configurator);
        ArgumentNullException.ThrowIfNull(context);

        InboxProtocol protocol = context.GetService<InboxProtocol>()
            ?? throw new InvalidOperationException(
                "ExactlyOnce: UseExactlyOnceInbox needs services.AddExactlyOnce<TDbContext>() to be called when the services are registered.");
        ConsumerIdentities identities = context.GetRequiredService<ConsumerIdentities>();
        ILogger logger = context.GetService<ILoggerFactory>()?.CreateLogger("ExactlyOnce.MassTransit") ?? NullLogger.Instance;
        configurator.ConnectConsumerConfigurationObserver(new InboxConsumerConfigurationObserver(identities, protocol, logger, batched));
    }
}
