namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>One row of <c>outbox_messages</c>: a message written with a unit of work, published after it committed.</summary>
public sealed class OutboxMessage
{
    /// <summary>The order of creation; also the primary key.</summary>
    public long Sequence { get; set; }

    /// <summary>The message id; it becomes the broker message id.</summary>
    public Guid MessageId { get; set; }

    /// <summary>The message's CLR type, "Namespace.Type, Assembly".</summary>
    public string MessageType { get; set; } = "";

    /// <summary>The message as JSON.</summary>
    public string Body { get; set; } = "";

    /// <summary>The headers as a JSON object.</summary>
    public string? Headers { get; set; }

    /// <summary>The destination address of a send; null for a publish.</summary>
    public string? Destination { get; set; }

    /// <summary>When the row was written (UTC).</summary>
    public DateTime CreatedAt { get; set; }

    /// <summary>When the broker confirmed the publish (UTC); null while pending.</summary>
    public DateTime? DispatchedAt { get; set; }

    /// <summary>Publish attempts made.</summary>
    public int Attempts { get; set; }

    /// <summary>The last publish error, if any.</summary>
    public string? LastError { get; set; }

    /// <summary>When a failed row is due again (UTC); null when due now.</summary>
    public DateTime? NextAttemptAt { get; set; }
}
