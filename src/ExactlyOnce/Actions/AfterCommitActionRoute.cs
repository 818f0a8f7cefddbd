using System.Text.Json;
using ExactlyOnce.Outbox;
using ExactlyOnce.Telemetry;
using Microsoft.Extensions.DependencyInjection;

namespace ExactlyOnce.Actions;

/// <summary>A registered action: its name and how to run a stored payload.</summary>
internal sealed class AfterCommitActionRegistration(string name, Type payloadType, Func<IServiceProvider, string, AfterCommitActionContext, CancellationToken, Task> invoke)
{
    public string Name { get; } = name;

    public Type PayloadType { get; } = payloadType;

    public Func<IServiceProvider, string, AfterCommitActionContext, CancellationToken, Task> Invoke { get; } = invoke;

    public static AfterCommitActionRegistration For<TPayload, THandler>(string name)
        where THandler : class, IAfterCommitAction<TPayload> =>
        new(name, typeof(TPayload), (services, body, context, ct) =>
        {
            TPayload payload = JsonSerializer.Deserialize<TPayload>(body, JsonSerializerOptions.Web)!;
            return services.GetRequiredService<THandler>().ExecuteAsync(payload, context, ct);
        });
}

/// <summary>
/// The outbox transport the dispatcher uses: rows whose destination is an action (<c>exactlyonce-action:NAME</c>) run
/// their registered handler in a fresh scope; every other row goes to the message transport.
/// </summary>
internal sealed class AfterCommitActionRoute : IOutboxTransport
{
    public const string Prefix = "exactlyonce-action:";
    public const int MaxNameLength = 200;

    private readonly IOutboxTransport? _messages;
    private readonly Dictionary<string, AfterCommitActionRegistration> _actions;
    private readonly IServiceScopeFactory _scopes;
    private readonly ExactlyOnceTelemetry _telemetry;

    public AfterCommitActionRoute(IOutboxTransport? messages, IEnumerable<AfterCommitActionRegistration> actions, IServiceScopeFactory scopes, ExactlyOnceTelemetry telemetry)
    {
        _messages = messages;
        _actions = new Dictionary<string, AfterCommitActionRegistration>(StringComparer.Ordinal);
        foreach (var action in actions)
        {
            if (!_actions.TryAdd(action.Name, action) && _actions[action.Name].PayloadType != action.PayloadType)
            {
                throw new InvalidOperationException($"ExactlyOnce: after-commit action '{action.Name}' is registered twice with different payload types.");
            }
        }

        _scopes = scopes;
        _telemetry = telemetry;
    }

    public static void ValidateName(string name)
    {
        ArgumentException.ThrowIfNullOrWhiteSpace(name);
        if (name.Length > MaxNameLength)
        {
            throw new ArgumentException($"ExactlyOnce: an action name is at most {MaxNameLength} characters.", nameof(name));
        }
    }

    public async Task SendAsync(OutboxEntry entry, CancellationToken cancellationToken = default)
    {
        if (entry.Destination is not { } destination || !destination.StartsWith(Prefix, StringComparison.Ordinal))
        {
            if (_messages is null)
            {
                throw new InvalidOperationException(
                    "ExactlyOnce: this dispatcher has no message transport for outbox messages; register one (AddExactlyOnceMassTransitOutboxDispatcher).");
            }

            await _messages.SendAsync(entry, cancellationToken).ConfigureAwait(false);
            return;
        }

        string name = destination[Prefix.Length..];
        if (!_actions.TryGetValue(name, out var action))
        {
            throw new InvalidOperationException(
                $"ExactlyOnce: no handler for after-commit action '{name}' is registered in this process; register it with " +
                "services.AddExactlyOnceAfterCommitAction<TPayload, THandler>(name) in every process that runs the outbox dispatcher.");
        }

        AsyncServiceScope scope = _scopes.CreateAsyncScope();
        await using (scope.ConfigureAwait(false))
        {
            try
            {
                await action.Invoke(scope.ServiceProvider, entry.Body, new AfterCommitActionContext(name, entry.MessageId, entry.Attempts + 1), cancellationToken).ConfigureAwait(false);
            }
            catch (Exception)
            {
                _telemetry.RecordAction(name, succeeded: false);
                throw;
            }

            _telemetry.RecordAction(name, succeeded: true);
        }
    }
}
