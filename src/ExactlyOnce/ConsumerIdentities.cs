using System.Collections.Concurrent;
using System.Reflection;
using Microsoft.Extensions.Options;

namespace ExactlyOnce;

/// <summary>
/// Resolves each consumer type's stable identity — the scope of its deduplication — and guarantees that no two
/// consumer types share one. Order of precedence: <see cref="ExactlyOnceOptions.MapConsumer{TConsumer}"/>, then
/// <see cref="ConsumerIdentityAttribute"/>, then the type's full name. Never the queue name: a queue can be renamed
/// or shared, and deriving the identity from it would silently reset deduplication.
/// </summary>
public sealed class ConsumerIdentities
{
    private readonly ExactlyOnceOptions _options;
    private readonly ConcurrentDictionary<string, Type> _owners = new(StringComparer.Ordinal);
    private readonly object _gate = new();

    /// <summary>Creates the registry over the validated options.</summary>
    public ConsumerIdentities(IOptions<ExactlyOnceOptions> options)
    {
        ArgumentNullException.ThrowIfNull(options);
        _options = options.Value;
    }

    /// <summary>The identity of <paramref name="consumerType"/>, without registering it.</summary>
    public string Resolve(Type consumerType)
    {
        ArgumentNullException.ThrowIfNull(consumerType);
        if (_options.ConsumerNames.TryGetValue(consumerType, out string? mapped))
        {
            return mapped;
        }

        var attribute = consumerType.GetCustomAttribute<ConsumerIdentityAttribute>(inherit: false);
        return attribute?.Name ?? consumerType.FullName ?? consumerType.Name;
    }

    /// <summary>
    /// Resolves and validates the identity of <paramref name="consumerType"/> and records it as taken.
    /// Called while the bus is configured, so a bad identity fails startup before the first message.
    /// </summary>
    /// <exception cref="InvalidOperationException">The identity is empty, longer than 500 characters, or used by another consumer type.</exception>
    public string Register(Type consumerType)
    {
        string name = Resolve(consumerType);
        Validate(consumerType, name);
        lock (_gate)
        {
            Type owner = _owners.GetOrAdd(name, consumerType);
            if (owner != consumerType)
            {
                throw new InvalidOperationException(
                    $"ExactlyOnce: consumers '{owner.FullName}' and '{consumerType.FullName}' both have the inbox identity '{name}'. " +
                    "Each consumer needs its own identity, or they would deduplicate each other's messages. " +
                    "Give one of them another name with [ConsumerIdentity(\"...\")] or options.MapConsumer<T>(\"...\").");
            }
        }

        return name;
    }

    internal static void Validate(Type consumerType, string name)
    {
        if (string.IsNullOrWhiteSpace(name))
        {
            throw new InvalidOperationException(
                $"ExactlyOnce: the inbox identity of consumer '{consumerType.FullName}' is empty.");
        }

        if (name.Length > ExactlyOnceOptions.MaxConsumerNameLength)
        {
            throw new InvalidOperationException(
                $"ExactlyOnce: the inbox identity of consumer '{consumerType.FullName}' is {name.Length} characters long; " +
                $"at most {ExactlyOnceOptions.MaxConsumerNameLength} fit the consumer_type column. " +
                "Give it a shorter name with [ConsumerIdentity(\"...\")] or options.MapConsumer<T>(\"...\").");
        }
    }
}
