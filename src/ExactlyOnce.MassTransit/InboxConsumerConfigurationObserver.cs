using ExactlyOnce.Telemetry;
using MassTransit;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce.MassTransit;

/// <summary>Attaches the inbox filter to every consumer message pipe configured where it is connected, and validates identities then.</summary>
internal sealed class InboxConsumerConfigurationObserver : IConsumerConfigurationObserver
{
    private readonly ConsumerIdentities _identities;
    private readonly InboxProtocol _protocol;
    private readonly ILogger _logger;
    private readonly bool? _batched;

    public InboxConsumerConfigurationObserver(ConsumerIdentities identities, InboxProtocol protocol, ILogger logger, bool? batched = null)
    {
        _identities = identities;
        _protocol = protocol;
        _logger = logger;
        _batched = batched;
    }

    public void ConsumerConfigured<TConsumer>(IConsumerConfigurator<TConsumer> configurator)
        where TConsumer : class =>
        _identities.Register(typeof(TConsumer));

    public void ConsumerMessageConfigured<TConsumer, TMessage>(IConsumerMessageConfigurator<TConsumer, TMessage> configurator)
        where TConsumer : class
        where TMessage : class
    {
        string name = _identities.Register(typeof(TConsumer));
        configurator.UseFilter(new InboxConsumerFilter<TConsumer, TMessage>(name, _protocol, _logger, _batched));
        Log.FilterAttached(_logger, typeof(TConsumer).FullName ?? typeof(TConsumer).Name, typeof(TMessage).Name, name);
    }
}
