using System.Data.Common;
using System.Text.Json;
using ExactlyOnce.TestHost;
using JasperFx;
using Microsoft.EntityFrameworkCore;
using Microsoft.EntityFrameworkCore.Diagnostics;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;
using RabbitMQ.Client;
using Wolverine;
using Wolverine.EntityFrameworkCore;
using Wolverine.ErrorHandling;
using Wolverine.Persistence.Durability;
using Wolverine.Postgresql;
using Wolverine.RabbitMQ;

namespace ExactlyOnce.Benchmarks;

/// <summary>
/// The peer: Wolverine's durable inbox (PostgreSQL message storage) on a RabbitMQ listener, with the EF Core transactional
/// middleware around a handler that makes the same business write as <see cref="BenchConsumer"/>.
/// </summary>
/// <remarks>
/// How Wolverine deduplicates: a durable listener stores every incoming envelope in <c>wolverine.wolverine_incoming_envelopes</c>,
/// keyed by the envelope id (<see cref="MessageIdentity.IdOnly"/>, the default), before it runs the handler, and
/// acknowledges the broker once the row is stored. A second copy with the same id fails that insert with
/// <see cref="DuplicateIncomingEnvelopeException"/> and is acknowledged and dropped. Handled rows are kept for
/// <c>DurabilitySettings.KeepAfterMessageHandling</c> (default 5 minutes) to catch later copies. The RabbitMQ transport reads
/// the envelope id from the AMQP <c>message_id</c> property, so a genuine duplicate is the same AMQP message published twice.
/// </remarks>
internal static class WolverineMode
{
    public const string Name = "wolverine";

    /// <summary>Starts the consumer process's Wolverine host; every committed handler transaction and every discarded duplicate counts as a finished delivery.</summary>
    public static async Task<IHost> StartConsumerAsync(Settings settings, string queue, string connectionString, DeliveryCounter counter)
    {
        var builder = Host.CreateApplicationBuilder(new HostApplicationBuilderSettings { DisableDefaults = true });
        builder.Logging.SetMinimumLevel(LogLevel.Error);
        builder.Logging.AddSimpleConsole(o => o.SingleLine = true);
        // The discarded duplicates are counted from Wolverine's own log of them (it has no other per-delivery signal for them).
        builder.Logging.AddProvider(new DuplicateDiscardCounter(counter));
        builder.Logging.AddFilter<DuplicateDiscardCounter>("Wolverine", LogLevel.Information);
        builder.UseWolverine(opts =>
        {
            opts.UseRuntimeCompilation();
            opts.ServiceName = "bench-wolverine";
            // One node: Solo skips the leader election and node-assignment agents that a cluster needs (Wolverine's advice
            // for a single process); the inbox and its deduplication are the same in every mode.
            opts.Durability.Mode = DurabilityMode.Solo;
            opts.AutoBuildMessageStorageOnStartup = AutoCreate.CreateOrUpdate;
            opts.PersistMessagesWithPostgresql(connectionString, "wolverine");
            opts.Services.AddDbContextWithWolverineIntegration<BenchDbContext>(
                o => o.UseNpgsql(connectionString).AddInterceptors(new CommitCounter(counter)));
            opts.UseEntityFrameworkCoreTransactions();
            opts.Policies.AutoApplyTransactions();
            opts.Policies.OnAnyException().RetryTimes(5); // as UseMessageRetry(Immediate(5)) in the MassTransit modes

            opts.UseRabbitMq(TestHosts.RabbitMq).AutoProvision();
            opts.ListenToRabbitQueue(queue)
                .PreFetchCount((ushort)(settings.Concurrency * 4))
                .MaximumParallelMessages(settings.Concurrency)
                .UseDurableInbox();

            opts.Discovery.DisableConventionalDiscovery().IncludeType(typeof(WolverineBenchHandler));
        });
        var host = builder.Build();
        await host.StartAsync();
        return host;
    }

    /// <summary>
    /// Declares the queue (and Wolverine's storage) exactly as the consumer will, by starting its host once and stopping it
    /// before anything is published, so the queue can be pre-loaded for the drain.
    /// </summary>
    public static async Task ProvisionAsync(Settings settings, string queue, string connectionString)
    {
        using var host = await StartConsumerAsync(settings, queue, connectionString, new DeliveryCounter(int.MaxValue));
        await host.StopAsync();
    }

