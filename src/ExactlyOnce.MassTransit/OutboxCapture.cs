using ExactlyOnce.Outbox;
using MassTransit;
using MassTransit.Context;
using MassTransit.Initializers;

namespace ExactlyOnce.MassTransit;

/// <summary>Present in the container when publishes through scoped endpoints are captured into the outbox.</summary>
internal sealed class OutboxCapture;

/// <summary>
/// The publish endpoint of a unit of work: instead of sending, it runs the message through a send context (so every
/// header, id and callback the caller set is kept) and writes it into the scope's outbox. It is saved with the scope's
/// DbContext and published by the dispatcher after the commit, with the same message id.
/// </summary>
internal sealed class OutboxSendEndpoint(IOutboxWriter writer, ConsumeContext? consumeContext) : ISendEndpoint
{
    public ConnectHandle ConnectSendObserver(ISendObserver observer) => NoHandle.Instance;

    public Task Send<T>(T message, CancellationToken cancellationToken = default)
        where T : class => CaptureAsync(message, null, cancellationToken);

    public Task Send<T>(T message, IPipe<SendContext<T>> pipe, CancellationToken cancellationToken = default)
        where T : class => CaptureAsync(message, pipe, cancellationToken);

    public Task Send<T>(T message, IPipe<SendContext> pipe, CancellationToken cancellationToken = default)
        where T : class => CaptureAsync(message, pipe, cancellationToken);

    public Task Send(object message, CancellationToken cancellationToken = default) =>
        Send(message, message.GetType(), cancellationToken);

    public Task Send(object message, Type messageType, CancellationToken cancellationToken = default) =>
        Send(message, messageType, null!, cancellationToken);

    public Task Send(object message, IPipe<SendContext> pipe, CancellationToken cancellationToken = default) =>
        Send(message, message.GetType(), pipe, cancellationToken);

    public Task Send(object message, Type messageType, IPipe<SendContext> pipe, CancellationToken cancellationToken = default)
    {
        ArgumentNullException.ThrowIfNull(message);
        ArgumentNullException.ThrowIfNull(messageType);
        var method = typeof(OutboxSendEndpoint).GetMethod(nameof(CaptureObjectAsync), System.Reflection.BindingFlags.NonPublic | System.Reflection.BindingFlags.Instance)!
            .MakeGenericMethod(messageType);
        return (Task)method.Invoke(this, [message, pipe, cancellationToken])!;
    }

    public async Task Send<T>(object values, CancellationToken cancellationToken = default)
        where T : class => await CaptureAsync(await InitializeAsync<T>(values, cancellationToken).ConfigureAwait(false), null, cancellationToken).ConfigureAwait(false);

    public async Task Send<T>(object values, IPipe<SendContext<T>> pipe, CancellationToken cancellationToken = default)
        where T : class => await CaptureAsync(await InitializeAsync<T>(values, cancellationToken).ConfigureAwait(false), pipe, cancellationToken).ConfigureAwait(false);

    public async Task Send<T>(object values, IPipe<SendContext> pipe, CancellationToken cancellationToken = default)
        where T : class => await CaptureAsync(await InitializeAsync<T>(values, cancellationToken).ConfigureAwait(false), pipe, cancellationToken).ConfigureAwait(false);

    private Task CaptureObjectAsync<T>(object message, IPipe<SendContext>? pipe, CancellationToken cancellationToken)
        where T : class => CaptureAsync((T)message, pipe, cancellationToken);

    private static async Task<T> InitializeAsync<T>(object values, CancellationToken cancellationToken)
        where T : class => (await MessageInitializerCache<T>.Initialize(values, cancellationToken).ConfigureAwait(false)).Message;

    private async Task CaptureAsync<T>(T message, object? pipe, CancellationToken cancellationToken)
        where T : class
    {
        ArgumentNullException.ThrowIfNull(message);
        var context = new MessageSendContext<T>(message, cancellationToken);
        if (consumeContext is not null)
        {
            // What MassTransit does for a publish from a consumer: keep the conversation, name the initiator.
            context.ConversationId = consumeContext.ConversationId;
            context.InitiatorId = consumeContext.MessageId;
            context.CorrelationId ??= consumeContext.CorrelationId;
        }

        if (pipe is IPipe<SendContext<T>> callbacks) // IPipe<SendContext> matches too: the pipe is contravariant
        {
            await callbacks.Send(context).ConfigureAwait(false);
        }

        Type messageType = message.GetType();
        if (messageType.IsInterface || messageType.IsAbstract || messageType.Assembly.IsDynamic)
        {
            throw new NotSupportedException(
                $"ExactlyOnce: the outbox stores concrete message types; publish a class or record instead of '{messageType.FullName}'.");
        }

        writer.Add(new OutboxEntry(
            context.MessageId ?? NewId.NextGuid(),
            OutboxMessageTypes.NameOf(messageType),
            System.Text.Json.JsonSerializer.Serialize(message, messageType, global::MassTransit.Serialization.SystemTextJsonMessageSerializer.Options),
            OutboxHeaders.Capture(context),
            Destination: null));
    }

    private sealed class NoHandle : ConnectHandle
    {
        public static readonly NoHandle Instance = new();

        public void Disconnect()
        {
        }

        public void Dispose()
        {
        }
    }
}

/// <summary>The publish endpoint provider of a unit of work: every publish goes to its outbox.</summary>
internal sealed class OutboxPublishEndpointProvider(IBus bus, IOutboxWriter writer) : IPublishEndpointProvider
{
    public Task<ISendEndpoint> GetPublishSendEndpoint<T>()
        where T : class => Task.FromResult<ISendEndpoint>(new OutboxSendEndpoint(writer, null));

    public ConnectHandle ConnectPublishObserver(IPublishObserver observer) => bus.ConnectPublishObserver(observer);
}

/// <summary>The consume context a consumer sees under the inbox with the outbox on: its publishes join the inbox transaction.</summary>
internal sealed class OutboxConsumeContext<TConsumer, TMessage>(ConsumerConsumeContext<TConsumer, TMessage> context, IOutboxWriter writer)
    : ConsumeContextProxy<TMessage>(context), ConsumerConsumeContext<TConsumer, TMessage>
    where TConsumer : class
    where TMessage : class
{
    public TConsumer Consumer => context.Consumer;

    protected override Task<ISendEndpoint> GetPublishSendEndpoint<T>() =>
        Task.FromResult<ISendEndpoint>(new OutboxSendEndpoint(writer, this));
}
