using System.Text.Json;
using ExactlyOnce.Outbox;
using MassTransit;
using MassTransit.Serialization;

namespace ExactlyOnce.MassTransit;

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
        // The root IBus is never captured by the outbox: this publish goes to the broker.
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
