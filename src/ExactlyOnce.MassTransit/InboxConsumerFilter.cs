using ExactlyOnce.Outbox;
using ExactlyOnce.Steps;
using ExactlyOnce.Telemetry;
using MassTransit;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce.MassTransit;

/// <summary>
/// Runs one consumer of one message type under the inbox. It sits on the consumer's own pipe, after MassTransit
/// created the consume scope and resolved the consumer, so the <see cref="IInboxStore"/> it resolves from that scope
/// wraps the very <c>DbContext</c> instance the consumer was given. It returns only after the commit (or a duplicate
/// verdict); MassTransit acknowledges after it returns, never before.
/// </summary>
internal sealed class InboxConsumerFilter<TConsumer, TMessage> : IFilter<ConsumerConsumeContext<TConsumer, TMessage>>
    where TConsumer : class
    where TMessage : class
{
    private readonly string _consumerName;
    private readonly InboxProtocol _protocol;
    private readonly ILogger _logger;
    private readonly bool? _batched;

    // batched: the endpoint's choice of mode; null follows ExactlyOnceOptions.Batching.Enabled.
    public InboxConsumerFilter(string consumerName, InboxProtocol protocol, ILogger logger, bool? batched = null)
    {
        _consumerName = consumerName;
        _protocol = protocol;
        _logger = logger;
        _batched = batched;
    }

    public async Task Send(ConsumerConsumeContext<TConsumer, TMessage> context, IPipe<ConsumerConsumeContext<TConsumer, TMessage>> next)
    {
        if (context.MessageId is not { } messageId || messageId == Guid.Empty)
        {
            Log.MessageIdMissing(_logger, typeof(TMessage).Name, _consumerName);
            throw new MessageIdMissingException(
                $"ExactlyOnce: a {typeof(TMessage).FullName} message for consumer '{_consumerName}' has no message id, so it cannot be " +
                "deduplicated. It was not processed. Publish it with a message id (MassTransit sets one unless the sender cleared it; " +
                "raw AMQP publishers must set the message_id property or the envelope's messageId).");
        }

        if (!context.TryGetPayload(out IServiceProvider? provider))
        {
            throw new InvalidOperationException(
                "ExactlyOnce: the consume context has no scoped service provider. Register consumers through AddMassTransit " +
                "(x.AddConsumer<T>()) and configure them with ConfigureConsumer/ConfigureEndpoints, so each message gets a DI scope.");
        }

        IInboxStore store = provider.GetService<IInboxStore>()
            ?? throw new InvalidOperationException(
                "ExactlyOnce: no inbox store is registered. Call services.AddExactlyOnce<TDbContext>() with the DbContext your consumers use.");

        // With the outbox enabled, the consumer's publishes go into its own unit of work: claim, business writes and
        // outgoing events commit together.
        ConsumerConsumeContext<TConsumer, TMessage> consumeContext = provider.GetService<OutboxCapture>() is not null
            && provider.GetService<IOutboxWriter>() is { } writer
            ? new OutboxConsumeContext<TConsumer, TMessage>(context, writer)
            : context;
        var key = new InboxKey(messageId, _consumerName);
        provider.GetService<InboxContext>()?.Enter(key); // recorded steps and after-commit actions derive their keys from it
        try
        {
            Func<CancellationToken, Task> consume = _ => next.Send(consumeContext);
            await (_batched is { } batched
                ? _protocol.ProcessAsync(store, key, consume, batched, context.CancellationToken)
                : _protocol.ProcessAsync(store, key, consume, context.CancellationToken)).ConfigureAwait(false);
        }
        catch (InboxClaimTimeoutException)
        {
            // Retry later, never discard: a copy with the same message id and headers goes back to the input queue
            // (the broker confirms it before this delivery is acknowledged); this delivery then completes. No retry
            // policy is needed for this to hold.
            Uri inputAddress = context.ReceiveContext.InputAddress;
            await context.Forward(inputAddress).ConfigureAwait(false);
            Log.DeliveryDeferred(_logger, messageId, _consumerName, inputAddress);
        }
        catch (StepOutcomeUnknownException exception)
        {
            // Set aside, never lost: a copy with the same message id and headers (plus the reason) goes to the parked
            // queue, confirmed by the broker before this delivery is acknowledged. Retrying here would only park again.
            Uri parked = ParkedAddress(context.ReceiveContext.InputAddress);
            string reason = exception.Message.Length <= 4000 ? exception.Message : exception.Message[..4000];
            await context.Forward(parked, Pipe.Execute<SendContext<TMessage>>(send =>
            {
                send.Headers.Set(ParkedReasonHeader, reason);
                send.Headers.Set(ParkedConsumerHeader, _consumerName);
            })).ConfigureAwait(false);
            Log.MessageParked(_logger, messageId, _consumerName, parked, reason);
        }
    }

    /// <summary>The header that carries why a message was parked.</summary>
    public const string ParkedReasonHeader = "ExactlyOnce-Parked-Reason";

    /// <summary>The header that names the consumer whose step parked the message.</summary>
    public const string ParkedConsumerHeader = "ExactlyOnce-Parked-Consumer";

    /// <summary>The endpoint's parked queue: its input queue's name with <c>_parked</c> appended (next to MassTransit's <c>_error</c>).</summary>
    internal static Uri ParkedAddress(Uri inputAddress)
    {
        // The short "queue:" form makes every transport declare the queue (and, on RabbitMQ, its exchange and binding).
        string queue = inputAddress.AbsolutePath.TrimEnd('/').Split('/')[^1];
        return new Uri("queue:" + queue + "_parked");
    }

    public void Probe(ProbeContext context)
    {
        var scope = context.CreateFilterScope("exactlyOnceInbox");
        scope.Add("consumer", _consumerName);
        if (_batched is { } batched)
        {
            scope.Add("batched", batched);
        }
    }
}