    /// <summary>Counts a delivery at each commit of the handler's transaction: the point the MassTransit modes count too.</summary>
    private sealed class CommitCounter(DeliveryCounter counter) : DbTransactionInterceptor
    {
        public override Task TransactionCommittedAsync(DbTransaction transaction, TransactionEndEventData eventData, CancellationToken cancellationToken = default)
        {
            counter.Record();
            return Task.CompletedTask;
        }

        public override void TransactionCommitted(DbTransaction transaction, TransactionEndEventData eventData) => counter.Record();
    }

    /// <summary>
    /// Counts the duplicates the durable inbox discarded. Wolverine 6.62 logs each at Information ("Discarding a duplicate
    /// delivery of envelope … which the inbox already holds"); older paths log <see cref="DuplicateIncomingEnvelopeException"/>.
    /// </summary>
    private sealed class DuplicateDiscardCounter(DeliveryCounter counter) : ILoggerProvider, ILogger
    {
        private const string DiscardTemplate = "Discarding a duplicate delivery of envelope";

        public ILogger CreateLogger(string categoryName) => this;

        public void Dispose()
        {
        }

        public IDisposable? BeginScope<TState>(TState state) where TState : notnull => null;

        public bool IsEnabled(LogLevel logLevel) => true;

        public void Log<TState>(LogLevel logLevel, EventId eventId, TState state, Exception? exception, Func<TState, Exception?, string> formatter)
        {
            bool discarded = exception is DuplicateIncomingEnvelopeException
                || (state is IReadOnlyList<KeyValuePair<string, object?>> values
                    && values.Any(v => v.Key == "{OriginalFormat}" && v.Value is string format && format.StartsWith(DiscardTemplate, StringComparison.Ordinal)));
            if (discarded)
            {
                counter.RecordDiscarded();
            }
        }
    }
}

/// <summary>The Wolverine handler: the same single insert; the transactional middleware saves and commits.</summary>
public static class WolverineBenchHandler
{
    public static void Handle(BenchMessage message, BenchDbContext db) =>
        db.Rows.Add(new BenchRow { Key = message.Key, SentAt = message.SentAt, Phase = message.Phase });
}

/// <summary>
/// Publishes straight to the queue over AMQP in Wolverine's own wire format (what its RabbitMQ sender writes: the envelope id
/// in <c>message_id</c>, the message type name in <c>type</c>, camel-case JSON), persistent and with publisher confirms as
/// MassTransit sends; so the harness chooses every envelope id and can deliver the same envelope twice.
/// </summary>
internal sealed class WolverineAmqpSender : IBenchSender
{
    private static readonly JsonSerializerOptions Json = new(JsonSerializerDefaults.Web);
    private static readonly string MessageType = typeof(BenchMessage).FullName!;
    private readonly IConnection _connection;
    private readonly IChannel _channel;
    private readonly string _queue;

    private WolverineAmqpSender(IConnection connection, IChannel channel, string queue)
    {
        _connection = connection;
        _channel = channel;
        _queue = queue;
    }

    public static async Task<WolverineAmqpSender> ConnectAsync(string queue)
    {
        var connection = await new ConnectionFactory { Uri = TestHosts.RabbitMq }.CreateConnectionAsync();
        var channel = await connection.CreateChannelAsync(new CreateChannelOptions(
            publisherConfirmationsEnabled: true, publisherConfirmationTrackingEnabled: true));
        return new WolverineAmqpSender(connection, channel, queue);
    }

    public async Task SendAsync(Guid messageId, BenchMessage message)
    {
        var properties = new BasicProperties
        {
            MessageId = messageId.ToString(),
            Type = MessageType,
            ContentType = "application/json",
            DeliveryMode = DeliveryModes.Persistent,
        };
        await _channel.BasicPublishAsync("", _queue, mandatory: false, properties, JsonSerializer.SerializeToUtf8Bytes(message, Json));
    }

    public async ValueTask DisposeAsync()
    {
        await _channel.DisposeAsync();
        await _connection.DisposeAsync();
    }
}
