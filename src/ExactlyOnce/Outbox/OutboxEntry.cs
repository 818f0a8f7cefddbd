namespace ExactlyOnce.Outbox;

/// <summary>One outgoing message, as written into the outbox and as read back by the dispatcher.</summary>
/// <param name="MessageId">The message id; it becomes the broker message id, so a re-dispatch is a duplicate to the receiver's inbox.</param>
/// <param name="MessageType">The message's CLR type as "Namespace.Type, Assembly" (no version).</param>
/// <param name="Body">The message serialized as JSON.</param>
/// <param name="Headers">The message headers as a JSON object, or <see langword="null"/>.</param>
/// <param name="Destination">The destination address of a send, or <see langword="null"/> for a publish.</param>
public sealed record OutboxEntry(Guid MessageId, string MessageType, string Body, string? Headers, string? Destination)
{
    /// <summary>The row's sequence (its order of creation); 0 before it is stored.</summary>
    public long Sequence { get; init; }

    /// <summary>Attempts made so far.</summary>
    public int Attempts { get; init; }

    /// <summary>When the row was committed (UTC).</summary>
    public DateTime CreatedAt { get; init; }
}
