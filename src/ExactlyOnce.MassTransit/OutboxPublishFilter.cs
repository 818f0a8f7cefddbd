using System.Text.Json;
using ExactlyOnce.Outbox;
using MassTransit;
using MassTransit.Configuration;
using MassTransit.Serialization;
using Microsoft.Extensions.DependencyInjection;

namespace ExactlyOnce.MassTransit;

/// <summary>
/// Marks the current async flow as the dispatcher's (or the inbox's own re-queue): its publishes go straight to
/// the broker instead of into the outbox.
/// </summary>
internal static class OutboxBypass
{
    private static readonly AsyncLocal<bool> Active = new();

    public static bool IsActive => Active.Value;

    public static Scope Begin()
    {
        bool previous = Active.Value;
        Active.Value = true;
        return new Scope(previous);
    }

    internal readonly struct Scope(bool previous) : IDisposable
    {
        public void Dispose() => Active.Value = previous;
    }
}

/// <summary>
/// Captures a publish made through a scoped publish endpoint — an API request's <c>IPublishEndpoint</c>, or a
/// consumer's <c>ConsumeContext</c> — into the scope's outbox instead of sending it: the row is saved by the scope's
/// DbContext with the business data (and, under the inbox, with the claim), and the dispatcher publishes it after
/// the commit with the same message id. A publish with no scope (the root <c>IBus</c>) has no unit of work to join
/// and goes straight to the broker, as do MassTransit's own fault events.
/// </summary>
internal sealed class OutboxPublishFilter<T> : IFilter<PublishContext<T>>
    where T : class
{
    private static readonly bool IsFault = typeof(T).IsGenericType && typeof(T).GetGenericTypeDefinition() == typeof(Fault<>);

    public Task Send(PublishContext<T> context, IPipe<PublishContext<T>> next)
    {
        if (IsFault || OutboxBypass.IsActive
            || !context.TryGetPayload(out IServiceProvider? provider)
            || provider.GetService<IOutboxWriter>() is not { } writer)
        {
            return next.Send(context);
        }

        Type messageType = context.Message.GetType();
        if (messageType.IsInterface || messageType.IsAbstract || messageType.Assembly.IsDynamic)
        {
            throw new NotSupportedException(
                $"ExactlyOnce: the outbox stores concrete message types; publish a class or record instead of '{messageType.FullName}'.");
        }

        Guid messageId = context.MessageId ?? NewId.NextGuid();
        writer.Add(new OutboxEntry(
            messageId,
            OutboxMessageTypes.NameOf(messageType),
            JsonSerializer.Serialize(context.Message, messageType, SystemTextJsonMessageSerializer.Options),
            OutboxHeaders.Capture(context),
            Destination: null));
        return Task.CompletedTask; // not sent now: it leaves with the commit
    }

    public void Probe(ProbeContext context) => context.CreateFilterScope("exactlyOnceOutbox");
}

internal sealed class OutboxPublishPipeSpecificationObserver : IPublishPipeSpecificationObserver
{
    public void MessageSpecificationCreated<T>(IMessagePublishPipeSpecification<T> specification)
        where T : class =>
        specification.UseFilter(new OutboxPublishFilter<T>());
}

internal static class OutboxMessageTypes
{
    public static string NameOf(Type type) => type.FullName + ", " + type.Assembly.GetName().Name;

    public static Type Resolve(string name) =>
        Type.GetType(name, throwOnError: false)
        ?? throw new InvalidOperationException($"ExactlyOnce: the outbox message type '{name}' cannot be loaded in this process.");
}

/// <summary>The headers and envelope ids kept with an outbox row, so the dispatched message carries them too.</summary>
internal static class OutboxHeaders
{
    private const string CorrelationIdKey = "eo:correlation-id";
    private const string ConversationIdKey = "eo:conversation-id";
    private const string InitiatorIdKey = "eo:initiator-id";

    public static string? Capture(SendContext context)
    {
        var headers = new Dictionary<string, string>(StringComparer.Ordinal);
        foreach (var header in context.Headers.GetAll())
        {
            if (header.Value is string or bool or int or long or double or Guid or DateTime or DateTimeOffset)
            {
                headers[header.Key] = Convert.ToString(header.Value, System.Globalization.CultureInfo.InvariantCulture) ?? "";
            }
        }

        if (context.CorrelationId is { } correlationId)
        {
            headers[CorrelationIdKey] = correlationId.ToString();
        }

        if (context.ConversationId is { } conversationId)
        {
            headers[ConversationIdKey] = conversationId.ToString();
        }

        if (context.InitiatorId is { } initiatorId)
        {
            headers[InitiatorIdKey] = initiatorId.ToString();
        }

        return headers.Count == 0 ? null : JsonSerializer.Serialize(headers);
    }

    public static void Apply(SendContext context, Guid messageId, string? json)
    {
        context.MessageId = messageId;
        if (json is null)
        {
            return;
        }

        var headers = JsonSerializer.Deserialize<Dictionary<string, string>>(json) ?? [];
        foreach (var (key, value) in headers)
        {
            switch (key)
            {
                case CorrelationIdKey: context.CorrelationId = Guid.Parse(value); break;
                case ConversationIdKey: context.ConversationId = Guid.Parse(value); break;
                case InitiatorIdKey: context.InitiatorId = Guid.Parse(value); break;
                default: context.Headers.Set(key, value); break;
            }
        }
    }
}

/// <summary>Publishes stored outbox rows through the bus, with their original message ids; MassTransit waits for the broker's confirmation.</summary>
internal sealed class MassTransitOutboxTransport(IBus bus) : IOutboxTransport
{
    public async Task SendAsync(OutboxEntry entry, CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(entry);
        Type type = OutboxMessageTypes.Resolve(entry.MessageType);
        object message = JsonSerializer.Deserialize(entry.Body, type, SystemTextJsonMessageSerializer.Options)
            ?? throw new InvalidOperationException($"ExactlyOnce: outbox message {entry.MessageId} has an empty body.");
        using (OutboxBypass.Begin())
        {
            if (entry.Destination is null)
            {
                await bus.Publish(message, type, ctx => OutboxHeaders.Apply(ctx, entry.MessageId, entry.Headers), cancellationToken).ConfigureAwait(false);
            }
            else
            {
                ISendEndpoint endpoint = await bus.GetSendEndpoint(new Uri(entry.Destination)).ConfigureAwait(false);
                await endpoint.Send(message, type, ctx => OutboxHeaders.Apply(ctx, entry.MessageId, entry.Headers), cancellationToken).ConfigureAwait(false);
            }
        }
    }
}
