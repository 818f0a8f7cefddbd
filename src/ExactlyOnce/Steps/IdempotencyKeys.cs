using System.Security.Cryptography;
using System.Text;

namespace ExactlyOnce.Steps;

/// <summary>
/// Stable idempotency keys: a name-based UUID (RFC 9562 version 8, from SHA-256) of the message id, the consumer's
/// identity and the step or action name. The same inputs give the same key in every process and on every attempt, so
/// the key can be handed to a remote service that deduplicates on it.
/// </summary>
public static class IdempotencyKeys
{
    /// <summary>The key of step <paramref name="stepName"/> of <paramref name="message"/>.</summary>
    public static Guid ForStep(InboxKey message, string stepName) => Derive("step", message, stepName);

    /// <summary>The key of the <paramref name="occurrence"/>-th (1-based) after-commit action <paramref name="actionName"/> scheduled while processing <paramref name="message"/>.</summary>
    public static Guid ForAction(InboxKey message, string actionName, int occurrence) =>
        Derive("action", message, occurrence == 1 ? actionName : actionName + "#" + occurrence.ToString(System.Globalization.CultureInfo.InvariantCulture));

    private static Guid Derive(string kind, InboxKey message, string name)
    {
        ArgumentException.ThrowIfNullOrEmpty(name);
        string text = "exactlyonce/" + kind + "\n" + message.MessageId.ToString("N") + "\n" + message.ConsumerName + "\n" + name;
        Span<byte> hash = stackalloc byte[SHA256.HashSizeInBytes];
        SHA256.HashData(Encoding.UTF8.GetBytes(text), hash);
        Span<byte> bytes = hash[..16];
        bytes[6] = (byte)((bytes[6] & 0x0F) | 0x80); // version 8
        bytes[8] = (byte)((bytes[8] & 0x3F) | 0x80); // RFC 9562 variant
        return new Guid(bytes, bigEndian: true);
    }
}
