namespace ExactlyOnce.EntityFrameworkCore;

/// <summary>One row of <c>inbox_messages</c>: a claim of a message id by a consumer.</summary>
public sealed class InboxMessage
{
    /// <summary>The broker's message id, stable across redeliveries.</summary>
    public Guid Id { get; set; }

    /// <summary>The consumer's stable identity (the deduplication scope).</summary>
    public string ConsumerType { get; set; } = "";

    /// <summary>When the claim was made (UTC).</summary>
    public DateTime ReceivedAt { get; set; }

    /// <summary>When the consumer's effects were committed (UTC); set in the same transaction as the claim.</summary>
    public DateTime? ProcessedAt { get; set; }
}
